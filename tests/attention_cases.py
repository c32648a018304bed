"""Random paged attention batches of awkward shapes, for checking every backend against the textbook."""
from __future__ import annotations

import torch

from kvserve.attention.batch import AttentionBatch


def make_case(q_lens: list[int], ctx_lens: list[int], num_decodes: int, num_heads: int, num_kv_heads: int,
              head_dim: int, block_size: int = 4, dtype=torch.float32, seed: int = 0, paged: bool = True):
    """q [T, H, D], k/v [T, KVH, D] of the new tokens, a shuffled paged cache holding every context, the batch."""
    g = torch.Generator().manual_seed(seed)
    total = sum(q_lens)
    q = torch.randn(total, num_heads, head_dim, generator=g).to(dtype)
    k = torch.randn(total, num_kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(total, num_kv_heads, head_dim, generator=g).to(dtype)
    tables = []
    if paged:
        num_blocks = sum(-(-c // block_size) for c in ctx_lens) + 3
        pages = torch.randperm(num_blocks, generator=g).tolist()   # non-contiguous, shuffled
        kv_cache = torch.randn(2, num_kv_heads, num_blocks, block_size, head_dim, generator=g).to(dtype)
        for c in ctx_lens:
            n = -(-c // block_size)
            tables.append(pages[:n])
            pages = pages[n:]
        flat = kv_cache.view(2, num_kv_heads, -1, head_dim)
        start = 0
        for table, c, n in zip(tables, ctx_lens, q_lens):          # the new tokens' K/V sit in the cache
            slots = [table[p // block_size] * block_size + p % block_size for p in range(c - n, c)]
            flat[0][:, slots] = k[start:start + n].transpose(0, 1)
            flat[1][:, slots] = v[start:start + n].transpose(0, 1)
            start += n
        width = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    else:
        kv_cache, block_tables = None, None
    batch = AttentionBatch(num_decodes=num_decodes, slot_mapping=None, block_tables=block_tables,
                           context_lens=torch.tensor(ctx_lens), query_lens=q_lens, context_lens_list=ctx_lens,
                           has_prefix=any(c > n for c, n in zip(ctx_lens[num_decodes:], q_lens[num_decodes:])))
    return q, k, v, kv_cache, batch


def quantize_case(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: AttentionBatch,
                  kv_cache_dtype: str, block_size: int, device: str | torch.device = "cpu"):
    """The case's pages as QuantizedPages on `device`, every token quantized. Returns (layer, pages):
    `pages` (on the CPU) is the plain tensor of what the layer stands for (dequantized blocks), the
    textbook's input. The step's own k, v [T, KVH, D] are overwritten in place with the values the
    layer holds for them.
    """
    from kvserve.kv.pages import PageFormat, QuantizedPages

    _, kvh, nb, bs, d = kv_cache.shape
    layer = QuantizedPages(PageFormat.of(kv_cache_dtype, kv_cache.dtype), kvh, nb, bs, d, torch.device(device))
    layer.write_pages(torch.arange(nb, device=device), kv_cache.to(device))
    pages = layer.gather(torch.arange(nb, device=device)).cpu()
    flat = pages.view(2, kvh, -1, d)
    start = 0
    for table, c, n in zip(batch.block_tables.tolist(), batch.context_lens_list, batch.query_lens):
        slots = [table[p // block_size] * block_size + p % block_size for p in range(c - n, c)]
        k[start:start + n] = flat[0][:, slots].transpose(0, 1)
        v[start:start + n] = flat[1][:, slots].transpose(0, 1)
        start += n
    return layer, pages
