"""BlockPool: the free queue, reference counts and prefix-cache index of the KV pages."""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from kvserve.kv.events import EventSink


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class NoFreeBlocksError(RuntimeError):
    """Raised when the pool has fewer free blocks than asked for."""


@dataclass(frozen=True)
class BlockKey:
    """What a full, cached block holds: checked on every hit, so a hash collision cannot alias."""

    hash: bytes
    parent_hash: bytes | None
    token_ids: tuple[int, ...]
    cache_salt: str | None
    HASH_BYTES: ClassVar[int] = 16      # of the chained hash; a layer group's suffix follows

    def in_group(self, group: int) -> BlockKey:
        """The key of the same tokens in layer group `group` of a hybrid cache, whose blocks hold other
        layers' pages: a distinct hash in each group but the first."""
        if not group:
            return self
        return BlockKey(self.hash + group.to_bytes(2, "little"), self.parent_hash, self.token_ids, self.cache_salt)

    @property
    def group(self) -> int:
        """The layer group whose key this is (in_group)."""
        return self.group_of(self.hash)

    @staticmethod
    def group_of(block_hash: bytes) -> int:
        """The layer group of a key's hash (in_group's suffix; 0 without one)."""
        return int.from_bytes(block_hash[BlockKey.HASH_BYTES:], "little")


def block_key(parent_hash: bytes | None, token_ids: tuple[int, ...], cache_salt: str | None) -> BlockKey:
    """The key of a full block: a hash chained over its parent's hash, its tokens and the salt."""
    h = hashlib.blake2b(digest_size=BlockKey.HASH_BYTES)
    h.update(parent_hash or b"")
    h.update(repr((token_ids, cache_salt)).encode())
    return BlockKey(h.digest(), parent_hash, token_ids, cache_salt)


class BlockPool:
    """Hands out blocks on demand and takes them back when their last owner lets go.

    A freed block that holds a full, hashed prefix stays in the index as a cached block: it counts
    as free, is handed out again on a prefix hit, and is evicted (least recently freed first) only
    when a free block is needed. `on_evict`, if set, is called with the (block, key) pairs of the cached
    blocks an allocation takes, before the caller can overwrite their pages (the second tier copies them);
    `on_cache` with each (block, key) indexed, whose pages the step under way writes (a write-through tier
    saves them after it). `events`, if set, records each key indexed and each key dropped (KV events).
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.keys: list[BlockKey | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}
        self.on_evict: Callable[[list[tuple[int, BlockKey]]], None] | None = None
        self.on_cache: Callable[[int, BlockKey], None] | None = None
        self.events: EventSink | None = None

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
        evicted = [(b, self.keys[b]) for b in ids if self.keys[b] is not None]
        for b in ids:
            self._evict(b)
            self.ref_counts[b] = 1
        if evicted and self.on_evict is not None:
            self.on_evict(evicted)
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

    def reuse_first(self, block_ids: list[int]) -> None:
        """Move those of the blocks that are free and hold no prefix to the front of the free queue, in order: the
        next allocations take them before any cached block, which they would evict (blocks written with tokens that
        were then taken back, a verification's rejected drafts)."""
        for b in reversed(block_ids):
            if not self.ref_counts[b] and self.keys[b] is None:
                self._free.move_to_end(b, last=False)

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
            if self.events is not None:
                self.events.stored(key)
            if self.on_cache is not None:
                self.on_cache(block_id, key)

    def uncache(self, block_id: int, key: BlockKey) -> None:
        """Forget that a block holds `key` (its K/V were never computed)."""
        if self.keys[block_id] == key:
            self._evict(block_id)

    def check_invariants(self, owners: dict[int, int]) -> None:
        """RuntimeError naming the first broken rule, given each owned block's owner count: every reference count is
        its owners, the free queue holds each unowned block once and no owned one, and the prefix index maps each
        indexed hash to the block whose key it is."""
        for b in range(self.num_blocks):
            if self.ref_counts[b] != owners.get(b, 0):
                raise RuntimeError(f"block {b}: reference count {self.ref_counts[b]}, {owners.get(b, 0)} owners")
        owned = {b for b, n in owners.items() if n}
        if owned & self._free.keys():
            raise RuntimeError(f"owned blocks in the free queue: {sorted(owned & self._free.keys())}")
        if len(self._free) + len(owned) != self.num_blocks:
            raise RuntimeError(f"{len(self._free)} free and {len(owned)} owned blocks, of {self.num_blocks}: leaked")
        for block_hash, b in self._cached.items():
            if self.keys[b] is None or self.keys[b].hash != block_hash:
                raise RuntimeError(f"the prefix index maps a hash to block {b}, which holds another key")
        if sum(key is not None for key in self.keys) != len(self._cached):
            raise RuntimeError("a block holds a key the prefix index does not map to it")

    def _evict(self, block_id: int) -> None:
        key = self.keys[block_id]
        if key is not None:
            del self._cached[key.hash]
            self.keys[block_id] = None
            if self.events is not None:
                self.events.removed(key.hash)
