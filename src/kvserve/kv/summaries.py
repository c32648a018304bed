"""Page summaries: per block and KV head of a layer, the element-wise minimum and maximum of its keys.

Sparse decode attention (kv/sparse.py) ranks a block for a query q by sum_i max(q_i * min_i, q_i * max_i), a
bound no key of the block scores above, without reading the block. The summaries are of the keys as attention
reads them: the stored keys (after RoPE; int4's turned by its Hadamard matrix, as the queries are), and for
quantized pages what a page decodes to in float32 (its stored numbers times their scales), not the keys before
quantization: those are gone once a token is written, and a block loaded from the second tier, or rewritten by
an eviction, must be summarised from its page alone. They are held in the model's dtype, each minimum rounded
down and each maximum up (exact for full-precision pages), so that the bound stays a bound.

A block's summary covers the tokens written into it since its first token (at offset 0) was: every path that
writes pages writes a block from its offset 0 on (a prompt, a decode, an eviction's compaction), copies a whole
block (copy-on-write) or writes whole blocks (the second tier's loads, a sink's rotated blocks), so that the
summary of a block in a sequence's table is that of its cached tokens. Summaries are not part of a block's bytes
(KVStorage.read_blocks): a block written whole is summarised from its pages.

Layout: [KV heads, blocks, 2 (min, max), head_dim], one block's summary in one run of memory.
"""
from __future__ import annotations

import torch


def round_down(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The largest number of `dtype` at most x (float32)."""
    r = x.to(dtype)
    return r if dtype == x.dtype else torch.where(r.float() > x, torch.nextafter(r, r.new_full((), -torch.inf)), r)


def round_up(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The smallest number of `dtype` at least x (float32)."""
    r = x.to(dtype)
    return r if dtype == x.dtype else torch.where(r.float() < x, torch.nextafter(r, r.new_full((), torch.inf)), r)


class PageSummaries:
    """A layer's summaries `data` [KVH, num_blocks, 2, head_dim] in the model's dtype, over blocks of block_size."""

    def __init__(self, data: torch.Tensor, block_size: int):
        self.data = data
        self.block_size = block_size

    def add_tokens(self, keys: torch.Tensor, slots: torch.Tensor) -> None:
        """Tokens' keys [tokens, KVH, D] (as attention reads them, any float dtype) written at slots (block *
        block_size + offset; a negative slot: a padding row, written nowhere): each block's summary takes them
        in, and starts anew where the write holds its first token (its earlier summary, of a block used before,
        covers none of its tokens). Work of the tokens' size, not the pool's, and without a host synchronisation
        (a CUDA graph captures it)."""
        kvh, _, _, d = self.data.shape
        n = len(slots)
        # a padding row joins the last token's block, with keys that change neither its minimum nor its maximum
        pad = (slots < 0)[:, None, None]
        slots = torch.where(slots < 0, slots.max(), slots)
        order = torch.argsort(slots)
        slots, pad, keys = slots[order], pad[order].transpose(0, 1), keys[order].float().transpose(0, 1)
        blocks = slots // self.block_size
        # the write's blocks, in order: each token's group, and each group's block and whether it starts anew
        new = torch.ones(n, dtype=torch.bool, device=slots.device)
        new[1:] = blocks[1:] != blocks[:-1]
        group = torch.cumsum(new, 0) - 1
        block = torch.zeros_like(blocks).scatter_(0, group, blocks)
        fresh = torch.zeros(n, dtype=torch.int8, device=slots.device).scatter_reduce_(
            0, group, (slots % self.block_size == 0).to(torch.int8), "amax")
        index = group[None, :, None].expand(kvh, n, d)
        low = keys.new_full((kvh, n, d), torch.inf).scatter_reduce_(1, index, keys.masked_fill(pad, torch.inf), "amin")
        high = keys.new_full((kvh, n, d), -torch.inf).scatter_reduce_(1, index, keys.masked_fill(pad, -torch.inf),
                                                                       "amax")
        # rows past the last group repeat it, so that writing every row back writes each block once over
        rows = torch.minimum(torch.arange(n, device=slots.device), group[-1])
        block, fresh, low, high = block[rows], fresh[rows].bool()[None, :, None], low[:, rows], high[:, rows]
        old = self.data.index_select(1, block).float()                           # [KVH, tokens, 2, D]
        low = torch.where(fresh, low, torch.minimum(old[:, :, 0], low))
        high = torch.where(fresh, high, torch.maximum(old[:, :, 1], high))
        dtype = self.data.dtype
        self.data.index_copy_(1, block, torch.stack((round_down(low, dtype), round_up(high, dtype)), 2))

    def set_blocks(self, blocks: torch.Tensor, keys: torch.Tensor) -> None:
        """Whole blocks' summaries from their keys [KVH, n, block_size, D] (float32, as attention reads them)."""
        low, high = round_down(keys.amin(2), self.data.dtype), round_up(keys.amax(2), self.data.dtype)
        self.data.index_copy_(1, blocks, torch.stack((low, high), 2))
