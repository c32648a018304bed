"""KVCacheManager: one block table per sequence over a shared BlockPool."""
from __future__ import annotations

from collections.abc import Callable

from kvserve.kv.blocks import BlockKey, BlockPool, NoFreeBlocksError

# a prefix block that the second KV tier holds (cached_prefix's hits): share_prefix gives it a fresh block,
# which the block's bytes are read into
LOAD = -1


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

    def cached_prefix(self, keys: list[BlockKey], in_tier: Callable[[BlockKey], bool] | None = None) -> list[int]:
        """The longest run of cached blocks holding the prefix that `keys` describe; with `in_tier`, it goes
        on over the blocks the second tier holds, as LOAD."""
        hits = []
        for key in keys:
            block_id = self.pool.lookup(key)
            if block_id is None:
                break
            hits.append(block_id)
        while in_tier is not None and len(hits) < len(keys) and in_tier(keys[len(hits)]):
            hits.append(LOAD)
        return hits

    def num_hit_blocks(self, hits: list[int]) -> int:
        """Blocks of the prefix that a hit (cached_prefix's blocks) computes, those to load included."""
        return len(hits)

    def num_admit_blocks(self, hits: list[int], num_tokens: int) -> int:
        """Blocks that admitting a sequence over `hits` with its first num_tokens tokens takes from the pool:
        its table's new blocks (those to load included) and the cached hits that are free now."""
        return self.blocks_for(num_tokens) - len(hits) + hits.count(LOAD) + self.num_reclaimed(hits)

    def num_reclaimed(self, block_ids: list[int]) -> int:
        """How many of these cached blocks are free now, so that sharing them takes from the pool."""
        return sum(1 for b in block_ids if b != LOAD and self.pool.ref_counts[b] == 0)

    def share_prefix(self, seq_id: int, block_ids: list[int]) -> None:
        """Start a sequence's table with cached blocks (a prefix hit), and a fresh block for each LOAD."""
        self.hold_prefix(seq_id, block_ids)
        self.fill_loads(seq_id)

    def hold_prefix(self, seq_id: int, block_ids: list[int]) -> None:
        """share_prefix's first half: the cached blocks are the sequence's (out of the free queue, where a
        fresh block could be taken from), LOAD entries stay until fill_loads."""
        if self.block_tables.get(seq_id):
            raise ValueError(f"sequence {seq_id} already has blocks")
        for b in block_ids:
            if b != LOAD:
                self.pool.incref(b)
        self.block_tables[seq_id] = list(block_ids)

    def fill_loads(self, seq_id: int) -> None:
        """share_prefix's second half: a fresh block for each LOAD entry of the sequence's table."""
        table = self.block_tables[seq_id]
        fresh = iter(self.pool.allocate(table.count(LOAD)))
        table[:] = [next(fresh) if b == LOAD else b for b in table]

    def tier_blocks(self, seq_id: int, hits: list[int], keys: list[BlockKey]) -> list[tuple[int, int, int, BlockKey]]:
        """(layer group, table entry, block, key) of each block of a hit (after share_prefix) to load from the
        second tier, in the order of the prefix."""
        table = self.block_tables[seq_id]
        return [(0, j, table[j], keys[j]) for j, b in enumerate(hits) if b == LOAD]

    def usable_prefix(self, seq_id: int, num_blocks: int, missing: list[tuple[int, int]]) -> int:
        """The longest prefix of the sequence's first num_blocks blocks that it can start from when the
        (layer group, table entry) blocks `missing` could not be loaded: up to the first of them."""
        return min((j for _, j in missing), default=num_blocks)

    def truncate(self, seq_id: int, num_blocks: int) -> None:
        """Keep the first num_blocks entries of the sequence's table; let go of the blocks after."""
        self.drop(seq_id, range(num_blocks, len(self.block_tables[seq_id])))

    def keyed_blocks(self, seq_id: int, keys: list[BlockKey]) -> list[tuple[int, BlockKey]]:
        """(block, key) of the sequence's leading blocks that hold `keys`."""
        return list(zip(self.block_tables[seq_id], keys))

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

    def leading_blocks(self, seq_id: int, n: int) -> list[int]:
        """The first n entries of the sequence's table, in the order of `pinned`: where a sink's originals are
        copied to."""
        return self.block_tables[seq_id][:n]

    def rebuild(self, seq_id: int, num_tokens: int) -> list[tuple[list[int], list[int]]]:
        """Give a sequence a table of fresh blocks for the `num_tokens` tokens an eviction keeps; returns (old table,
        new table), whose old blocks it still owns until `release` (the kept tokens are copied over first)."""
        needed = self.blocks_for(num_tokens)
        if needed > self.pool.num_free:
            raise NoFreeBlocksError(f"sequence {seq_id} needs {needed} blocks, {self.pool.num_free} free")
        old = self.block_tables[seq_id]
        self.block_tables[seq_id] = self.pool.allocate(needed)
        return [(old, self.block_tables[seq_id])]

    def release(self, block_ids: list[int]) -> None:
        for b in block_ids:
            self.pool.decref(b)
