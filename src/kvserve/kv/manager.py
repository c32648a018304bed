"""KVCacheManager: block tables in every layer group over one pool (vLLM's KV cache coordinator).

Each call acts on every group (kv/groups.py): a write takes blocks in each (what it takes is the sum), a
sequence's free, fork and preemption free or share each group's table. A model of full-attention layers
alone is one group; a model with binding sliding windows has a group per window kind besides, and the pool
keeps a null block for the entries that left their window.

Prefix caching: each group indexes its blocks under its own keys (BlockKey.in_group). A prefix hit needs the
whole prefix's blocks in a full-attention group but only a sliding group's last window of them. The second KV
tier keeps each group's blocks under the same keys: a hit finds each block it needs in the pool or in the
tier, which loads it into a fresh block.

Eviction: entry j of a sequence's table holds the same cached tokens in every group. A `sink` policy drops the
same entries in every group and pins the originals of its sink blocks in the full-attention groups alone; a
sliding group's dropped entries are the null block already, since a sink's window is at least the group's.
`h2o` and `snapkv` compact the full-attention groups into fresh blocks; they evict whole blocks' worth of
tokens, all older than their recent tokens (at least the widest window), so that a sliding group only drops
as many leading entries (the null block) and keeps its window's blocks, never rewritten, at the entries that
now hold those tokens.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from kvserve.kv.blocks import BlockKey, BlockPool, cdiv
from kvserve.kv.groups import (FullAttentionTables, GroupPool, GroupTables, LayerGroup, SlidingWindowTables,
                               check_free)
from kvserve.kv.interface import NO_HIT, BlockToLoad, KVCache, PrefixHit

if TYPE_CHECKING:
    from kvserve.kv.events import EventSink

# a lookup's marker of a block the second tier holds (PrefixHit's None), while groups search their hits
_IN_TIER = -1


class KVCacheManager(KVCache):
    """Allocates, grows, forks and frees the block tables of sequences in every layer group of `groups`
    (default: one full-attention group). `block_tables` are the first group's (the full-attention one, where
    the model has one): what the engine shows of a sequence's blocks; `group_tables` gives each group's."""

    def __init__(self, num_blocks: int, block_size: int, groups: list[LayerGroup] | None = None):
        groups = groups or [LayerGroup(None, ())]
        sliding = any(g.sliding_window is not None for g in groups)
        if sliding and num_blocks < 2:
            raise ValueError(f"a KV cache with sliding-window layer groups needs at least 2 blocks (one is the null "
                             f"block), got {num_blocks}")
        self.block_size = block_size
        self.layer_groups = groups
        self.pool = BlockPool(num_blocks)
        # stands in a sliding group's table for the blocks that left the window; never freed, never written
        self.null_block = self.pool.allocate(1)[0] if sliding else None
        # blocks each group holds (what its tables own), and each block's group
        self._held, owner = [0] * len(groups), [0] * num_blocks
        self.groups: list[GroupTables] = []
        for g, group in enumerate(groups):
            pool = GroupPool(self.pool, g, self._held, owner)
            self.groups.append(FullAttentionTables(pool, block_size) if group.sliding_window is None else
                               SlidingWindowTables(pool, block_size, group.sliding_window, self.null_block))
        # the groups that keep every token's blocks, where a sink policy evicts and pins its sink blocks
        self._full = [m for g, m in zip(groups, self.groups) if g.sliding_window is None]

    # ---- sizes ----------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_usable_blocks(self) -> int:
        return self.pool.num_blocks - (self.null_block is not None)

    def blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def max_blocks_held(self, num_tokens: int, chunk: int, pinned: int = 0) -> int:
        """All of a sequence's blocks in a full-attention group and its pinned ones, those of a window and a chunk
        in a sliding one."""
        return sum(m.max_blocks_held(num_tokens, chunk) for m in self.groups) + pinned * len(self._full)

    # ---- writes ---------------------------------------------------------------------------

    def num_new_blocks(self, seq_id: int, num_computed: int, num_new: int) -> int:
        return sum(m.num_new_blocks(seq_id, num_computed, num_new) for m in self.groups)

    def allocate(self, seq_id: int, num_computed: int, num_new: int) -> list[tuple[int, int]]:
        check_free(self.pool, seq_id, self.num_new_blocks(seq_id, num_computed, num_new))
        return [c for m in self.groups for c in m.allocate(seq_id, num_computed, num_new)]

    def release_past_window(self, seq_id: int, next_position: int) -> None:
        for m in self.groups:
            m.release_past_window(seq_id, next_position)

    # ---- prefixes -------------------------------------------------------------------------

    def lookup(self, keys: list[BlockKey], in_tier: Callable[[BlockKey], bool] | None = None) -> PrefixHit:
        """Each group's blocks of the longest prefix of `keys` that every group can start from: a full-attention
        group holds all of its blocks, a sliding group those of the window of the token after it (the null block
        before them). The same number of entries in every group."""
        if not keys:
            return NO_HIT
        n, hits = len(keys), None
        while hits is None or any(len(h) != n for h in hits):
            hits = [m.hit(keys, n, self._finder(g, in_tier)) for g, m in enumerate(self.groups)]
            n = min(len(h) for h in hits)
        return PrefixHit(tuple(tuple(None if b == _IN_TIER else b for b in h) for h in hits), tuple(keys[:n]))

    def _finder(self, g: int, in_tier: Callable[[BlockKey], bool] | None) -> Callable[[BlockKey], int | None]:
        """Group g's search for a block: its cached block, else _IN_TIER if the second tier holds it, else None."""
        lookup = self.pool.lookup

        def find(key: BlockKey) -> int | None:
            key = key.in_group(g)
            block_id = lookup(key)
            if block_id is None and in_tier is not None and in_tier(key):
                return _IN_TIER
            return block_id

        return find

    def _per_group(self, hit: PrefixHit) -> list[list[int | None]]:
        """Each group's hit blocks ([] for NO_HIT)."""
        return [list(h) for h in hit.blocks] or [[] for _ in self.groups]

    def num_admit_blocks(self, hit: PrefixHit, num_tokens: int) -> int:
        return sum(m.num_admit_blocks(h, num_tokens) for m, h in zip(self.groups, self._per_group(hit)))

    def share_prefix(self, seq_id: int, hit: PrefixHit) -> list[BlockToLoad]:
        """Each group's table starts with its hit blocks, and a fresh block for each to load (taken once every
        group holds its cached ones: a fresh block is never one of those)."""
        for m, h in zip(self.groups, self._per_group(hit)):
            m.hold_prefix(seq_id, h)
        loads = [(g, j) for g, h in enumerate(hit.blocks) for j, b in enumerate(h) if b is None]
        for m in self.groups:
            m.fill_loads(seq_id)
        tables = self.group_tables(seq_id)
        return sorted((BlockToLoad(g, j, tables[g][j], hit.keys[j].in_group(g)) for g, j in loads),
                      key=lambda block: block.index)

    def usable_prefix(self, seq_id: int, num_blocks: int, missing: list[tuple[int, int]]) -> int:
        """Every group has the blocks it needs of the prefix (a sliding group's null entries are missing for a
        shorter prefix, whose window reaches further back). The longest such prefix: each group's longest within
        the bound, until they agree."""
        gone = [{j for g2, j in missing if g2 == g} |
                {j for j, b in enumerate(table[:num_blocks]) if b == self.null_block}
                for g, table in enumerate(self.group_tables(seq_id))]
        h = num_blocks
        while True:
            bound = min(m.longest_usable(h, g_gone) for m, g_gone in zip(self.groups, gone))
            if bound == h:
                return h
            h = bound

    def truncate(self, seq_id: int, num_blocks: int) -> None:
        for m in self.groups:
            m.truncate(seq_id, num_blocks)

    def cache_blocks(self, seq_id: int, first: int, keys: list[BlockKey]) -> None:
        for g, m in enumerate(self.groups):
            m.cache_blocks(seq_id, first, [k.in_group(g) for k in keys])

    def uncache_blocks(self, seq_id: int, first: int, keys: list[BlockKey]) -> None:
        for g, m in enumerate(self.groups):
            m.uncache_blocks(seq_id, first, [k.in_group(g) for k in keys])

    def keyed_blocks(self, seq_id: int, keys: list[BlockKey]) -> list[tuple[int, BlockKey]]:
        """(block, group's key) of the leading blocks in every group (the null block in none)."""
        return [(table[j], key.in_group(g)) for g, table in enumerate(self.group_tables(seq_id))
                for j, key in enumerate(keys) if table[j] != self.null_block]

    # ---- lifetime -------------------------------------------------------------------------

    def holds(self, seq_id: int) -> bool:
        return seq_id in self.groups[0].block_tables

    def fork(self, parent_id: int, child_id: int) -> None:
        for m in self.groups:
            m.fork(parent_id, child_id)

    def free(self, seq_id: int) -> None:
        for m in self.groups:
            m.free(seq_id)

    # ---- eviction policies' hooks ---------------------------------------------------------

    @property
    def pinned(self) -> dict[int, list[int]]:
        """A sink's unrotated originals, those of every full-attention group in the groups' order (a sliding
        group pins none: its sink blocks left its window)."""
        pinned: dict[int, list[int]] = {}
        for m in self._full:
            for seq_id, blocks in m.pinned.items():
                pinned.setdefault(seq_id, []).extend(blocks)
        return pinned

    def drop(self, seq_id: int, indices: range) -> None:
        """The same entries in every group, so that entry j holds the same cached tokens in each. A sliding
        group's entries there are the null block already: a sink's window is at least the group's, so they
        left the group's window before they left the sink's."""
        for m in self.groups:
            m.drop(seq_id, indices)

    def replace(self, seq_id: int, indices: range, pin: bool = False) -> list[int]:
        """A sink's working copies, in every full-attention group (a sliding group's entries there left its
        window); the old blocks are returned in the groups' order."""
        check_free(self.pool, seq_id, len(indices) * len(self._full))
        return [b for m in self._full for b in m.replace(seq_id, indices, pin)]

    def unshare(self, seq_id: int, indices: range) -> None:
        check_free(self.pool, seq_id, sum(m.num_shared(seq_id, indices) for m in self._full))
        for m in self._full:
            m.unshare(seq_id, indices)

    def leading_blocks(self, seq_id: int, n: int) -> list[int]:
        return [b for m in self._full for b in m.block_tables[seq_id][:n]]

    def rebuild(self, seq_id: int, num_tokens: int) -> list[tuple[list[int], list[int]]]:
        """An h2o or snapkv compaction: each full-attention group's table rebuilt; each sliding group drops the
        leading entries its table has past the new length, so that it ends with the same tokens at the same
        entries. That is exact where the tokens evicted are whole blocks' worth, all before the group's window
        (its dropped entries are the null block): the policy's recent tokens, always kept, cover the window."""
        check_free(self.pool, seq_id, self.blocks_for(num_tokens) * len(self._full))
        tables = [m.rebuild(seq_id, num_tokens) for m in self._full]
        for m in self.groups:
            if m.sliding_window is not None:
                m.drop(seq_id, range(len(m.block_tables[seq_id]) - self.blocks_for(num_tokens)))
        return tables

    def release(self, block_ids: list[int]) -> None:
        self.groups[0].release(block_ids)

    # ---- what the engine publishes --------------------------------------------------------

    def record_events(self, sink: EventSink | None) -> None:
        self.pool.events = sink

    # ---- what the engine shows ------------------------------------------------------------

    @property
    def block_tables(self) -> dict[int, list[int]]:
        return self.groups[0].block_tables

    def group_tables(self, seq_id: int) -> list[list[int]]:
        return [m.block_tables[seq_id] for m in self.groups]

    def group_pinned(self, seq_id: int) -> list[list[int]]:
        return [m.pinned.get(seq_id, []) for m in self.groups]

    def blocks_per_group(self) -> list[int]:
        """Blocks each group holds: those of its sequences' tables and a sink's pinned originals (a block shared by
        several counted once; the null block not at all)."""
        return list(self._held)

    def group_stats(self) -> list[dict]:
        return [{"sliding_window": g.sliding_window, "layers": list(g.layers), "blocks_in_use": n}
                for g, n in zip(self.layer_groups, self._held)]

    def check_invariants(self) -> None:
        """RuntimeError naming the first broken rule of the cache's bookkeeping (BlockPool.check_invariants), from
        the owners of each block: every group's table entries and pinned blocks, and the cache's own null block;
        besides, no table holds a block twice but the null block, and each group's count of the blocks it holds
        is those its tables and pinned blocks hold. For tests and debugging: it reads every table."""
        owners: dict[int, int] = {}
        for g, m in enumerate(self.groups):
            held = set()
            for seq_id, table in [*m.block_tables.items(), *m.pinned.items()]:
                blocks = [b for b in table if b != self.null_block]
                if len(set(blocks)) != len(blocks):
                    raise RuntimeError(f"sequence {seq_id} holds a block twice in layer group {g}: {table}")
                held.update(blocks)
                for b in table:
                    owners[b] = owners.get(b, 0) + 1
            if self._held[g] != len(held):
                raise RuntimeError(f"layer group {g} counts {self._held[g]} blocks held, its tables hold {len(held)}")
        if self.null_block is not None:
            owners[self.null_block] = owners.get(self.null_block, 0) + 1
        self.pool.check_invariants(owners)

    def blocks_held(self, seq_ids: list[int]) -> int:
        held = {b for s in seq_ids if self.holds(s) for t in self.group_tables(s) for b in t}
        return len(held - {self.null_block})

