"""The KV cache: the interface the engine uses (interface.py), block pool, layer groups and their tables, page
storage, the size formula; none (nocache.py)."""
from kvserve.kv.blocks import BlockKey, BlockPool, NoFreeBlocksError, block_key
from kvserve.kv.groups import LayerGroup, layer_groups
from kvserve.kv.interface import NO_HIT, BlockToLoad, KVCache, PrefixHit
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.nocache import NoKVCache, NoKVStorage
from kvserve.kv.spec import KVSpec
from kvserve.kv.storage import KVStorage

__all__ = ["BlockKey", "block_key", "BlockPool", "NoFreeBlocksError", "LayerGroup", "layer_groups", "NO_HIT",
           "BlockToLoad", "KVCache", "PrefixHit", "KVCacheManager", "KVSpec", "KVStorage", "NoKVCache",
           "NoKVStorage"]
