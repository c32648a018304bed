"""BlockPool: the free queue, reference counts and prefix-cache index of the KV pages."""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass


class NoFreeBlocksError(RuntimeError):
    """Raised when the pool has fewer free blocks than asked for."""


@dataclass(frozen=True)
class BlockKey:
    """What a full, cached block holds: checked on every hit, so a hash collision cannot alias."""

    hash: bytes
    parent_hash: bytes | None
    token_ids: tuple[int, ...]
    cache_salt: str | None


def block_key(parent_hash: bytes | None, token_ids: tuple[int, ...], cache_salt: str | None) -> BlockKey:
    """The key of a full block: a hash chained over its parent's hash, its tokens and the salt."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent_hash or b"")
    h.update(repr((token_ids, cache_salt)).encode())
    return BlockKey(h.digest(), parent_hash, token_ids, cache_salt)


class BlockPool:
    """Hands out blocks on demand and takes them back when their last owner lets go.

    A freed block that holds a full, hashed prefix stays in the index as a cached block: it counts
    as free, is handed out again on a prefix hit, and is evicted (least recently freed first) only
    when a free block is needed.
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.keys: list[BlockKey | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise NoFreeBlocksError(f"asked for {n} blocks, {len(self._free)} free")
        ids = [self._free.popitem(last=False)[0] for _ in range(n)]
        for b in ids:
            self._evict(b)
            self.ref_counts[b] = 1
        return ids

    def _check(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block id {block_id} is outside the pool of {self.num_blocks} blocks")

    def incref(self, block_id: int) -> None:
        """Add an owner to a block; a cached free block leaves the free queue."""
        self._check(block_id)
        if self.ref_counts[block_id] == 0:
            if self.keys[block_id] is None:
                raise RuntimeError(f"block {block_id} is free; it cannot be shared")
            del self._free[block_id]
        self.ref_counts[block_id] += 1

    def decref(self, block_id: int) -> None:
        """Drop one owner; the block joins the end of the free queue when none is left."""
        self._check(block_id)
        if self.ref_counts[block_id] < 1:
            raise RuntimeError(f"block {block_id} is already free (double free)")
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] == 0:
            self._free[block_id] = None

    def lookup(self, key: BlockKey) -> int | None:
        """The cached block holding exactly `key`'s tokens after the same prefix, if any."""
        block_id = self._cached.get(key.hash)
        return block_id if block_id is not None and self.keys[block_id] == key else None

    def indexed_blocks(self) -> list[int]:
        """The blocks the prefix index holds, free (cached) or owned, in no particular order."""
        return list(self._cached.values())

    def cache(self, block_id: int, key: BlockKey) -> None:
        """Index a block that has just become full; a block already holding this prefix wins."""
        if self.keys[block_id] is None and key.hash not in self._cached:
            self.keys[block_id] = key
            self._cached[key.hash] = block_id

    def uncache(self, block_id: int, key: BlockKey) -> None:
        """Forget that a block holds `key` (its K/V were never computed)."""
        if self.keys[block_id] is key:
            self._evict(block_id)

    def _evict(self, block_id: int) -> None:
        key = self.keys[block_id]
        if key is not None:
            del self._cached[key.hash]
            self.keys[block_id] = None
