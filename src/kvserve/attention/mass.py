"""How much attention each cached token receives: the scores that h2o and snapkv evict by.

Computed beside the backend's own attention, for the few sequences whose policy asks, with the
textbook recipe over their pages (chunks of queries, so a long prompt never holds L x L scores).
"""
from __future__ import annotations

import torch

from kvserve.attention.batch import AttentionBatch, soft_cap
from kvserve.attention.gather import gather_context

Q_CHUNK = 256


def accumulate_attention_mass(q: torch.Tensor, kv_cache, batch: AttentionBatch, scale: float,
                              logits_soft_cap: float | None = None) -> None:
    """For each (row, first, count, reduce) of batch.mass_requests: the softmax probabilities of the
    step's queries first..first+count-1 (flat indices into q [T, H, D]; the row's last `count`) over
    its cached keys (their scores soft-capped as the layer caps them), reduced ("sum" or "max") over those
    queries and the heads of each KV head, as one [KVH, context] tensor appended to batch.mass[row] (a layer's)."""
    for row, first, count, reduce in batch.mass_requests:
        ctx = batch.context_lens_list[row]
        keys = gather_context(kv_cache, batch.block_tables[row:row + 1], ctx)[0, :, 0].float()   # [KVH, L, D]
        kvh = keys.shape[0]
        first_pos = ctx - count     # the scored queries are the sequence's last ones of the step
        mass = None
        for c in range(0, count, Q_CHUNK):
            qs = q[first + c:first + min(count, c + Q_CHUNK)].float()                    # [n, H, D]
            qg = qs.view(len(qs), kvh, -1, qs.shape[-1]).transpose(0, 1)                  # [KVH, n, G, D]
            scores = torch.einsum("hngd,hld->hngl", qg, keys) * scale
            if logits_soft_cap is not None:
                scores = soft_cap(scores, logits_soft_cap)
            pos = first_pos + c + torch.arange(len(qs), device=q.device)
            future = torch.arange(ctx, device=q.device)[None, :] > pos[:, None]          # [n, L]
            scores.masked_fill_(future[None, :, None], float("-inf"))
            probs = scores.softmax(-1)
            if reduce == "max":
                chunk = probs.amax((1, 2))
                mass = chunk if mass is None else torch.maximum(mass, chunk)
            else:
                chunk = probs.sum((1, 2))
                mass = chunk if mass is None else mass + chunk
        batch.mass.setdefault(row, []).append(mass)
