"""FlashAttention-2 on the CPU: tiles of queries against tiles of keys, online softmax, paged K/V.

Scores exist only one (query tile x key tile) at a time, so temporary memory is O(tile x length)
at most, never O(length^2). Keys and values are read a tile of pages at a time through the block
tables; GQA groups the query heads of a KV head instead of repeating K/V. All sequences and heads
of a step move through each tile together, so Python runs once per tile, not per sequence or head.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from kvserve.attention.batch import AttentionBackend, AttentionBatch, soft_cap
from kvserve.kv.pages import LayerPages

Q_TILE = 512
K_TILE = 512
DECODE_K_TILE = 2048      # one query row per head: a longer key tile costs little memory, saves steps


class FlashBackend(AttentionBackend):
    name = "flash"

    def __init__(self, q_tile: int = Q_TILE, k_tile: int = K_TILE, decode_k_tile: int = DECODE_K_TILE):
        self.q_tile, self.k_tile, self.decode_k_tile = q_tile, k_tile, decode_k_tile

    def forward(self, q, k, v, kv_cache, batch: AttentionBatch, scale: float, sliding_window: int | None = None,
                logits_soft_cap: float | None = None) -> torch.Tensor:
        nd = batch.num_decodes
        parts = []
        if nd:
            parts.append(self.decode(q[:nd], kv_cache, batch.block_tables[:nd], batch.context_lens[:nd],
                                     batch.context_lens_list[:nd], scale, sliding_window, logits_soft_cap))
        if batch.num_prefills:
            q_lens, ctx = batch.query_lens[nd:], batch.context_lens_list[nd:]
            if kv_cache is None:
                source = _padded_source(k[nd:], v[nd:], q_lens)
            else:
                source = _paged_source(kv_cache, batch.block_tables[nd:])
            parts.append(self.prefill(q[nd:], q_lens, ctx, source, scale, sliding_window, logits_soft_cap))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def decode(self, q, kv_cache, block_tables, context_lens, ctx_list: list[int], scale: float,
               window: int | None = None, cap: float | None = None) -> torch.Tensor:
        """One query per sequence over its pages (the last `window` of them, where given): [B, H, D]."""
        b, h, d = q.shape
        kvh = kv_cache.shape[1]
        qg = q.view(b, kvh, h // kvh, d).float() * scale                       # [B, KVH, G, D]
        state = _OnlineSoftmax(qg.shape[:-1], d, q.device)
        read = _paged_source(kv_cache, block_tables)
        shortest, longest = min(ctx_list), max(ctx_list)
        first = 0 if window is None else max(0, shortest - window)            # no window starts earlier
        for start in range(first, longest, self.decode_k_tile):
            end = min(start + self.decode_k_tile, longest)
            keys, values = read(start, end)                                     # [B, KVH, Tk, D]
            scores = qg @ keys.transpose(-1, -2)                                # [B, KVH, G, Tk]
            if cap is not None:
                scores = soft_cap(scores, cap)
            pos = torch.arange(start, start + keys.shape[2], device=q.device)
            if end > shortest:                  # past some sequence's end: hide those keys
                scores.masked_fill_((pos >= context_lens[:, None])[:, None, None, :], float("-inf"))
            if window is not None and start < longest - window:     # before some sequence's window
                scores.masked_fill_((pos < context_lens[:, None] - window)[:, None, None, :], float("-inf"))
            state.update(scores, values)
        return state.result().view(b, h, d).to(q.dtype)

    def prefill(self, q, q_lens: list[int], ctx_lens: list[int], read, scale: float, window: int | None = None,
                cap: float | None = None) -> torch.Tensor:
        """Causal attention of each sequence's new tokens over its context (its last `window` positions, where
        given): flat [T, H, D]."""
        b, h, d = len(q_lens), q.shape[1], q.shape[2]
        kvh = read.num_kv_heads
        g = h // kvh
        # [B, KVH, G, Lq, D], padded at the end of each sequence
        qp = torch.nn.utils.rnn.pad_sequence(list(q.split(q_lens)), batch_first=True)
        qp = qp.view(b, -1, kvh, g, d).permute(0, 2, 3, 1, 4).float() * scale
        offsets = [c - n for c, n in zip(ctx_lens, q_lens)]                   # tokens cached before
        offsets_t = torch.tensor(offsets, device=q.device)
        ctx = torch.tensor(ctx_lens, device=q.device)
        out = torch.empty_like(qp)
        for qs in range(0, qp.shape[3], self.q_tile):
            qe = min(qs + self.q_tile, qp.shape[3])
            q_pos = offsets_t[:, None] + torch.arange(qs, qe, device=q.device)  # [B, Tq]
            last_key = max(min(c, o + qe) for c, o in zip(ctx_lens, offsets))  # causal: no key past this
            first_row = min(offsets) + qs                                       # no valid row sits earlier
            out[:, :, :, qs:qe] = self._query_tile(qp[:, :, :, qs:qe], q_pos, ctx, first_row, last_key, read,
                                                   window, cap)
        flat = out.permute(0, 3, 1, 2, 4).reshape(b, -1, h, d)
        return torch.cat([flat[i, :n] for i, n in enumerate(q_lens)]).to(q.dtype)

    def _query_tile(self, qt, q_pos, ctx, first_row: int, last_key: int, read, window: int | None,
                    cap: float | None) -> torch.Tensor:
        b, kvh, g, tq, d = qt.shape
        qt = qt.reshape(b, kvh, g * tq, d)
        state = _OnlineSoftmax(qt.shape[:-1], d, qt.device)
        rows = q_pos.repeat(1, g)                                              # [B, G*Tq] row positions
        # a window: no row sees a key before the earliest row's window, and keys before the latest
        # row's window (some row's) are masked
        first_key = 0 if window is None else max(0, first_row - window + 1)
        last_row = int(q_pos.max())
        for start in range(first_key, last_key, self.k_tile):
            keys, values = read(start, min(start + self.k_tile, last_key))
            scores = qt @ keys.transpose(-1, -2)                                # [B, KVH, G*Tq, Tk]
            if cap is not None:
                scores = soft_cap(scores, cap)
            end = start + keys.shape[2]
            pos = torch.arange(start, end, device=qt.device)
            if end - 1 > first_row:             # a diagonal or ragged tile: hide future and padded keys
                hidden = (pos[None, None, :] > rows[:, :, None]) | (pos >= ctx[:, None])[:, None, :]
                scores.masked_fill_(hidden[:, None], float("-inf"))
            if window is not None and start <= last_row - window:
                scores.masked_fill_((pos[None, None, :] <= rows[:, :, None] - window)[:, None], float("-inf"))
            state.update(scores, values)
        return state.result().view(b, kvh, g, tq, d)


class _OnlineSoftmax:
    """Running max, running sum and unnormalised output of softmax(scores) @ V over key tiles."""

    def __init__(self, shape: torch.Size, head_dim: int, device: torch.device):
        self.m = torch.full(shape, float("-inf"), device=device)
        self.l = torch.zeros(shape, device=device)
        self.acc = torch.zeros(*shape, head_dim, device=device)

    def update(self, scores: torch.Tensor, values: torch.Tensor) -> None:
        """Fold in one key tile; `scores` is overwritten with the tile's probabilities."""
        m_new = torch.maximum(self.m, scores.amax(-1))
        # Rows that have seen only masked keys keep m = -inf; shift them by 0 to avoid inf - inf.
        shift = m_new.nan_to_num(neginf=0.0)
        p = scores.sub_(shift[..., None]).exp_()
        alpha = (self.m - shift).exp_()
        self.l.mul_(alpha).add_(p.sum(-1))
        self.acc.mul_(alpha[..., None]).add_(p @ values)
        self.m = m_new

    def result(self) -> torch.Tensor:
        return self.acc / self.l.clamp_min(1e-30)[..., None]


class _KVSource:
    """Reads K and V tiles [B, KVH, Tk, D] (float32) for key positions [start, end) of every sequence."""

    def __init__(self, num_kv_heads: int, read: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]):
        self.num_kv_heads, self._read = num_kv_heads, read

    def __call__(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._read(start, end)


def _paged_source(kv_cache: LayerPages, block_tables: torch.Tensor) -> _KVSource:
    """Tiles gathered page by page: a tile's pages only, never a whole context."""
    block_size = kv_cache.shape[3]

    def read(start: int, end: int):
        first, last = start // block_size, -(-end // block_size)
        pages = kv_cache.gather(block_tables[:, first:last])               # [2, KVH, B, n, BS, D]
        kv = pages.flatten(3, 4)[:, :, :, start - first * block_size:end - first * block_size]
        return kv[0].transpose(0, 1).float(), kv[1].transpose(0, 1).float()

    return _KVSource(kv_cache.shape[1], read)


def _padded_source(k: torch.Tensor, v: torch.Tensor, lens: list[int]) -> _KVSource:
    """With no cache, the step's own K/V [T, KVH, D], padded per sequence."""
    kp = torch.nn.utils.rnn.pad_sequence(list(k.split(lens)), batch_first=True).transpose(1, 2).float()
    vp = torch.nn.utils.rnn.pad_sequence(list(v.split(lens)), batch_first=True).transpose(1, 2).float()
    return _KVSource(k.shape[1], lambda start, end: (kp[:, :, start:end], vp[:, :, start:end]))
