"""Sparse decode attention in a step (kv/sparse.py): what the backends read of it, and its selection in torch.

A step whose decodes include some under sparse attention carries a SparseDecode (AttentionBatch.sparse): each
sequence's options, and where the reads are counted. Each layer reads its own (AttentionBatch.for_layer): a layer
before a sequence's dense_layers attends densely. The C kernels (csrc/paged_decode.c's decode_blocks) select
within each (sequence, KV head) task; select_blocks here is the same choice in torch, for the GPU's kernels: a
block table per (sequence, KV head) and its context, over which any paged decode attends exactly.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kvserve.kv.pages import LayerPages
from kvserve.kv.sparse import SparseAttention, selection_pays

NONE = (-1, 0, 0, 0)        # the params of a sequence without sparse attention


@dataclass
class SparseDecode:
    """params [seqs, 4] (int64, on the batch's device): each sequence's Quest.params (budget, sinks, recent,
    dense_layers), a budget below 0 where it has no sparse attention (prefills included), 0 where it attends
    densely and is counted (a dense layer). counts [2] (int64): blocks the counted sequences' decode tasks read,
    and the blocks of their contexts, added up over the steps. record [layers, seqs, table width] (uint8, or
    None): for each entry of a sequence's block table, how many of a layer's tasks (KV heads) read it this step.
    `layer`: the layer whose dense_layers the params honour (None: the step's, before for_layer)."""

    params: torch.Tensor
    counts: torch.Tensor
    record: torch.Tensor | None
    layer: int | None = None

    def for_layer(self, i: int) -> SparseDecode:
        """Layer i's: a sequence's budget 0 (dense, counted) in its first dense_layers layers."""
        budget, dense_layers = self.params[:, 0], self.params[:, 3]
        params = self.params.clone()
        params[:, 0] = torch.where((budget > 0) & (dense_layers > i), 0, budget)
        return replace(self, params=params, layer=i)

    def decodes(self, n: int) -> SparseDecode:
        """The first n sequences' (the decodes of a step, which lead its batch)."""
        record = None if self.record is None else self.record[:, :n]
        return replace(self, params=self.params[:n], record=record)

    def layer_record(self) -> torch.Tensor | None:
        """This layer's record [seqs, table width] (None: none kept)."""
        return None if self.record is None or self.layer is None else self.record[self.layer]


class SparseStats:
    """An engine's sparse attention reads: `counts` (SparseDecode's, over every step), and the record of the last
    step that had sparse decodes, by sequence id (what the dashboard shows)."""

    def __init__(self, num_layers: int, device: torch.device):
        self.num_layers, self.device = num_layers, device
        self.counts = torch.zeros(2, dtype=torch.int64, device=device)
        self.record: torch.Tensor | None = None
        self.rows: dict[int, int] = {}          # sequence id -> its row of the record

    def decode(self, seq_ids: list[int], policies: list[SparseAttention | None], width: int) -> SparseDecode | None:
        """A step's SparseDecode for its sequences (their policies, the step's block table width), None where
        none has sparse attention; its record becomes the last step's."""
        if all(p is None for p in policies):
            return None
        params = torch.tensor([NONE if p is None else p.params() for p in policies], dtype=torch.int64)
        self.record = torch.zeros(self.num_layers, len(policies), width, dtype=torch.uint8, device=self.device)
        self.rows = {s: i for i, (s, p) in enumerate(zip(seq_ids, policies)) if p is not None}
        return SparseDecode(params.to(self.device), self.counts, self.record)

    def blocks_read(self, seq_id: int) -> list[list[int]] | None:
        """For a sequence of the last step with sparse decodes: per layer, how many KV heads read each entry of
        its block table (all 0 in a layer it did not decode through: a sliding window's); else None."""
        row = self.rows.get(seq_id)
        return None if row is None else self.record[:, row].tolist()

    def stats(self) -> dict:
        read, total = self.counts.tolist()
        return {"sparse_blocks_read": read, "sparse_blocks_total": total}


def choose_blocks(q: torch.Tensor, kv_cache: LayerPages, block_tables: torch.Tensor, context_lens: torch.Tensor,
                  params: torch.Tensor) -> torch.Tensor:
    """Which entries of each sequence's block table each of its KV heads reads, [n, KVH, width] (bool), as
    csrc/paged_decode.c's decode_blocks chooses them for q [n, H, D] (one query a sequence) over its pages
    (block_tables [n, width], context_lens [n]) under params [n, 4] (SparseDecode's); every block of the context
    where a sequence attends densely, or where choosing does not pay (kv/sparse.py's selection_pays). Without a
    host synchronisation."""
    n, num_heads, d = q.shape
    _, kvh, _, bs, _ = kv_cache.shape
    width = block_tables.shape[1]
    summaries = kv_cache.summaries.data[:, block_tables].float()           # [KVH, n, width, 2, D]
    heads = q.float().view(n, kvh, num_heads // kvh, d)
    pos, neg = heads.clamp_min(0).sum(2), (-heads).clamp_min(0).sum(2)    # [n, KVH, D]
    bound = (torch.einsum("nkd,knwd->nkw", pos, summaries[..., 1, :])
             - torch.einsum("nkd,knwd->nkw", neg, summaries[..., 0, :]))
    budget, sinks, recent = (params[:, i, None, None] for i in range(3))
    ctx = context_lens.to(torch.int64)[:, None, None]
    nb = (ctx + bs - 1) // bs
    first = torch.minimum((sinks.clamp_min(0) + bs - 1) // bs, nb)
    last = torch.maximum((ctx - recent).div(bs, rounding_mode="floor"), first)
    k = torch.minimum((budget.div(bs, rounding_mode="floor") - first - (nb - last)).clamp_min(0), last - first)
    j = torch.arange(width, device=q.device)
    middle = (j >= first) & (j < last)
    # each middle block's rank: by bound, of equal ones the earlier first (a stable sort)
    order = torch.sort(torch.where(middle, bound, -torch.inf), dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(-1, order, j.expand_as(order))
    chosen = (middle & (rank < k)) | (j < first) | ((j >= last) & (j < nb))
    pays = selection_pays(last - first, k, *block_bytes(kv_cache))
    return torch.where((budget > 0) & (ctx > budget) & pays, chosen, j < nb)


def block_bytes(kv_cache: LayerPages) -> tuple[int, int]:
    """A block's bytes in one KV head of a layer's pages (K and V, their scales included) and its summary's: what
    kv/sparse.py's selection_pays weighs."""
    kvh = kv_cache.shape[1]
    pages = sum(t.numel() // t.shape[axis] * t.element_size() for t, axis in kv_cache.block_parts()) // kvh
    summaries = kv_cache.summaries.data
    return pages, summaries[0, 0].numel() * summaries.element_size()


def select_blocks(q: torch.Tensor, kv_cache: LayerPages, block_tables: torch.Tensor, context_lens: torch.Tensor,
                  sparse: SparseDecode) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocks each (decode, KV head) reads (choose_blocks'): a block table [n, KVH, width] and its context
    [n, KVH] (int64), over which a paged decode attends exactly; a sequence that attends densely keeps its table
    and context. Counts its reads into sparse.counts and sparse.layer_record(). Without a host synchronisation."""
    n, kvh, bs, width = len(q), kv_cache.shape[1], kv_cache.shape[3], block_tables.shape[1]
    chosen = choose_blocks(q, kv_cache, block_tables, context_lens, sparse.params)
    ctx = context_lens.to(torch.int64)[:, None]
    nb = (ctx + bs - 1) // bs
    count = chosen.sum(-1)                                                           # [n, KVH]
    # the last block read is the context's last (the recent window's): its tokens end the context
    lens = (count - 1) * bs + ctx - (nb - 1) * bs
    j = torch.arange(width, device=q.device)
    tables = block_tables[:, None].expand(n, kvh, width).gather(-1, torch.sort(torch.where(chosen, j, width + j))
                                                                .indices)
    counted = sparse.params[:, :1] >= 0                                              # [n, 1]
    sparse.counts.add_(torch.stack(((count * counted).sum(), (nb * counted).sum() * kvh)))
    record = sparse.layer_record()
    if record is not None:
        record[:n] += (chosen & counted[..., None]).sum(1).to(torch.uint8)
    return tables, lens
