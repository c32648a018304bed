"""KVStorage: the preallocated K and V pages of every layer."""
from __future__ import annotations

import torch

from kvserve.kv.spec import KVSpec


class KVStorage:
    """One tensor [layers, 2, num_blocks, block_size, kv_heads, head_dim] holding every page."""

    def __init__(self, spec: KVSpec, num_blocks: int, block_size: int, device: torch.device):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.kv = torch.zeros(spec.num_layers, 2, num_blocks, block_size, spec.num_kv_heads,
                              spec.head_dim, dtype=spec.dtype, device=device)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V pages of layer i, each [num_blocks, block_size, kv_heads, head_dim]."""
        return self.kv[i, 0], self.kv[i, 1]

    @staticmethod
    def write(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
        """Store new tokens' K/V [tokens, kv_heads, head_dim] at their slots."""
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole pages src -> dst in every layer (copy-on-write)."""
        if copies:
            src, dst = zip(*copies)
            self.kv[:, :, list(dst)] = self.kv[:, :, list(src)]
