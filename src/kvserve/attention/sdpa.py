"""The `sdpa` backend: torch SDPA for prompts (padded per batch), batched matmuls for decodes, over K/V
gathered through the block tables; `native` delegates to it what its C kernels do not run."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.attention.batch import AttentionBackend, AttentionBatch
from kvserve.attention.gather import gather_context
from kvserve.kv.quant import Affine, QuantizedLayer, merge_channels, split_channels


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
    """Decode: one query per sequence against its pages; prefill: causal SDPA, padded per batch."""

    name = "sdpa"

    def forward(self, q, k, v, kv_cache, batch: AttentionBatch, scale: float) -> torch.Tensor:
        nd = batch.num_decodes
        parts = []
        if nd:
            parts.append(self._decode(q[:nd], kv_cache, batch, scale))
        if batch.num_prefills:
            if batch.has_prefix:
                parts.append(self._prefill_paged(q[nd:], kv_cache, batch, scale))
            else:
                parts.append(self._prefill(q[nd:], k[nd:], v[nd:], batch.query_lens[nd:], scale))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    @staticmethod
    def _decode(q, kv_cache, batch: AttentionBatch, scale: float) -> torch.Tensor:
        # One query per sequence: batched matmuls beat SDPA's CPU kernel here, and the scores are
        # only [seqs, heads, context], never L x L. GQA: the G query heads of a KV head share its keys.
        nd, num_heads, head_dim = q.shape
        num_kv_heads, block_size = kv_cache.shape[1], kv_cache.shape[3]
        qg = q.view(nd, num_kv_heads, -1, head_dim).transpose(0, 1).reshape(num_kv_heads * nd, -1, head_dim)
        if isinstance(kv_cache, QuantizedLayer):
            out = _decode_scaled(qg, kv_cache, batch, scale)
        else:
            tables, max_len, bias = _decode_meta(batch, block_size, num_kv_heads, q.dtype)
            k, v = gather_context(kv_cache, tables, max_len).flatten(1, 2)       # [KVH*B, L, D] each
            scores = torch.baddbmm(bias, qg, k.transpose(1, 2), alpha=scale)    # [KVH*B, G, L]
            probs = scores.float().softmax(-1).to(q.dtype)
            out = torch.bmm(probs, v)
        out = out.view(num_kv_heads, nd, -1, head_dim)
        return out.transpose(0, 1).reshape(nd, num_heads, head_dim)

    @staticmethod
    def _prefill(q, k, v, lens: list[int], scale: float) -> torch.Tensor:
        # Right padding keeps is_causal exact for every real query: it only sees earlier keys.
        out = F.scaled_dot_product_attention(_pad(q, lens), _pad(k, lens), _pad(v, lens),
                                             is_causal=True, scale=scale, enable_gqa=True)
        return _unpad(out, lens)

    @staticmethod
    def _prefill_paged(q, kv_cache, batch: AttentionBatch, scale: float) -> torch.Tensor:
        nd = batch.num_decodes
        q_lens, ctx = batch.query_lens[nd:], batch.context_lens_list[nd:]
        tables = batch.block_tables[nd:]
        max_len = max(ctx)
        keys, values = gather_context(kv_cache, tables, max_len).transpose(1, 2)   # [B, KVH, L, D] each
        qp = _pad(q, q_lens)
        offsets = torch.tensor([c - n for c, n in zip(ctx, q_lens)], device=q.device)
        q_pos = torch.arange(qp.shape[2], device=q.device)[None, :] + offsets[:, None]
        mask = torch.arange(max_len, device=q.device)[None, None, :] <= q_pos[:, :, None]
        out = F.scaled_dot_product_attention(qp, keys, values, attn_mask=mask[:, None],
                                             scale=scale, enable_gqa=True)
        return _unpad(out, q_lens)


def _decode_scaled(qg: torch.Tensor, layer: QuantizedLayer, batch: AttentionBatch, scale: float) -> torch.Tensor:
    """Decode over quantized pages without scaling their numbers: the keys' scales go to the scores
    (or, one per channel of a block, to the queries) and the values' to the probabilities."""
    tables, max_len, bias = _decode_meta(batch, layer.shape[3], layer.shape[1], torch.float32)
    filling = batch.scratch.get("filling")
    if filling is None:
        filling = batch.scratch["filling"] = layer.filling(tables)
    pages, k_affine, v_affine = layer.gather_affine(tables, filling)
    if layer.splits_channels:
        qg = split_channels(qg)
    k, v = pages.flatten(3, 4).flatten(1, 2)                              # [KVH*B, L, D] each
    if k_affine.per_channel:
        scores = torch.add(bias, _per_channel_key_scores(qg, k, k_affine, layer.shape[3]), alpha=scale)
    else:
        scores = torch.addcmul(bias, torch.bmm(qg, k.transpose(1, 2)).float(), _per_token(k_affine.scale),
                               value=scale)
    probs = scores.softmax(-1)
    out = torch.bmm((probs * _per_token(v_affine.scale)).to(qg.dtype), v)
    if v_affine.offset is not None:
        out += (probs * _per_token(v_affine.offset)).sum(-1, keepdim=True).to(out.dtype)
    return merge_channels(out) if layer.splits_channels else out


def _per_channel_key_scores(qg: torch.Tensor, k: torch.Tensor, k_affine: Affine, block_size: int) -> torch.Tensor:
    """q . k, float32 [KVH*B, G, L], for key numbers k [KVH*B, L, D] whose scales and minimums are
    per channel of each block (int4): the queries are scaled per block, and q . min added to every
    key of its block."""
    rows, groups, head_dim = qg.shape
    qb = qg.float()[:, None] * k_affine.scale.flatten(0, 1)[:, :, None]   # [KVH*B, nb, G, D]
    scores = torch.bmm(qb.to(k.dtype).flatten(0, 1), k.reshape(-1, block_size, head_dim).transpose(1, 2)).float()
    scores = scores.view(rows, -1, groups, block_size)
    scores += torch.einsum("rgd,rnd->rng", qg.float(), k_affine.offset.flatten(0, 1))[..., None]
    return scores.transpose(1, 2).reshape(rows, groups, -1)


def _per_token(t: torch.Tensor) -> torch.Tensor:
    """Per-token values [KVH, B, nb, BS] as [KVH*B, 1, L], to broadcast over a row's queries."""
    return t.flatten(0, 1).flatten(1, 2)[:, None]


def _decode_meta(batch: AttentionBatch, block_size: int, num_kv_heads: int, dtype: torch.dtype):
    """Block tables, context length and additive padding mask of the decodes, built once per step.

    The length is whole blocks: the matmuls' shapes then change once a block, not every step (the
    CPU's bf16 matmul builds a kernel for each new shape), and the gather needs no slicing copy.
    """
    meta = batch.scratch.get(("decode", dtype))
    if meta is None:
        nd = batch.num_decodes
        max_len = -(-max(batch.context_lens_list[:nd]) // block_size) * block_size
        pad = torch.arange(max_len, device=batch.context_lens.device) >= batch.context_lens[:nd, None]
        bias = torch.zeros(pad.shape, dtype=dtype, device=pad.device).masked_fill_(pad, float("-inf"))
        bias = bias.repeat(num_kv_heads, 1)[:, None]
        meta = batch.scratch[("decode", dtype)] = (batch.block_tables[:nd, :max_len // block_size], max_len, bias)
    return meta
