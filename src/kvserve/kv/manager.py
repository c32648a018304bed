"""KVCacheManager: one block table per sequence over a shared BlockPool."""
from __future__ import annotations

from kvserve.kv.blocks import BlockKey, BlockPool, NoFreeBlocksError


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockCounts:
    """What a KV cache manager answers from its pool and block size (KVCacheManager, and the hybrid cache's
    manager of several layer groups over one pool)."""

    pool: BlockPool
    block_size: int
    # a sequence's computed tokens keep their K/V from one step to the next (kv/nocache.py: they do not)
    recomputes = False

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def release_past_window(self, seq_id: int, next_position: int) -> None:
        """After a step wrote a sequence's tokens up to next_position: let go of the blocks that no later
        query reads (a sliding window's, kv/hybrid.py); every block stays in a full-attention cache."""


class KVCacheManager(BlockCounts):
    """Allocates, grows, forks and frees the block tables of sequences."""

    def __init__(self, num_blocks: int, block_size: int, pool: BlockPool | None = None):
        """`pool`: a pool shared with other managers (the layer groups of a hybrid cache, kv/hybrid.py); by
        default its own."""
        self.block_size = block_size
        self.pool = pool if pool is not None else BlockPool(num_blocks)
        self.block_tables: dict[int, list[int]] = {}
        # blocks a sequence owns outside its table (the unrotated sink blocks of a `sink` policy)
        self.pinned: dict[int, list[int]] = {}

    def num_new_blocks(self, seq_id: int, num_computed: int, num_new: int) -> int:
        """Blocks `allocate` would take from the pool for this write, copies included."""
        table = self.block_tables.get(seq_id, [])
        if num_new == 1:   # a decode (in short): its block copied if shared, else new
            i = num_computed // self.block_size
            return int(self.pool.ref_counts[table[i]] > 1) if i < len(table) else i + 1 - len(table)
        grow = max(0, self.blocks_for(num_computed + num_new) - len(table))
        written = range(*self._written(table, num_computed, num_new).indices(len(table)))
        return grow + sum(1 for i in written if self.pool.ref_counts[table[i]] > 1)

    def _written(self, table: list[int], num_computed: int, num_new: int) -> slice:
        """The existing entries of `table` that a write of tokens [num_computed, +num_new) touches."""
        if num_new == 0:
            return slice(0, 0)
        return slice(num_computed // self.block_size, min(len(table), self.blocks_for(num_computed + num_new)))

    def allocate(self, seq_id: int, num_computed: int, num_new: int) -> list[tuple[int, int]]:
        """Make room for tokens [num_computed, num_computed + num_new) of a sequence.

        Shared blocks in that range are replaced by private copies (copy-on-write); the returned
        (src, dst) pairs are the page copies the storage must perform before the write.
        """
        needed = self.num_new_blocks(seq_id, num_computed, num_new)
        if needed > self.pool.num_free:
            raise NoFreeBlocksError(f"sequence {seq_id} needs {needed} blocks, "
                                    f"{self.pool.num_free} free")
        table = self.block_tables.setdefault(seq_id, [])
        copies = []
        for i in range(*self._written(table, num_computed, num_new).indices(len(table))):
            if self.pool.ref_counts[table[i]] > 1:
                (dst,) = self.pool.allocate(1)
                self.pool.decref(table[i])
                copies.append((table[i], dst))
                table[i] = dst
        table.extend(self.pool.allocate(self.blocks_for(num_computed + num_new) - len(table)))
        return copies

    def cached_prefix(self, keys: list[BlockKey]) -> list[int]:
        """The longest run of cached blocks holding the prefix that `keys` describe."""
        hits = []
        for key in keys:
            block_id = self.pool.lookup(key)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def num_hit_blocks(self, hits: list[int]) -> int:
        """Blocks of the prefix that a hit (cached_prefix's blocks) computes."""
        return len(hits)

    def num_admit_blocks(self, hits: list[int], num_tokens: int) -> int:
        """Blocks that admitting a sequence over `hits` with its first num_tokens tokens takes from the pool:
        its table's new blocks and the cached hits that are free now."""
        return self.blocks_for(num_tokens) - len(hits) + self.num_reclaimed(hits)

    def num_reclaimed(self, block_ids: list[int]) -> int:
        """How many of these cached blocks are free now, so that sharing them takes from the pool."""
        return sum(1 for b in block_ids if self.pool.ref_counts[b] == 0)

    def share_prefix(self, seq_id: int, block_ids: list[int]) -> None:
        """Start a sequence's table with cached blocks (a prefix hit)."""
        if self.block_tables.get(seq_id):
            raise ValueError(f"sequence {seq_id} already has blocks")
        for b in block_ids:
            self.pool.incref(b)
        self.block_tables[seq_id] = list(block_ids)

    def cache_blocks(self, seq_id: int, first: int, keys: list[BlockKey]) -> None:
        """Index the sequence's blocks first, first + 1, ... (now full) under `keys`."""
        table = self.block_tables[seq_id]
        for block_id, key in zip(table[first:], keys):
            self.pool.cache(block_id, key)

    def uncache_blocks(self, seq_id: int, first: int, keys: list[BlockKey]) -> None:
        """Drop blocks first, first + 1, ... of the sequence from the prefix index, if they hold `keys`."""
        for block_id, key in zip(self.block_tables[seq_id][first:], keys):
            self.pool.uncache(block_id, key)

    def fork(self, parent_id: int, child_id: int) -> None:
        """Give `child_id` the parent's blocks, shared by reference count."""
        if child_id in self.block_tables:
            raise ValueError(f"sequence {child_id} already has blocks")
        table = self.block_tables.get(parent_id, [])
        pinned = self.pinned.get(parent_id, [])
        for b in table + pinned:
            self.pool.incref(b)
        self.block_tables[child_id] = list(table)
        if pinned:
            self.pinned[child_id] = list(pinned)

    def free(self, seq_id: int) -> None:
        """Return a sequence's blocks; shared blocks stay with their other owners."""
        for b in reversed(self.block_tables.pop(seq_id, []) + self.pinned.pop(seq_id, [])):
            self.pool.decref(b)

    def drop(self, seq_id: int, indices: range) -> None:
        """Remove entries `indices` of a sequence's table and let go of their blocks (eviction)."""
        table = self.block_tables[seq_id]
        for b in table[indices.start:indices.stop]:
            self.pool.decref(b)
        del table[indices.start:indices.stop]

    def replace(self, seq_id: int, indices: range, pin: bool = False) -> list[int]:
        """Give entries `indices` of a sequence's table fresh blocks; the blocks they held are returned
        (and pinned to the sequence when `pin`, else left to the caller to `release`)."""
        if len(indices) > self.pool.num_free:
            raise NoFreeBlocksError(f"sequence {seq_id} needs {len(indices)} blocks, {self.pool.num_free} free")
        table = self.block_tables[seq_id]
        old = table[indices.start:indices.stop]
        table[indices.start:indices.stop] = self.pool.allocate(len(indices))
        if pin:
            self.pinned.setdefault(seq_id, []).extend(old)
        return old

    def rebuild(self, seq_id: int, num_tokens: int) -> list[int]:
        """Give a sequence a table of fresh blocks for `num_tokens` tokens; returns the old table, whose
        blocks it still owns until `release` (its tokens are copied over first)."""
        needed = self.blocks_for(num_tokens)
        if needed > self.pool.num_free:
            raise NoFreeBlocksError(f"sequence {seq_id} needs {needed} blocks, {self.pool.num_free} free")
        old = self.block_tables[seq_id]
        self.block_tables[seq_id] = self.pool.allocate(needed)
        return old

    def release(self, block_ids: list[int]) -> None:
        for b in block_ids:
            self.pool.decref(b)
