"""The KV cache's contract with the scheduler, the runner and the evictor: the one interface they use.

A cache is a set of layer groups over one block pool (kv/groups.py): every sequence has a block table in
each group, entry j of each holding its cached tokens [j * block_size, (j + 1) * block_size). A model
whose layers all attend to the whole context is one group. The implementations: KVCacheManager (paged and
contiguous caches, kv/manager.py) and NoKVCache (cache_mode "none", kv/nocache.py).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvserve.kv.blocks import BlockKey

if TYPE_CHECKING:
    from kvserve.kv.events import EventSink


@dataclass(frozen=True)
class PrefixHit:
    """The longest prefix of a sequence's full blocks that it can start from: for each layer group, the table
    entries it starts with. An entry is a cached block of the pool, or None where the second tier holds the
    block (admission takes a fresh block for it, which the tier's bytes are loaded into). `keys`: the keys of
    the prefix's blocks."""

    blocks: tuple[tuple[int | None, ...], ...] = ()
    keys: tuple[BlockKey, ...] = ()

    @property
    def num_blocks(self) -> int:
        """Blocks of the prefix that the hit computes, those to load included."""
        return len(self.blocks[0]) if self.blocks else 0


NO_HIT = PrefixHit()


@dataclass(frozen=True)
class BlockToLoad:
    """A block of a prefix hit that the second tier holds: its layer group, table entry, the fresh block of
    the pool its bytes go to, and the key the tier holds it under."""

    group: int
    index: int
    block: int
    key: BlockKey


class KVCache(ABC):
    """Block tables per layer group over one pool: allocation, prefix sharing, copy-on-write forks, and the
    hooks eviction policies use. Every method acts on every layer group; a call that cannot get the blocks it
    needs raises NoFreeBlocksError and changes nothing."""

    block_size: int
    # a sequence's computed tokens keep their K/V from one step to the next (NoKVCache: they do not)
    recomputes = False

    # ---- sizes ----------------------------------------------------------------------------

    @property
    @abstractmethod
    def num_blocks(self) -> int:
        """Blocks of the pool."""

    @property
    @abstractmethod
    def num_free_blocks(self) -> int:
        """Blocks that an allocation can take (free ones and cached ones no sequence holds)."""

    @property
    @abstractmethod
    def num_usable_blocks(self) -> int:
        """Blocks sequences can hold: the pool but the blocks the cache keeps for itself."""

    @abstractmethod
    def blocks_for(self, num_tokens: int) -> int:
        """Blocks of num_tokens tokens in one table."""

    @abstractmethod
    def max_blocks_held(self, num_tokens: int, chunk: int, pinned: int = 0) -> int:
        """The most blocks a sequence of num_tokens cached tokens holds in all groups, written in chunks of at
        most `chunk` tokens, with `pinned` blocks of an eviction policy's beside its table in each group that
        keeps every token."""

    # ---- writes ---------------------------------------------------------------------------

    @abstractmethod
    def num_new_blocks(self, seq_id: int, num_computed: int, num_new: int) -> int:
        """Blocks `allocate` would take from the pool for this write, copies included."""

    @abstractmethod
    def allocate(self, seq_id: int, num_computed: int, num_new: int) -> list[tuple[int, int]]:
        """Room for tokens [num_computed, num_computed + num_new) of a sequence; shared blocks there are replaced
        by private copies (copy-on-write): returns the (src, dst) page copies to make before the write."""

    @abstractmethod
    def release_past_window(self, seq_id: int, next_position: int) -> None:
        """After a step wrote a sequence's tokens up to next_position: let go of the blocks no later query reads."""

    # ---- prefixes -------------------------------------------------------------------------

    @abstractmethod
    def lookup(self, keys: list[BlockKey], in_tier: Callable[[BlockKey], bool] | None = None) -> PrefixHit:
        """The longest prefix of `keys` that every group can start from, in the pool's cached blocks or, where
        `in_tier` says the second tier holds a block the pool lacks, to load."""

    @abstractmethod
    def num_admit_blocks(self, hit: PrefixHit, num_tokens: int) -> int:
        """Blocks that admitting a sequence over `hit` with its first num_tokens tokens takes from the pool."""

    @abstractmethod
    def share_prefix(self, seq_id: int, hit: PrefixHit) -> list[BlockToLoad]:
        """Start a sequence's tables with the hit's blocks, and a fresh block for each to load: those, in the
        order of the prefix."""

    @abstractmethod
    def usable_prefix(self, seq_id: int, num_blocks: int, missing: list[tuple[int, int]]) -> int:
        """The longest prefix of the sequence's first num_blocks blocks it can start from when the (group, table
        entry) blocks `missing` could not be loaded."""

    @abstractmethod
    def truncate(self, seq_id: int, num_blocks: int) -> None:
        """Keep the first num_blocks entries of the sequence's tables; let go of the blocks after, those that hold
        no prefix to be taken first by the next allocations (they would otherwise evict cached blocks)."""

    @abstractmethod
    def cache_blocks(self, seq_id: int, first: int, keys: list[BlockKey]) -> None:
        """Index the sequence's blocks first, first + 1, ... (now full) under `keys`, in every group."""

    @abstractmethod
    def uncache_blocks(self, seq_id: int, first: int, keys: list[BlockKey]) -> None:
        """Drop blocks first, first + 1, ... of the sequence from the prefix index, if they hold `keys`."""

    @abstractmethod
    def keyed_blocks(self, seq_id: int, keys: list[BlockKey]) -> list[tuple[int, BlockKey]]:
        """(block, key it is indexed under) of the sequence's leading blocks that hold `keys`, in every group."""

    # ---- lifetime -------------------------------------------------------------------------

    @abstractmethod
    def holds(self, seq_id: int) -> bool:
        """Whether the sequence has tables here."""

    @abstractmethod
    def fork(self, parent_id: int, child_id: int) -> None:
        """Give `child_id` the parent's blocks in every group, shared by reference count."""

    @abstractmethod
    def free(self, seq_id: int) -> None:
        """Return a sequence's blocks; shared blocks stay with their other owners."""

    # ---- eviction policies' hooks ---------------------------------------------------------

    @property
    @abstractmethod
    def pinned(self) -> dict[int, list[int]]:
        """Each sequence's blocks outside its tables (a sink's unrotated originals)."""

    @abstractmethod
    def drop(self, seq_id: int, indices: range) -> None:
        """Remove entries `indices` of the sequence's tables and let go of their blocks (a sink's eviction)."""

    @abstractmethod
    def replace(self, seq_id: int, indices: range, pin: bool = False) -> list[int]:
        """Fresh blocks for entries `indices` where every token is kept (the full-attention groups); the blocks
        they held are returned (pinned to the sequence when `pin`, else left to the caller to `release`)."""

    @abstractmethod
    def unshare(self, seq_id: int, indices: range) -> None:
        """A fresh block for each of entries `indices` of the groups that keep every token whose block another
        sequence shares (the forks of a sequence's n samples share its sink's working copies, which each rewrites
        for its own evictions); the caller writes them whole. NoFreeBlocksError, changing nothing, if the pool
        lacks them."""

    @abstractmethod
    def leading_blocks(self, seq_id: int, n: int) -> list[int]:
        """The first n entries of the tables of the groups that keep every token, in the order of `pinned`."""

    @abstractmethod
    def rebuild(self, seq_id: int, num_tokens: int) -> list[tuple[list[int], list[int]]]:
        """Tables of fresh blocks for the num_tokens tokens a compaction keeps: (old, new) table of each group
        that keeps every token, whose old blocks the sequence owns until `release`."""

    @abstractmethod
    def release(self, block_ids: list[int]) -> None:
        """Drop the sequence's ownership of blocks that `replace` or `rebuild` handed back."""

    # ---- what the engine publishes --------------------------------------------------------

    @abstractmethod
    def record_events(self, sink: EventSink | None) -> None:
        """Record to `sink` (KV events) each block the prefix cache indexes and each it drops, from now on."""

    # ---- what the engine shows ------------------------------------------------------------

    @abstractmethod
    def group_tables(self, seq_id: int) -> list[list[int]]:
        """The sequence's block table in each group."""

    @abstractmethod
    def group_pinned(self, seq_id: int) -> list[list[int]]:
        """The sequence's pinned blocks in each group."""

    def stats(self) -> dict:
        """The pool's blocks (total, free: free ones and cached ones no sequence holds), the block size, and each
        layer group's window (None: full attention), layers and blocks it holds (kv_groups)."""
        return {"kv_blocks_total": self.num_blocks, "kv_blocks_free": self.num_free_blocks,
                "kv_block_size": self.block_size, "kv_groups": self.group_stats()}

    @abstractmethod
    def group_stats(self) -> list[dict]:
        """Each layer group: its window (None: full attention), its layers and the blocks it holds."""

    @abstractmethod
    def check_invariants(self) -> None:
        """RuntimeError naming the first broken rule of the cache's bookkeeping: no block leaked, double-freed or
        counted wrong (for tests and debugging)."""

    @abstractmethod
    def blocks_held(self, seq_ids: list[int]) -> int:
        """Distinct blocks these sequences hold (tables of every group, the cache's own blocks not counted)."""
