"""A layer's pages of each sequence, gathered into one contiguous K/V tensor: for what attends over a
copy of the context rather than in place (sdpa, textbook, the attention mass, the attention bench)."""
from __future__ import annotations

import torch

from kvserve.kv.storage import read_pages


def gather_context(kv_cache: torch.Tensor, block_tables: torch.Tensor, max_len: int) -> torch.Tensor:
    """Pages [2, KVH, blocks, block_size, D] of each sequence as K and V [2, KVH, seqs, max_len, D]."""
    block_size = kv_cache.shape[3]
    num_blocks = -(-max_len // block_size)
    pages = read_pages(kv_cache, block_tables[:, :num_blocks])  # [2, KVH, seqs, nb, bs, D]
    return pages.flatten(3, 4)[:, :, :, :max_len]
