"""The textbook recipe: materialize softmax(Q Kᵀ / √d) per sequence. The reference for every kernel."""
from __future__ import annotations

import torch

from kvserve.attention.batch import AttentionBackend, AttentionBatch
from kvserve.attention.gather import gather_context


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, q_offset: int = 0,
           sliding_window: int | None = None, logits_soft_cap: float | None = None) -> torch.Tensor:
    """Causal attention of q [Lq, H, D] at positions q_offset.. over k, v [Lk, KVH, D]; within the last
    sliding_window positions, and soft-capped scores, where given (AttentionBackend.forward)."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1).transpose(0, 1).float()   # [H, Lk, D]
    v = v.repeat_interleave(group, dim=1).transpose(0, 1).float()
    scores = q.transpose(0, 1).float() @ k.transpose(1, 2) * scale   # [H, Lq, Lk]: the L x L matrix
    if logits_soft_cap is not None:
        scores = torch.tanh(scores / logits_soft_cap) * logits_soft_cap
    q_pos = torch.arange(q.shape[0], device=q.device)[:, None] + q_offset
    k_pos = torch.arange(k.shape[1], device=q.device)[None, :]
    hidden = k_pos > q_pos
    if sliding_window is not None:
        hidden |= k_pos <= q_pos - sliding_window
    scores.masked_fill_(hidden, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1).to(q.dtype)


class TextbookBackend(AttentionBackend):
    name = "textbook"

    def forward(self, q, k, v, kv_cache, batch: AttentionBatch, scale: float, sliding_window: int | None = None,
                logits_soft_cap: float | None = None) -> torch.Tensor:
        out = torch.empty_like(q)
        start = 0
        for i, (q_len, ctx_len) in enumerate(zip(batch.query_lens, batch.context_lens_list)):
            end = start + q_len
            if kv_cache is None:
                keys, values = k[start:end], v[start:end]
            else:
                keys, values = gather_context(kv_cache, batch.block_tables[i:i + 1], ctx_len)[:, :, 0].transpose(1, 2)
            out[start:end] = attend(q[start:end], keys, values, scale, ctx_len - q_len, sliding_window,
                                    logits_soft_cap)
            start = end
        return out
