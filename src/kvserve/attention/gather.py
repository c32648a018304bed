"""A layer's pages of each sequence, gathered into one contiguous K/V tensor: for what attends over a
copy of the context rather than in place (sdpa, textbook, the attention mass, the attention bench)."""
from __future__ import annotations

import torch

from kvserve.kv.pages import LayerPages


def gather_context(kv_cache: LayerPages, block_tables: torch.Tensor, max_len: int) -> torch.Tensor:
    """A layer's pages of each sequence as K and V [2, KVH, seqs, max_len, D] (decoded, if quantized)."""
    block_size = kv_cache.shape[3]
    num_blocks = -(-max_len // block_size)
    pages = kv_cache.gather(block_tables[:, :num_blocks])  # [2, KVH, seqs, nb, bs, D]
    return pages.flatten(3, 4)[:, :, :, :max_len]
