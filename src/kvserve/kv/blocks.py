"""BlockPool: the free list and reference counts of the KV pages."""
from __future__ import annotations

from collections import deque


class NoFreeBlocksError(RuntimeError):
    """Raised when the pool has fewer free blocks than asked for."""


class BlockPool:
    """Hands out block ids on demand and takes them back when their last owner lets go."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise NoFreeBlocksError(f"asked for {n} blocks, {len(self._free)} free")
        ids = [self._free.popleft() for _ in range(n)]
        for b in ids:
            self.ref_counts[b] = 1
        return ids

    def _check(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block id {block_id} is outside the pool of {self.num_blocks} blocks")

    def incref(self, block_id: int) -> None:
        self._check(block_id)
        if self.ref_counts[block_id] < 1:
            raise RuntimeError(f"block {block_id} is free; it cannot be shared")
        self.ref_counts[block_id] += 1

    def decref(self, block_id: int) -> None:
        """Drop one owner; the block returns to the free list when none is left."""
        self._check(block_id)
        if self.ref_counts[block_id] < 1:
            raise RuntimeError(f"block {block_id} is already free (double free)")
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] == 0:
            self._free.append(block_id)
