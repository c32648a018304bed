"""cache_mode none: the KV cache manager and storage of an engine that keeps no cache.

Every step computes its sequences whole, from their first token, over the step's own K/V: the baseline
that the paged and contiguous caches are measured against. These stand where KVCacheManager and
KVStorage stand, so that the scheduler, the runner and the engine always have both.
"""
from __future__ import annotations


class NoKVCacheManager:
    """No blocks and nothing to share: allocate, free and fork do nothing.

    `recomputes` says what no cache changes: nothing stays computed after a step, so a sequence is
    computed whole in one step or waits, and its tokens have no places in a cache (no block tables, no
    slots)."""

    recomputes = True
    block_size = 0
    num_blocks = 0
    num_free_blocks = 0

    def __init__(self):
        self.block_tables: dict[int, list[int]] = {}     # no sequence has one

    def blocks_for(self, num_tokens: int) -> int:
        """No tokens take a block."""
        return 0

    def num_new_blocks(self, seq_id: int, num_computed: int, num_new: int) -> int:
        """A write takes no block."""
        return 0

    def num_hit_blocks(self, hits: list[int]) -> int:
        """No prefix is cached."""
        return 0

    def num_admit_blocks(self, hits: list[int], num_tokens: int) -> int:
        """Admission takes no block."""
        return 0

    def num_reclaimed(self, block_ids: list[int]) -> int:
        """No cached blocks to reclaim."""
        return 0

    def share_prefix(self, seq_id: int, block_ids: list[int]) -> None:
        """Nothing is cached to share."""

    def allocate(self, seq_id: int, num_computed: int, num_new: int) -> list[tuple[int, int]]:
        """No room to make, and no pages to copy."""
        return []

    def fork(self, parent_id: int, child_id: int) -> None:
        """No blocks to share with the child."""

    def free(self, seq_id: int) -> None:
        """No blocks to return."""


class NoKVStorage:
    """No pages: every layer's cache is None, so that attention runs over the step's own K/V."""

    nbytes = 0

    def __init__(self, num_layers: int):
        self.layers: list[None] = [None] * num_layers

    def layer(self, i: int) -> None:
        """Layer i has no cache."""
        return self.layers[i]

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """No pages to copy (the manager asks for none)."""
