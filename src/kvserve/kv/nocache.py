"""cache_mode none: the KV cache and storage of an engine that keeps no cache.

Every step computes its sequences whole, from their first token, over the step's own K/V: the baseline
that the paged and contiguous caches are measured against. These stand where KVCacheManager and
KVStorage stand, so that the scheduler, the runner and the engine always have both.
"""
from __future__ import annotations

from collections.abc import Callable

from kvserve.kv.blocks import BlockKey
from kvserve.kv.interface import NO_HIT, BlockToLoad, KVCache, PrefixHit


class NoKVCache(KVCache):
    """No blocks and nothing to share: allocate, free and fork do nothing.

    `recomputes` says what no cache changes: nothing stays computed after a step, so a sequence is
    computed whole in one step or waits, and its tokens have no places in a cache (no block tables, no
    slots). Eviction policies need pages (the engine refuses them here): their hooks raise."""

    recomputes = True
    block_size = 0
    num_blocks = num_free_blocks = num_usable_blocks = 0
    pinned: dict[int, list[int]] = {}
    block_tables: dict[int, list[int]] = {}

    def __init__(self, num_layers: int):
        self.num_layers = num_layers

    def blocks_for(self, num_tokens: int) -> int:
        return 0

    def max_blocks_held(self, num_tokens: int, chunk: int, pinned: int = 0) -> int:
        return 0

    def num_new_blocks(self, seq_id: int, num_computed: int, num_new: int) -> int:
        return 0

    def allocate(self, seq_id: int, num_computed: int, num_new: int) -> list[tuple[int, int]]:
        return []

    def release_past_window(self, seq_id: int, next_position: int) -> None:
        """Nothing is kept past a step."""

    def lookup(self, keys: list[BlockKey], in_tier: Callable[[BlockKey], bool] | None = None) -> PrefixHit:
        return NO_HIT

    def num_admit_blocks(self, hit: PrefixHit, num_tokens: int) -> int:
        return 0

    def share_prefix(self, seq_id: int, hit: PrefixHit) -> list[BlockToLoad]:
        return []

    def usable_prefix(self, seq_id: int, num_blocks: int, missing: list[tuple[int, int]]) -> int:
        return 0

    def truncate(self, seq_id: int, num_blocks: int) -> None:
        """No blocks to let go of."""

    def cache_blocks(self, seq_id: int, first: int, keys: list[BlockKey]) -> None:
        """No blocks to index."""

    def uncache_blocks(self, seq_id: int, first: int, keys: list[BlockKey]) -> None:
        """No blocks in the index."""

    def keyed_blocks(self, seq_id: int, keys: list[BlockKey]) -> list[tuple[int, BlockKey]]:
        return []

    def holds(self, seq_id: int) -> bool:
        return False

    def fork(self, parent_id: int, child_id: int) -> None:
        """No blocks to share with the child."""

    def free(self, seq_id: int) -> None:
        """No blocks to return."""

    def _no_pages(self, *args) -> None:
        raise RuntimeError("eviction needs a paged KV cache (cache_mode 'paged'): this engine keeps none")

    drop = replace = unshare = leading_blocks = rebuild = release = _no_pages

    def record_events(self, sink) -> None:
        """No prefix cache: nothing is ever indexed (the engine refuses KV events here)."""

    def group_tables(self, seq_id: int) -> list[list[int]]:
        return []

    def group_pinned(self, seq_id: int) -> list[list[int]]:
        return []

    def group_stats(self) -> list[dict]:
        """One group of every layer, holding no block."""
        return [{"sliding_window": None, "layers": list(range(self.num_layers)), "blocks_in_use": 0}]

    def check_invariants(self) -> None:
        """No bookkeeping to break."""

    def blocks_held(self, seq_ids: list[int]) -> int:
        return 0


class NoKVStorage:
    """No pages: every layer's cache is None, so that attention runs over the step's own K/V."""

    nbytes = 0
    layer_group: list[int] = []
    quantized: list = []               # no quantized pages

    def __init__(self, num_layers: int):
        self.layers: list[None] = [None] * num_layers

    def layer(self, i: int) -> None:
        """Layer i has no cache."""
        return self.layers[i]

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """No pages to copy (the manager asks for none)."""
