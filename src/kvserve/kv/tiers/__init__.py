"""The second KV tier behind one connector interface (connector.py): the tiers (base.py; host memory, disk, Redis),
what builds each rank's (factory.py), and the connector that binds one to the pool (offloading.py)."""
from kvserve.kv.tiers.base import (DEFAULT_KV_OFFLOAD_SIZE, OffloadSpec, Tier, TierCompat, TierCounters,
                                   model_identity, parse_kv_offload)
from kvserve.kv.tiers.blockformat import BlockFormat, CorruptBlock
from kvserve.kv.tiers.connector import KVConnector, NoConnector
from kvserve.kv.tiers.disk import SUFFIX, DiskTier
from kvserve.kv.tiers.factory import TierConfig
from kvserve.kv.tiers.host import HostTier
from kvserve.kv.tiers.offloading import (PREEMPTION_MODES, OffloadingConnector, SwapCosts, measure_prefill,
                                         swap_is_cheaper)
from kvserve.kv.tiers.redis import RedisTier

__all__ = ["DEFAULT_KV_OFFLOAD_SIZE", "OffloadSpec", "Tier", "TierCompat", "TierCounters", "model_identity",
           "parse_kv_offload", "BlockFormat", "KVConnector", "NoConnector", "SUFFIX", "CorruptBlock", "DiskTier",
           "TierConfig", "HostTier", "PREEMPTION_MODES", "OffloadingConnector", "SwapCosts", "measure_prefill",
           "swap_is_cheaper", "RedisTier"]
