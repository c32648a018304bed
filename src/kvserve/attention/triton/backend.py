"""TritonBackend: the AttentionBatch semantics of SdpaBackend, computed by the kernels in kernels.py."""
from __future__ import annotations

import itertools

import torch

from kvserve.attention.batch import AttentionBackend, AttentionBatch
from kvserve.attention.sparse import select_blocks
from kvserve.attention.triton.kernels import decode_attention, decode_workspace, prefill_attention, store_kv
from kvserve.kv.pages import LayerPages, QuantizedPages


class TritonBackend(AttentionBackend):
    """Decodes: split-KV paged decode. Prefills: varlen causal prefill, over the paged cache when
    some prefill has a cached prefix, else over the step's own K/V (the same values the layer has
    just stored, read without the block-table indirection). cache_mode "none" (kv_cache None):
    every sequence, decodes included, attends causally to its own tokens of the step only.

    Quantized pages (QuantizedPages) are read by the same paged kernels, which decode them tile by tile;
    fresh prefills still attend to the step's own exact K/V. Their writes go through the pages' own
    write_tokens (torch ops); full-precision pages are written by a kernel of its own.

    Under sparse attention (AttentionBatch.sparse) the decodes of a full-attention layer attend over the blocks
    attention/sparse.py's select_blocks chooses for each KV head: the same decode kernel over a block table
    per (sequence, KV head). The summaries it reads are written beside every store.

    Tile sizes are parameters so that tests can force many tiles and partitions on small inputs.
    """

    name = "triton"
    supports_cuda_graphs = True
    supports_sparse = True

    def __init__(self, prefill_block_m: int = 64, prefill_block_n: int = 64, decode_block_n: int = 64,
                 partition_size: int = 512):
        self.prefill_block_m = prefill_block_m
        self.prefill_block_n = prefill_block_n
        self.decode_block_n = decode_block_n
        self.partition_size = partition_size

    def store(self, kv_cache: LayerPages, kv: torch.Tensor, batch: AttentionBatch) -> None:
        if kv_cache.format.quantized:
            return super().store(kv_cache, kv, batch)
        store_kv(kv_cache.pages, kv[:, 0], kv[:, 1], batch.slot_mapping)
        kv_cache.summarize_tokens(kv[:, 0], batch.slot_mapping)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: LayerPages | None, batch: AttentionBatch, scale: float,
                sliding_window: int | None = None, logits_soft_cap: float | None = None) -> torch.Tensor:
        """q [T, H, D], k and v [T, KVH, D] (the step's tokens), kv_cache [2, KVH, blocks, page, D]
        (LayerPages) already holding them (or None) -> [T, H, D]; within the sliding window and
        soft-capped, where given."""
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        limits = {"sliding_window": sliding_window, "logits_soft_cap": logits_soft_cap}
        if kv_cache is None:
            self._prefill(q, k, v, out, batch, 0, None, scale, limits)
            return out
        quant = kv_cache if kv_cache.format.quantized else None
        k_pages, v_pages = kv_cache.data
        nd = batch.num_decodes
        if nd:
            self._decode(q[:nd], kv_cache, quant, out[:nd], batch, scale, limits)
        if batch.num_prefills:
            if batch.has_prefix:
                self._prefill(q[nd:], k_pages, v_pages, out[nd:], batch, nd, batch.block_tables[nd:], scale, limits,
                              quant)
            else:
                self._prefill(q[nd:], k[nd:], v[nd:], out[nd:], batch, nd, None, scale, limits)
        return out

    def _prefill(self, q, k, v, out, batch: AttentionBatch, first: int, block_tables: torch.Tensor | None,
                 scale: float, limits: dict, quant: QuantizedPages | None = None) -> None:
        """Sequences first.. of the batch; block_tables None: k, v are the step's own [T, KVH, D].
        quant: k, v are the quantized layer's stored numbers."""
        q_starts, q_lens, ctx_lens, max_q_len = _prefill_meta(batch, first, paged=block_tables is not None)
        prefill_attention(q, k, v, out, q_starts, q_lens, ctx_lens, block_tables, max_q_len, scale,
                          block_m=self.prefill_block_m, block_n=self.prefill_block_n, quant=quant, **limits)

    def _decode(self, q, kv_cache: LayerPages, quant: QuantizedPages | None, out, batch: AttentionBatch,
                scale: float, limits: dict) -> None:
        nd, num_heads, head_dim = q.shape
        ctx_lens, max_ctx = _decode_meta(batch)
        tables = batch.block_tables[:nd]
        if batch.sparse is not None and limits["sliding_window"] is None:
            tables, ctx_lens = select_blocks(q, kv_cache, tables, ctx_lens, batch.sparse.decodes(nd))
            ctx_lens = ctx_lens.to(torch.int32)
        key = ("triton_decode_workspace", num_heads, head_dim)
        workspace = batch.scratch.get(key)
        if workspace is None:   # the same shapes in every layer: allocate once per step
            workspace = batch.scratch[key] = decode_workspace(nd, num_heads, head_dim, max_ctx,
                                                              self.partition_size, q.device)
        k_pages, v_pages = kv_cache.data
        decode_attention(q, k_pages, v_pages, out, ctx_lens, tables, max_ctx, scale,
                         partition_size=self.partition_size, block_n=self.decode_block_n, workspace=workspace,
                         quant=quant, **limits)


def _prefill_meta(batch: AttentionBatch, first: int, paged: bool):
    """int32 query starts (relative to sequence `first`'s first token), query and context lengths of
    sequences first.., and the longest query; built once per step and shared by the layers.
    Unpaged, a sequence's context is its own query tokens."""
    key = ("triton_prefill", first, paged)
    meta = batch.scratch.get(key)
    if meta is None:
        q_lens = batch.query_lens[first:]
        ctx_lens = batch.context_lens_list[first:] if paged else q_lens
        starts = list(itertools.accumulate(q_lens, initial=0))[:-1]
        dev = batch.context_lens.device
        starts_t, q_lens_t, ctx_t = (torch.tensor(xs, dtype=torch.int32, device=dev)
                                     for xs in (starts, q_lens, ctx_lens))
        meta = batch.scratch[key] = (starts_t, q_lens_t, ctx_t, max(q_lens))
    return meta


def _decode_meta(batch: AttentionBatch):
    """int32 context lengths of the decodes and the longest (or the batch's bound), once per step."""
    meta = batch.scratch.get("triton_decode")
    if meta is None:
        nd = batch.num_decodes
        longest = batch.decode_context_bound or max(batch.context_lens_list[:nd])
        meta = batch.scratch["triton_decode"] = (batch.context_lens[:nd].to(torch.int32), longest)
    return meta
