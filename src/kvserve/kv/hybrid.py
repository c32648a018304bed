"""The hybrid KV cache: a block table per layer group over one pool (vLLM's hybrid KV cache manager).

Layers that attend to the whole context form one kind, layers of each distinct sliding window another.
Each kind is cut into groups of the same number of layers (`group_size`), so that one block of the
pool holds the pages of `group_size` layers whatever group it serves: the storage keeps `group_size`
page tensors, and layer i's pages are those of its place within its group (`slot`). With layers kept in the
model's dtype among quantized ones (kv_cache_dtype_skip_layers), a block holds enough tensors of each dtype for
any group (`block_spec`), each layer taking one of its own dtype. A group has its own block table per
sequence. A sliding group lets go of a block once every token in it has left the window of the next query,
and puts the pool's `null_block` in its place, so that a table's entry j still holds tokens
[j * block_size, (j + 1) * block_size): attention never reads the null block's positions (they lie outside
the window), and its pages stay zero.

Prefix caching: each group indexes its blocks under its own keys (BlockKey.in_group). A prefix hit needs
the whole prefix's blocks in a full-attention group but only a sliding group's last window of them. The
second KV tier keeps each group's blocks under the same keys: a hit finds each block it needs in the pool
or in the tier, which loads it into a fresh block.

Eviction: entry j of a sequence's table holds the same cached tokens in every group. A `sink` policy drops the
same entries in every group and pins the originals of its sink blocks in the full-attention groups alone; a sliding
group's dropped entries are the null block already, since a sink's window is at least the group's. `h2o` and
`snapkv` compact the full-attention groups into fresh blocks; they evict whole blocks' worth of tokens, all older than
their recent tokens (at least the widest window), so that a sliding group only drops as many leading entries (the
null block) and keeps its window's blocks, never rewritten, at the entries that now hold those tokens.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from kvserve.kv.blocks import BlockKey, BlockPool, NoFreeBlocksError
from kvserve.kv.manager import LOAD, BlockCounts, KVCacheManager, cdiv
from kvserve.kv.quant import QuantizedLayer
from kvserve.kv.spec import KVSpec
from kvserve.kv.storage import KVStorage


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
    """Whether the groups need the hybrid cache: some layer attends within a window that binds."""
    return any(g.sliding_window is not None for g in groups)


def group_size(groups: list[LayerGroup]) -> int:
    """Layers one block holds the pages of: those of the largest group."""
    return max(len(g.layers) for g in groups)


def _full_precision_slots(groups: list[LayerGroup], quantized: set[int]) -> int:
    """Page tensors of a block kept in the model's dtype: those of the group with the most unquantized layers."""
    return max(sum(layer not in quantized for layer in g.layers) for g in groups)


def block_spec(spec: KVSpec, groups: list[LayerGroup]) -> KVSpec:
    """The spec of one block of the pool (its num_layers: the page tensors a block holds), from the model's.

    A block serves one group at a time, and each of its page tensors must hold its layer's pages in that layer's
    dtype whatever the group: with kv_cache_dtype_skip_layers, the block holds as many full-precision tensors as
    any group has unquantized layers, then as many quantized ones as any group has quantized layers (the pool's
    skip_layers are the leading tensors). Without, group_size tensors of one kind. Where the two maxima come from
    different groups, a block is larger than any one group's pages: the page layouts of the two dtypes cannot
    share bytes, their block axis not leading."""
    quantized = set(spec.quantized_layers)
    full = _full_precision_slots(groups, quantized)
    quant = max(sum(layer in quantized for layer in g.layers) for g in groups)
    return replace(spec, num_layers=full + quant, skip_layers=tuple(range(full)) if quant else ())


def layer_slots(groups: list[LayerGroup], num_layers: int, quantized: set[int] = frozenset()
                ) -> tuple[list[int], list[int]]:
    """For each layer: the page tensor it uses and its group's index. A group's unquantized layers take the
    block's full-precision tensors in order, its `quantized` ones the quantized tensors after those (block_spec)."""
    slots, owner = [0] * num_layers, [0] * num_layers
    first_quantized = _full_precision_slots(groups, quantized)
    for g, group in enumerate(groups):
        full = [layer for layer in group.layers if layer not in quantized]
        quant = [layer for layer in group.layers if layer in quantized]
        for place, layer in [*enumerate(full), *enumerate(quant, first_quantized)]:
            slots[layer], owner[layer] = place, g
    return slots, owner


def window_blocks(window: int, block_size: int, num_tokens: int) -> int:
    """The most blocks a sliding group's table holds for a sequence of num_tokens tokens: the blocks that
    the window of its last query touches (and those of the chunk being written: `num_tokens` counts them)."""
    return min(cdiv(num_tokens, block_size), cdiv(window - 1, block_size) + 1)


class GroupPool:
    """A layer group's view of the shared BlockPool: the same blocks, counting those the group holds (a block
    serves the group that took it from the pool until it returns there), so that stats cost nothing per block."""

    def __init__(self, pool: BlockPool, group: int, held: list[int], owner: list[int], null_block: int):
        self.pool, self.group, self.held, self.owner, self.null_block = pool, group, held, owner, null_block
        self.ref_counts = pool.ref_counts       # the pool's own list: read on every decode step
        self.num_blocks = pool.num_blocks

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

    def lookup(self, key: BlockKey) -> int | None:
        return self.pool.lookup(key)

    def cache(self, block_id: int, key: BlockKey) -> None:
        """Index a full block, never the null block (a window of one token lets go of a block as it fills)."""
        if block_id != self.null_block:
            self.pool.cache(block_id, key)

    def uncache(self, block_id: int, key: BlockKey) -> None:
        self.pool.uncache(block_id, key)


class HybridKVCacheManager(BlockCounts):
    """One KVCacheManager per layer group, over one BlockPool; the same interface as KVCacheManager.

    Each call acts on every group: a write takes blocks in each (what it takes is the sum), a sequence's
    free, fork and preemption free or share each group's table. `block_tables` are the first group's
    (the full-attention one, where the model has one): what the engine shows of a sequence's blocks;
    `group_tables` gives each group's.
    """

    def __init__(self, num_blocks: int, block_size: int, groups: list[LayerGroup]):
        if num_blocks < 2:
            raise ValueError(f"a hybrid KV cache needs at least 2 blocks (one is the null block), got {num_blocks}")
        self.block_size = block_size
        self.layer_groups = groups
        self.pool = BlockPool(num_blocks)
        # stands in a sliding group's table for the blocks that left the window; never freed, never written
        (self.null_block,) = self.pool.allocate(1)
        # blocks each group holds (what its tables own), and each block's group
        self._held, owner = [0] * len(groups), [0] * num_blocks
        pools = [GroupPool(self.pool, g, self._held, owner, self.null_block) for g in range(len(groups))]
        self.groups = [KVCacheManager(num_blocks, block_size, pool=p) for p in pools]
        # the groups that keep every token's blocks, where a sink policy evicts and pins its sink blocks
        self._full = [m for g, m in zip(groups, self.groups) if g.sliding_window is None]
        # per group: how many leading entries of each sequence's table are the null block
        self._released: list[dict[int, int]] = [{} for _ in groups]

    @property
    def block_tables(self) -> dict[int, list[int]]:
        return self.groups[0].block_tables

    @property
    def pinned(self) -> dict[int, list[int]]:
        """Each sequence's blocks outside its tables: a sink's unrotated originals, those of every full-attention
        group in the groups' order (a sliding group pins none: its sink blocks left its window)."""
        pinned: dict[int, list[int]] = {}
        for m in self._full:
            for seq_id, blocks in m.pinned.items():
                pinned.setdefault(seq_id, []).extend(blocks)
        return pinned

    def group_tables(self, seq_id: int) -> list[list[int]]:
        """The sequence's block table in each group."""
        return [m.block_tables[seq_id] for m in self.groups]

    def max_blocks_held(self, num_tokens: int, chunk: int) -> int:
        """The most blocks a sequence of num_tokens tokens holds in all groups, written in chunks of at
        most `chunk` tokens: all of its blocks in a full-attention group, those of a window and a chunk in a
        sliding one."""
        return sum(self.blocks_for(num_tokens) if g.sliding_window is None
                   else window_blocks(g.sliding_window + chunk, self.block_size, num_tokens)
                   for g in self.layer_groups)

    def num_new_blocks(self, seq_id: int, num_computed: int, num_new: int) -> int:
        """Blocks `allocate` would take from the pool for this write, in all groups."""
        return sum(m.num_new_blocks(seq_id, num_computed, num_new) for m in self.groups)

    def allocate(self, seq_id: int, num_computed: int, num_new: int) -> list[tuple[int, int]]:
        """Make room for tokens [num_computed, num_computed + num_new) in every group; returns the page
        copies of copy-on-write (block ids are the pool's: each copies every page tensor)."""
        needed = self.num_new_blocks(seq_id, num_computed, num_new)
        if needed > self.pool.num_free:
            raise NoFreeBlocksError(f"sequence {seq_id} needs {needed} blocks, {self.pool.num_free} free")
        return [c for m in self.groups for c in m.allocate(seq_id, num_computed, num_new)]

    def release_past_window(self, seq_id: int, next_position: int) -> None:
        """After a step wrote a sequence's tokens up to next_position: each sliding group lets go of the blocks
        wholly before the window of a query there, (next_position - W, next_position]."""
        for g, (group, m) in enumerate(zip(self.layer_groups, self.groups)):
            if group.sliding_window is None or seq_id not in m.block_tables:
                continue
            table, released = m.block_tables[seq_id], self._released[g]
            first = released.get(seq_id, 0)
            last = min(len(table), max(0, next_position - group.sliding_window + 1) // self.block_size)
            for j in range(first, last):
                m.release([table[j]])
                self.pool.incref(self.null_block)
                table[j] = self.null_block
            if last > first:
                released[seq_id] = last

    def cached_prefix(self, keys: list[BlockKey], in_tier: Callable[[BlockKey], bool] | None = None
                      ) -> list[list[int]]:
        """Each group's blocks of the longest prefix of `keys` that every group can start from: a
        full-attention group holds all of its blocks, a sliding group those of the window of the token after
        it (the null block before them). The same number of entries in every group. With `in_tier`, a block
        the second tier holds (under the group's key) counts too, as LOAD."""
        n, hits = len(keys), None
        while hits is None or any(len(h) != n for h in hits):
            hits = [self._group_hits(g, keys, n, in_tier) for g in range(len(self.groups))]
            n = min(len(h) for h in hits)
        return hits

    def _find(self, key: BlockKey, in_tier: Callable[[BlockKey], bool] | None) -> int | None:
        """The cached block of `key`, else LOAD if the second tier holds it, else None."""
        block_id = self.pool.lookup(key)
        if block_id is None and in_tier is not None and in_tier(key):
            return LOAD
        return block_id

    def _window_blocks(self, g: int, h: int) -> int:
        """How many of the last blocks of a prefix of h blocks group g needs: all of them in a full-attention
        group, in a sliding one those that the window of the token after them reaches."""
        window = self.layer_groups[g].sliding_window
        return h if window is None else h - max(0, h * self.block_size - window + 1) // self.block_size

    def _group_hits(self, g: int, keys: list[BlockKey], n: int,
                    in_tier: Callable[[BlockKey], bool] | None = None) -> list[int]:
        """Group g's table for the longest hit of at most n blocks."""
        if self.layer_groups[g].sliding_window is None:
            hits = []
            for key in keys[:n]:
                block_id = self._find(key.in_group(g), in_tier)
                if block_id is None:
                    break
                hits.append(block_id)
            return hits
        # the token after a hit of h blocks attends to those from position h * bs - W + 1: scan back from n
        # for the first h whose blocks from there are all cached
        if n and not self._window_blocks(g, n):         # a window of one token: the query attends to itself alone
            return [self.null_block] * n
        run: list[int] = []
        for h in range(n, 0, -1):
            block_id = self._find(keys[h - 1].in_group(g), in_tier)
            if block_id is None:
                run = []
                continue
            run.append(block_id)
            # blocks h-1 .. h-1+len(run)-1 are cached: a hit of h - 1 + len(run) blocks needs the last `need` of them
            end = h - 1 + len(run)
            need = self._window_blocks(g, end)
            if len(run) >= need:
                kept = list(reversed(run))[:need]
                return [self.null_block] * (end - len(kept)) + kept
        return []

    def num_hit_blocks(self, hits: list[list[int]]) -> int:
        """Blocks of the prefix that a hit (cached_prefix's; [] where nothing was looked up) computes."""
        return len(hits[0]) if hits else 0

    def num_admit_blocks(self, hits: list[list[int]], num_tokens: int) -> int:
        """Blocks that admitting a sequence over `hits` with its first num_tokens tokens takes from the pool."""
        return sum(m.num_admit_blocks(h, num_tokens) for m, h in zip(self.groups, self._per_group(hits)))

    def _per_group(self, hits: list[list[int]]) -> list[list[int]]:
        """Each group's hit blocks ([]: no hit, as the scheduler passes where prefix caching is off)."""
        return hits or [[] for _ in self.groups]

    def share_prefix(self, seq_id: int, hits: list[list[int]]) -> None:
        """Start each group's table of a sequence with its cached blocks (a prefix hit), and a fresh block for
        each LOAD (once every group holds its cached ones: a fresh block is never one of those)."""
        for g, (m, h) in enumerate(zip(self.groups, self._per_group(hits))):
            m.hold_prefix(seq_id, h)
            nulls = next((i for i, b in enumerate(h) if b != self.null_block), len(h))
            if nulls:
                self._released[g][seq_id] = nulls
        for m in self.groups:
            m.fill_loads(seq_id)

    def tier_blocks(self, seq_id: int, hits: list[list[int]], keys: list[BlockKey]
                    ) -> list[tuple[int, int, int, BlockKey]]:
        """(layer group, table entry, block, group's key) of each block of a hit (after share_prefix) to load
        from the second tier, in the order of the prefix."""
        blocks = [(g, j, m.block_tables[seq_id][j], keys[j].in_group(g))
                  for g, (m, h) in enumerate(zip(self.groups, hits)) for j, b in enumerate(h) if b == LOAD]
        return sorted(blocks, key=lambda block: block[1])

    def usable_prefix(self, seq_id: int, num_blocks: int, missing: list[tuple[int, int]]) -> int:
        """The longest prefix of the sequence's first num_blocks blocks that it can start from when the
        (layer group, table entry) blocks `missing` could not be loaded: every group has the blocks it needs
        of it (a sliding group's null blocks are missing for a shorter prefix, whose window reaches further
        back)."""
        gone = set(missing) | {(g, j) for g, table in enumerate(self.group_tables(seq_id))
                               for j, b in enumerate(table[:num_blocks]) if b == self.null_block}
        for h in range(num_blocks, 0, -1):
            if not any((g, j) in gone for g in range(len(self.groups))
                       for j in range(h - self._window_blocks(g, h), h)):
                return h
        return 0

    def truncate(self, seq_id: int, num_blocks: int) -> None:
        """Keep the first num_blocks entries of the sequence's table in every group; let go of the rest."""
        for m, released in zip(self.groups, self._released):
            m.truncate(seq_id, num_blocks)
            if released.get(seq_id, 0) > num_blocks:
                released[seq_id] = num_blocks

    def keyed_blocks(self, seq_id: int, keys: list[BlockKey]) -> list[tuple[int, BlockKey]]:
        """(block, group's key) of the sequence's leading blocks that hold `keys`, in every group (the null
        block in none)."""
        return [(table[j], key.in_group(g)) for g, table in enumerate(self.group_tables(seq_id))
                for j, key in enumerate(keys) if table[j] != self.null_block]

    def cache_blocks(self, seq_id: int, first: int, keys: list[BlockKey]) -> None:
        """Index blocks first, first + 1, ... of the sequence (now full) in every group, under its keys."""
        for g, m in enumerate(self.groups):
            m.cache_blocks(seq_id, first, [k.in_group(g) for k in keys])

    def uncache_blocks(self, seq_id: int, first: int, keys: list[BlockKey]) -> None:
        """Drop blocks first, first + 1, ... of the sequence from every group's prefix index."""
        for g, m in enumerate(self.groups):
            m.uncache_blocks(seq_id, first, [k.in_group(g) for k in keys])

    def fork(self, parent_id: int, child_id: int) -> None:
        """Give `child_id` the parent's blocks in every group, shared by reference count."""
        for m, released in zip(self.groups, self._released):
            m.fork(parent_id, child_id)
            if parent_id in released:
                released[child_id] = released[parent_id]

    def free(self, seq_id: int) -> None:
        """Return a sequence's blocks in every group; shared blocks stay with their other owners."""
        for m, released in zip(self.groups, self._released):
            m.free(seq_id)
            released.pop(seq_id, None)

    def release(self, block_ids: list[int]) -> None:
        self.groups[0].release(block_ids)

    def drop(self, seq_id: int, indices: range) -> None:
        """Remove entries `indices` of the sequence's table in every group and let go of their blocks (a sink's
        eviction), so that entry j holds the same cached tokens in every group. A sliding group's entries there
        are the null block already: a sink's window is at least the group's, so they left the group's window
        before they left the sink's."""
        for g in range(len(self.groups)):
            self._drop(g, seq_id, indices)

    def _drop(self, g: int, seq_id: int, indices: range) -> None:
        """Remove entries `indices` of the sequence's table in group g and let go of their blocks."""
        self.groups[g].drop(seq_id, indices)
        released = self._released[g]
        nulls = released.get(seq_id, 0)
        if nulls > indices.start:
            released[seq_id] = nulls - (min(nulls, indices.stop) - indices.start)

    def rebuild(self, seq_id: int, num_tokens: int) -> list[tuple[list[int], list[int]]]:
        """An h2o or snapkv compaction to the `num_tokens` tokens it keeps: each full-attention group's table is
        rebuilt as KVCacheManager.rebuild does ((old table, new table) of each, in the groups' order, to copy the
        kept tokens over, then `release` the old); each sliding group drops the leading entries its table has past
        the new length, so that it ends with the same tokens at the same entries. That is exact where the tokens
        evicted are whole blocks' worth, all before the group's window (its dropped entries are the null block):
        the policy's recent tokens, always kept, cover the window. Nothing changes if the pool has too few free
        blocks."""
        needed = self.blocks_for(num_tokens) * len(self._full)
        if needed > self.pool.num_free:
            raise NoFreeBlocksError(f"sequence {seq_id} needs {needed} blocks, {self.pool.num_free} free")
        tables = [t for m in self._full for t in m.rebuild(seq_id, num_tokens)]
        for g, (group, m) in enumerate(zip(self.layer_groups, self.groups)):
            if group.sliding_window is not None:
                self._drop(g, seq_id, range(len(m.block_tables[seq_id]) - self.blocks_for(num_tokens)))
        return tables

    def replace(self, seq_id: int, indices: range, pin: bool = False) -> list[int]:
        """Give entries `indices` of the sequence's table in every full-attention group fresh blocks (a sink's
        working copies; a sliding group's entries there left its window); the blocks they held are returned, the
        groups' in order (and pinned to the sequence when `pin`, else left to the caller to `release`). Nothing
        changes if the pool has too few free blocks."""
        needed = len(indices) * len(self._full)
        if needed > self.pool.num_free:
            raise NoFreeBlocksError(f"sequence {seq_id} needs {needed} blocks, {self.pool.num_free} free")
        return [b for m in self._full for b in m.replace(seq_id, indices, pin)]

    def leading_blocks(self, seq_id: int, n: int) -> list[int]:
        """The first n entries of the sequence's table in every full-attention group, in the order of `pinned`:
        where a sink's originals are copied to."""
        return [b for m in self._full for b in m.leading_blocks(seq_id, n)]

    def blocks_per_group(self) -> list[int]:
        """Blocks each group holds: those of its sequences' tables and a sink's pinned originals (a block shared by
        several counted once; the null block not at all)."""
        return list(self._held)


class HybridKVStorage(KVStorage):
    """The pages of a hybrid cache: block_spec's page tensors (or quantized layers) over the pool's block
    ids, layer i reading and writing those of its place in its group (`slots[i]`), in its own dtype. A block
    serves one group at a time, so that copying a block copies every tensor's page."""

    def __init__(self, model_spec: KVSpec, num_blocks: int, device: torch.device, groups: list[LayerGroup]):
        """`model_spec`: the model's spec (every layer, its skip_layers); `spec` becomes the pool's, block_spec's."""
        super().__init__(block_spec(model_spec, groups), num_blocks, device)
        self.slots, self.layer_group = layer_slots(groups, model_spec.num_layers, set(model_spec.quantized_layers))

    def layer(self, i: int) -> torch.Tensor | QuantizedLayer:
        """Model layer i's cache: the pages of its place in its group."""
        return self.layers[self.slots[i]]
