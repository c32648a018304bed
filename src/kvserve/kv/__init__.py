"""The KV cache: block pool, per-sequence block tables, page storage, the size formula."""
from kvserve.kv.blocks import BlockPool, NoFreeBlocksError
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.spec import KVSpec
from kvserve.kv.storage import KVStorage

__all__ = ["BlockPool", "NoFreeBlocksError", "KVCacheManager", "KVSpec", "KVStorage"]
