"""The `sdpa` backend: torch SDPA for prompts (padded per batch), batched matmuls for decodes, over K/V
gathered through the block tables; `native` delegates to it what its C kernels do not run."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.attention.batch import AttentionBackend, AttentionBatch, soft_cap
from kvserve.attention.gather import gather_context
from kvserve.kv.pages import QuantizedPages
from kvserve.kv.quant import merge_channels, split_channels


def _pad(x: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """Flat [T, H, D] -> [B, H, L, D], padded at the end of each sequence."""
    if len(set(lens)) == 1:
        return x.view(len(lens), lens[0], *x.shape[1:]).transpose(1, 2)
    padded = torch.nn.utils.rnn.pad_sequence(list(x.split(lens)), batch_first=True)
    return padded.transpose(1, 2)


def _unpad(out: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """[B, H, L, D] -> flat [T, H, D]."""
    out = out.transpose(1, 2)
    if len(set(lens)) == 1:
        return out.reshape(-1, *out.shape[2:])
    return torch.cat([o[:n] for o, n in zip(out, lens)])


class SdpaBackend(AttentionBackend):
    """Decode: one query per sequence against its pages; prefill: causal SDPA, padded per batch. A sliding
    window masks the keys before it (and decodes gather only the blocks it spans); soft-capped scores are
    computed by matmuls, as SDPA cannot cap them."""

    name = "sdpa"

    def forward(self, q, k, v, kv_cache, batch: AttentionBatch, scale: float, sliding_window: int | None = None,
                logits_soft_cap: float | None = None) -> torch.Tensor:
        nd = batch.num_decodes
        parts = []
        if nd:
            parts.append(self._decode(q[:nd], kv_cache, batch, scale, sliding_window, logits_soft_cap))
        if batch.num_prefills:
            if batch.has_prefix:
                parts.append(self._prefill_paged(q[nd:], kv_cache, batch, scale, sliding_window, logits_soft_cap))
            else:
                parts.append(self._prefill(q[nd:], k[nd:], v[nd:], batch.query_lens[nd:], scale, sliding_window,
                                           logits_soft_cap))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    @staticmethod
    def _decode(q, kv_cache, batch: AttentionBatch, scale: float, window: int | None, cap: float | None):
        # One query per sequence: batched matmuls beat SDPA's CPU kernel here, and the scores are
        # only [seqs, heads, context], never L x L. GQA: the G query heads of a KV head share its keys.
        nd, num_heads, head_dim = q.shape
        num_kv_heads, block_size = kv_cache.shape[1], kv_cache.shape[3]
        qg = q.view(nd, num_kv_heads, -1, head_dim).transpose(0, 1).reshape(num_kv_heads * nd, -1, head_dim)
        if kv_cache.format.quantized:      # decoded as it is read
            out = _decode_scaled(qg, kv_cache, batch, scale, window, cap)
        else:
            tables, max_len, bias = _decode_meta(batch, block_size, num_kv_heads, q.dtype, window)
            k, v = gather_context(kv_cache, tables, max_len).flatten(1, 2)       # [KVH*B, L, D] each
            if cap is None:
                scores = torch.baddbmm(bias, qg, k.transpose(1, 2), alpha=scale)    # [KVH*B, G, L]
            else:
                scores = soft_cap(torch.bmm(qg, k.transpose(1, 2)) * scale, cap) + bias
            probs = scores.float().softmax(-1).to(q.dtype)
            out = torch.bmm(probs, v)
        out = out.view(num_kv_heads, nd, -1, head_dim)
        return out.transpose(0, 1).reshape(nd, num_heads, head_dim)

    @staticmethod
    def _prefill(q, k, v, lens: list[int], scale: float, window: int | None, cap: float | None) -> torch.Tensor:
        qp, kp, vp = _pad(q, lens), _pad(k, lens), _pad(v, lens)
        if cap is None and (window is None or max(lens) <= window):
            # Right padding keeps is_causal exact for every real query: it only sees earlier keys.
            out = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=True)
        else:
            pos = torch.arange(qp.shape[2], device=q.device)
            out = _attend(qp, kp, vp, _visible(pos[:, None], pos, window), scale, cap)
        return _unpad(out, lens)

    @staticmethod
    def _prefill_paged(q, kv_cache, batch: AttentionBatch, scale: float, window: int | None,
                       cap: float | None) -> torch.Tensor:
        nd = batch.num_decodes
        q_lens, ctx = batch.query_lens[nd:], batch.context_lens_list[nd:]
        block_size = kv_cache.shape[3]
        # keys before every query's window are not gathered: from the block of the earliest one a query sees
        first = 0 if window is None else max(0, min(c - n for c, n in zip(ctx, q_lens)) - window + 1) // block_size
        tables = batch.block_tables[nd:, first:]
        start, max_len = first * block_size, max(ctx)
        keys, values = gather_context(kv_cache, tables, max_len - start).transpose(1, 2)   # [B, KVH, L, D] each
        qp = _pad(q, q_lens)
        offsets = torch.tensor([c - n for c, n in zip(ctx, q_lens)], device=q.device)
        q_pos = torch.arange(qp.shape[2], device=q.device)[None, :] + offsets[:, None]
        k_pos = torch.arange(start, max_len, device=q.device)
        mask = _visible(q_pos[:, :, None], k_pos, window)
        return _unpad(_attend(qp, keys, values, mask[:, None], scale, cap), q_lens)


def _visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Which keys each query sees (q_pos and k_pos broadcast against each other): causal, within the window."""
    seen = k_pos <= q_pos
    return seen if window is None else seen & (k_pos > q_pos - window)


def _attend(q, k, v, mask: torch.Tensor, scale: float, cap: float | None) -> torch.Tensor:
    """softmax(q kᵀ * scale) v over the keys that `mask` shows, q [B, H, Lq, D], k and v [B, KVH, Lk, D]:
    by SDPA, or by matmuls in float32 where the scores are soft-capped."""
    if cap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = soft_cap(q.float() @ k.float().transpose(-1, -2) * scale, cap).masked_fill_(~mask, float("-inf"))
    return (scores.softmax(-1).to(q.dtype) @ v).to(q.dtype)


def _decode_scaled(qg: torch.Tensor, layer: QuantizedPages, batch: AttentionBatch, scale: float,
                   window: int | None, cap: float | None) -> torch.Tensor:
    """Decode over quantized pages without scaling their numbers: the keys' scales go to the scores
    (their minimums, times the sum of the query, too) and the values' to the probabilities."""
    tables, max_len, bias = _decode_meta(batch, layer.shape[3], layer.shape[1], torch.float32, window)
    pages, k_affine, v_affine = layer.gather_affine(tables)
    if layer.format.splits_channels:
        qg = split_channels(qg)
    k, v = pages.flatten(3, 4).flatten(1, 2)                              # [KVH*B, L, D] each
    raw = torch.bmm(qg, k.transpose(1, 2)).float().mul_(_per_token(k_affine.scale))
    if k_affine.offset is not None:
        raw.addcmul_(qg.float().sum(-1, keepdim=True), _per_token(k_affine.offset))
    scores = (soft_cap(raw * scale, cap) + bias) if cap is not None else torch.add(bias, raw, alpha=scale)
    probs = scores.softmax(-1)
    out = torch.bmm((probs * _per_token(v_affine.scale)).to(qg.dtype), v)
    if v_affine.offset is not None:
        out += (probs * _per_token(v_affine.offset)).sum(-1, keepdim=True).to(out.dtype)
    return merge_channels(out) if layer.format.splits_channels else out


def _per_token(t: torch.Tensor) -> torch.Tensor:
    """Per-token values [KVH, B, nb, BS] as [KVH*B, 1, L], to broadcast over a row's queries."""
    return t.flatten(0, 1).flatten(1, 2)[:, None]


def _decode_meta(batch: AttentionBatch, block_size: int, num_kv_heads: int, dtype: torch.dtype,
                 window: int | None):
    """Block tables, context length and additive mask of the decodes, built once per step (per window).

    The length is whole blocks: the matmuls' shapes then change once a block, not every step (the
    CPU's bf16 matmul builds a kernel for each new shape), and the gather needs no slicing copy.
    With a sliding window shorter than some context, each row's tables start at the block of its
    window's first key, and span as many blocks as a window can touch.
    """
    nd = batch.num_decodes
    ctx = batch.context_lens[:nd]
    longest = max(batch.context_lens_list[:nd])
    if window is not None and longest <= window:
        window = None                   # no key left any window: the plain tables
    meta = batch.scratch.get(("decode", dtype, window))
    if meta is None:
        if window is None:
            max_len = -(-longest // block_size) * block_size
            tables = batch.block_tables[:nd, :max_len // block_size]
            hidden = torch.arange(max_len, device=ctx.device) >= ctx[:, None]
        else:
            width = min((window - 1) // block_size + 2, batch.block_tables.shape[1])
            first = (ctx - window).clamp_min(0) // block_size                        # [B] the window's first block
            blocks = first[:, None] + torch.arange(width, device=ctx.device)
            tables = batch.block_tables[:nd].gather(1, blocks.clamp_max(batch.block_tables.shape[1] - 1))
            max_len = width * block_size
            pos = first[:, None] * block_size + torch.arange(max_len, device=ctx.device)
            hidden = (pos >= ctx[:, None]) | (pos < ctx[:, None] - window)
        bias = torch.zeros(hidden.shape, dtype=dtype, device=hidden.device).masked_fill_(hidden, float("-inf"))
        bias = bias.repeat(num_kv_heads, 1)[:, None]
        meta = batch.scratch[("decode", dtype, window)] = (tables, max_len, bias)
    return meta
