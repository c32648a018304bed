"""The KV cache: block pool, per-sequence block tables, page storage, the size formula; none (nocache.py)."""
from kvserve.kv.blocks import BlockKey, BlockPool, NoFreeBlocksError, block_key
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.nocache import NoKVCacheManager, NoKVStorage
from kvserve.kv.spec import KVSpec
from kvserve.kv.storage import KVStorage

__all__ = ["BlockKey", "block_key", "BlockPool", "NoFreeBlocksError", "KVCacheManager", "KVSpec", "KVStorage",
           "NoKVCacheManager", "NoKVStorage"]
