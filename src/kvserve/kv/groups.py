"""Layer groups: the layers that share one block table per sequence, and the block tables of one group.

Layers that attend to the whole context form one kind, layers of each distinct sliding window another.
Each kind is cut into groups of the same number of layers, so that one block of the pool holds the pages
of that many layers whatever group it serves (kv/storage.py). A model without binding windows is one
full-attention group of every layer.

Each group keeps its own block tables over the shared pool (vLLM's single-type managers under its
coordinator, kv/manager.py): `FullAttentionTables` holds every block of a sequence; `SlidingWindowTables`
lets go of a block once every token in it has left the window of the next query, and puts the pool's
null block in its place, so that a table's entry j still holds tokens [j * block_size, (j + 1) *
block_size): attention never reads the null block's positions (they lie outside the window), and its
pages stay zero.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvserve.kv.blocks import BlockKey, BlockPool, NoFreeBlocksError, cdiv


@dataclass(frozen=True)
class LayerGroup:
    """Layers whose block tables are one: their sliding window (None: full attention) and their indices."""

    sliding_window: int | None
    layers: tuple[int, ...]


def layer_groups(windows: tuple[int | None, ...], max_model_len: int) -> list[LayerGroup]:
    """The layer groups of a model whose layer i attends within windows[i] (None: the whole context).

    A window of max_model_len or more never binds: its layers join the full-attention ones. Kinds of
    nearly the same size (within a quarter) are padded to the largest; otherwise every kind is cut into
    groups of the smallest's size, the last group of a kind possibly shorter (its missing layers' pages
    are unused): vLLM's rule, which bounds the padding while keeping the groups few."""
    kinds: dict[int | None, list[int]] = {}
    for i, w in enumerate(windows):
        kinds.setdefault(w if w is not None and w < max_model_len else None, []).append(i)
    sizes = [len(layers) for layers in kinds.values()]
    size = max(sizes) if max(sizes) < 1.25 * min(sizes) else min(sizes)
    order = sorted(kinds, key=lambda w: (w is not None, w or 0))     # the full-attention group first
    return [LayerGroup(w, tuple(kinds[w][i:i + size])) for w in order for i in range(0, len(kinds[w]), size)]


def is_hybrid(groups: list[LayerGroup]) -> bool:
    """Whether some layer attends within a window that binds: the groups then need tables of their own."""
    return any(g.sliding_window is not None for g in groups)


def window_blocks(window: int, block_size: int, num_tokens: int) -> int:
    """The most blocks a sliding group's table holds for a sequence of num_tokens tokens: the blocks that
    the window of its last query touches (and those of the chunk being written: `num_tokens` counts them)."""
    return min(cdiv(num_tokens, block_size), cdiv(window - 1, block_size) + 1)


class GroupPool:
    """A layer group's view of the shared BlockPool: the same blocks, counting those the group holds (a block
    serves the group that took it from the pool until it returns there), so that stats cost nothing per block."""

    def __init__(self, pool: BlockPool, group: int, held: list[int], owner: list[int]):
        self.pool, self.group, self.held, self.owner = pool, group, held, owner
        self.ref_counts = pool.ref_counts       # the pool's own list: read on every decode step

    @property
    def num_free(self) -> int:
        return self.pool.num_free

    def allocate(self, n: int) -> list[int]:
        ids = self.pool.allocate(n)
        for b in ids:
            self.owner[b] = self.group
        self.held[self.group] += n
        return ids

    def incref(self, block_id: int) -> None:
        if not self.ref_counts[block_id]:       # a cached block back in use
            self.held[self.owner[block_id]] += 1
        self.pool.incref(block_id)

    def decref(self, block_id: int) -> None:
        self.pool.decref(block_id)
        if not self.ref_counts[block_id]:
            self.held[self.owner[block_id]] -= 1


class GroupTables:
    """The block tables of one layer group: allocates, grows, forks and frees them over the group's pool.

    Entry j of a table holds the sequence's cached tokens [j * block_size, (j + 1) * block_size) in this
    group's layers. `find` (a callable of a key) is how a prefix lookup asks whether a block is cached: the
    cached block id, None where it is not, or the coordinator's marker of a block the second tier holds."""

    sliding_window: int | None = None

    def __init__(self, pool: GroupPool, block_size: int):
        self.pool = pool
        self.block_size = block_size
        self.block_tables: dict[int, list[int]] = {}
        # blocks a sequence owns outside its table (the unrotated sink blocks of a `sink` policy)
        self.pinned: dict[int, list[int]] = {}

    def blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    # ---- what each kind of group answers itself -------------------------------------------------

    def needed_blocks(self, num_blocks: int) -> int:
        """How many of the last blocks of a prefix of num_blocks blocks the token after it reads here."""
        raise NotImplementedError

    def max_blocks_held(self, num_tokens: int, chunk: int) -> int:
        """The most blocks a sequence of num_tokens tokens holds here, written in chunks of at most `chunk`."""
        raise NotImplementedError

    def longest_usable(self, num_blocks: int, gone: set[int]) -> int:
        """The longest prefix of at most num_blocks blocks whose blocks this group needs are none of `gone`."""
        for h in range(num_blocks, 0, -1):
            if not any(j in gone for j in range(h - self.needed_blocks(h), h)):
                return h
        return 0

    def hit(self, keys: list[BlockKey], n: int, find: Callable[[BlockKey], int | None]) -> list[int]:
        """This group's table of the longest prefix hit of at most n of `keys`' blocks."""
        raise NotImplementedError

    def release_past_window(self, seq_id: int, next_position: int) -> None:
        """After a step wrote a sequence's tokens up to next_position: let go of the blocks no later query reads."""

    # ---- writes ---------------------------------------------------------------------------

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
        """Room for tokens [num_computed, num_computed + num_new): shared blocks there are replaced by private
        copies (copy-on-write); returns the (src, dst) page copies to make before the write. The caller has
        checked that the pool has the blocks (num_new_blocks)."""
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

    # ---- prefixes -------------------------------------------------------------------------

    def hold_prefix(self, seq_id: int, block_ids: list[int | None]) -> None:
        """Start a sequence's table with a hit's blocks, held (out of the free queue, where a fresh block could
        be taken from); None entries (blocks to load) stay until fill_loads."""
        if self.block_tables.get(seq_id):
            raise ValueError(f"sequence {seq_id} already has blocks")
        for b in block_ids:
            if b is not None:
                self.pool.incref(b)
        self.block_tables[seq_id] = list(block_ids)

    def fill_loads(self, seq_id: int) -> None:
        """A fresh block for each None entry of the sequence's table (hold_prefix's blocks to load)."""
        table = self.block_tables[seq_id]
        fresh = iter(self.pool.allocate(table.count(None)))
        table[:] = [next(fresh) if b is None else b for b in table]

    def num_admit_blocks(self, block_ids: list[int | None], num_tokens: int) -> int:
        """Blocks that admitting a sequence over a hit's blocks with its first num_tokens tokens takes from the
        pool: its table's new blocks (those to load included) and the cached hits that are free now."""
        reclaimed = sum(1 for b in block_ids if b is not None and self.pool.ref_counts[b] == 0)
        return self.blocks_for(num_tokens) - len(block_ids) + block_ids.count(None) + reclaimed

    def cache_blocks(self, seq_id: int, first: int, keys: list[BlockKey]) -> None:
        """Index the sequence's blocks first, first + 1, ... (now full) under `keys`."""
        for block_id, key in zip(self.block_tables[seq_id][first:], keys):
            self.pool.pool.cache(block_id, key)

    def uncache_blocks(self, seq_id: int, first: int, keys: list[BlockKey]) -> None:
        """Drop blocks first, first + 1, ... of the sequence from the prefix index, if they hold `keys`."""
        for block_id, key in zip(self.block_tables[seq_id][first:], keys):
            self.pool.pool.uncache(block_id, key)

    def truncate(self, seq_id: int, num_blocks: int) -> None:
        """Keep the first num_blocks entries of the sequence's table; let go of the blocks after (those that hold no
        prefix first in line to be taken again: BlockPool.reuse_first)."""
        dropped = self.block_tables[seq_id][num_blocks:]
        self.drop(seq_id, range(num_blocks, num_blocks + len(dropped)))
        self.pool.pool.reuse_first(dropped)

    # ---- lifetime -------------------------------------------------------------------------

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

    def release(self, block_ids: list[int]) -> None:
        for b in block_ids:
            self.pool.decref(b)

    # ---- eviction -------------------------------------------------------------------------

    def drop(self, seq_id: int, indices: range) -> None:
        """Remove entries `indices` of a sequence's table and let go of their blocks."""
        table = self.block_tables[seq_id]
        for b in table[indices.start:indices.stop]:
            self.pool.decref(b)
        del table[indices.start:indices.stop]

    def replace(self, seq_id: int, indices: range, pin: bool = False) -> list[int]:
        """Give entries `indices` of a sequence's table fresh blocks; the blocks they held are returned (and
        pinned to the sequence when `pin`, else left to the caller to `release`)."""
        table = self.block_tables[seq_id]
        old = table[indices.start:indices.stop]
        table[indices.start:indices.stop] = self.pool.allocate(len(indices))
        if pin:
            self.pinned.setdefault(seq_id, []).extend(old)
        return old

    def num_shared(self, seq_id: int, indices: range) -> int:
        """Entries `indices` of a sequence's table whose blocks another sequence holds too."""
        table = self.block_tables[seq_id]
        return sum(1 for b in table[indices.start:indices.stop] if self.pool.ref_counts[b] > 1)

    def unshare(self, seq_id: int, indices: range) -> None:
        """A fresh block for each of entries `indices` whose block another sequence holds too; the shared one is
        let go of. The fresh block's contents are the caller's to write, whole."""
        table = self.block_tables[seq_id]
        for i in range(indices.start, min(indices.stop, len(table))):
            if self.pool.ref_counts[table[i]] > 1:
                self.pool.decref(table[i])
                (table[i],) = self.pool.allocate(1)

    def rebuild(self, seq_id: int, num_tokens: int) -> tuple[list[int], list[int]]:
        """Give a sequence a table of fresh blocks for the num_tokens tokens an eviction keeps; returns (old table,
        new table), whose old blocks it still owns until `release` (the kept tokens are copied over first)."""
        old = self.block_tables[seq_id]
        self.block_tables[seq_id] = self.pool.allocate(self.blocks_for(num_tokens))
        return old, self.block_tables[seq_id]


class FullAttentionTables(GroupTables):
    """Layers that attend to the whole context: a sequence holds every block of its tokens."""

    def needed_blocks(self, num_blocks: int) -> int:
        return num_blocks

    def max_blocks_held(self, num_tokens: int, chunk: int) -> int:
        return self.blocks_for(num_tokens)

    def longest_usable(self, num_blocks: int, gone: set[int]) -> int:
        return min(num_blocks, *gone) if gone else num_blocks

    def hit(self, keys: list[BlockKey], n: int, find: Callable[[BlockKey], int | None]) -> list[int]:
        hits = []
        for key in keys[:n]:
            block_id = find(key)
            if block_id is None:
                break
            hits.append(block_id)
        return hits


class SlidingWindowTables(GroupTables):
    """Layers that attend within `window` tokens: a sequence lets go of the blocks that left the window of its
    next query, the `null_block` taking their entries. A prefix hit needs only the blocks of the window of the
    token after it."""

    def __init__(self, pool: GroupPool, block_size: int, window: int, null_block: int):
        super().__init__(pool, block_size)
        self.sliding_window, self.null_block = window, null_block
        self.released: dict[int, int] = {}     # per sequence: how many leading entries are the null block

    def needed_blocks(self, num_blocks: int) -> int:
        return num_blocks - max(0, num_blocks * self.block_size - self.sliding_window + 1) // self.block_size

    def max_blocks_held(self, num_tokens: int, chunk: int) -> int:
        return window_blocks(self.sliding_window + chunk, self.block_size, num_tokens)

    def hit(self, keys: list[BlockKey], n: int, find: Callable[[BlockKey], int | None]) -> list[int]:
        # the token after a hit of h blocks attends to those from position h * bs - W + 1: scan back from n
        # for the first h whose blocks from there are all cached
        if n and not self.needed_blocks(n):         # a window of one token: the query attends to itself alone
            return [self.null_block] * n
        run: list[int] = []
        for h in range(n, 0, -1):
            block_id = find(keys[h - 1])
            if block_id is None:
                run = []
                continue
            run.append(block_id)
            # blocks h-1 .. h-1+len(run)-1 are cached: a hit of h - 1 + len(run) blocks needs the last `need` of them
            end = h - 1 + len(run)
            need = self.needed_blocks(end)
            if len(run) >= need:
                kept = list(reversed(run))[:need]
                return [self.null_block] * (end - len(kept)) + kept
        return []

    def release_past_window(self, seq_id: int, next_position: int) -> None:
        """Let go of the blocks wholly before the window of a query at next_position, (next_position - W,
        next_position]."""
        table = self.block_tables.get(seq_id)
        if table is None:
            return
        first = self.released.get(seq_id, 0)
        last = min(len(table), max(0, next_position - self.sliding_window + 1) // self.block_size)
        for j in range(first, last):
            self.pool.decref(table[j])
            self.pool.incref(self.null_block)
            table[j] = self.null_block
        if last > first:
            self.released[seq_id] = last

    def hold_prefix(self, seq_id: int, block_ids: list[int | None]) -> None:
        super().hold_prefix(seq_id, block_ids)
        nulls = next((i for i, b in enumerate(block_ids) if b != self.null_block), len(block_ids))
        if nulls:
            self.released[seq_id] = nulls

    def cache_blocks(self, seq_id: int, first: int, keys: list[BlockKey]) -> None:
        """Index full blocks, never the null block (a window of one token lets go of a block as it fills)."""
        for block_id, key in zip(self.block_tables[seq_id][first:], keys):
            if block_id != self.null_block:
                self.pool.pool.cache(block_id, key)

    def fork(self, parent_id: int, child_id: int) -> None:
        super().fork(parent_id, child_id)
        if parent_id in self.released:
            self.released[child_id] = self.released[parent_id]

    def free(self, seq_id: int) -> None:
        super().free(seq_id)
        self.released.pop(seq_id, None)

    def drop(self, seq_id: int, indices: range) -> None:
        super().drop(seq_id, indices)
        nulls = self.released.get(seq_id, 0)
        if nulls > indices.start:
            self.released[seq_id] = nulls - (min(nulls, indices.stop) - indices.start)


def check_free(pool: GroupPool | BlockPool, seq_id: int, needed: int) -> None:
    """NoFreeBlocksError unless the pool has `needed` free blocks for the sequence."""
    if needed > pool.num_free:
        raise NoFreeBlocksError(f"sequence {seq_id} needs {needed} blocks, {pool.num_free} free")
