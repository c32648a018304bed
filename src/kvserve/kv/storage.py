"""KVStorage: the preallocated K and V pages of every layer."""
from __future__ import annotations

import torch

from kvserve.kv.spec import KVSpec


class KVStorage:
    """One tensor [layers, 2, kv_heads, num_blocks, block_size, head_dim] holding every page.

    Heads lead so that gathering a batch's pages yields [kv_heads, seqs, tokens, head_dim] with no
    further copy: the layout the attention matmuls take directly.
    """

    def __init__(self, spec: KVSpec, num_blocks: int, block_size: int, device: torch.device):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.kv = torch.zeros(spec.num_layers, 2, spec.num_kv_heads, num_blocks, block_size,
                              spec.head_dim, dtype=spec.dtype, device=device)

    def layer(self, i: int) -> torch.Tensor:
        """K and V pages of layer i: [2, kv_heads, num_blocks, block_size, head_dim]."""
        return self.kv[i]

    @staticmethod
    def write(kv_cache: torch.Tensor, kv: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store new tokens' K and V [tokens, 2, kv_heads, head_dim] at their slots."""
        pages = kv_cache.view(2, kv_cache.shape[1], -1, kv_cache.shape[-1])
        pages.index_copy_(2, slot_mapping, kv.permute(1, 2, 0, 3))

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole pages src -> dst in every layer (copy-on-write)."""
        if copies:
            src, dst = zip(*copies)
            self.kv[:, :, :, list(dst)] = self.kv[:, :, :, list(src)]
