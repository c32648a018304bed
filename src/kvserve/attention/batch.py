"""AttentionBatch: what one engine step tells every attention layer about its flat token batch."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from kvserve.attention.sparse import SparseDecode
from kvserve.kv.pages import LayerPages


@dataclass
class AttentionBatch:
    """Tokens are packed flat: first one token per decoding sequence, then each prefill's tokens.

    A prefill computes `query_lens[i]` new tokens on top of `context_lens[i] - query_lens[i]`
    tokens already in the cache (a chunk of a long prompt, or nothing for a fresh prompt).
    Every layer reads the same batch; what differs by layer (its sliding window, its soft cap) comes
    with the layer's call to AttentionBackend.forward.
    """

    num_decodes: int
    slot_mapping: torch.Tensor | None          # [tokens] cache slot of each new token; None: no cache
    block_tables: torch.Tensor | None          # [seqs, max_blocks] page ids, padded with 0
    context_lens: torch.Tensor                 # [seqs] tokens attended to, new ones included
    query_lens: list[int]                      # [seqs] new tokens per sequence
    context_lens_list: list[int]               # context_lens as Python ints (for shapes)
    has_prefix: bool                           # prefills read the pages (a cached prefix, or quantized pages)
    # decodes' contexts are at most this long: kernels launched for it serve any step (CUDA graphs)
    decode_context_bound: int | None = None
    # (row, first flat token, count, "sum" | "max"): a row's last queries, whose attention mass over the cache
    # each layer appends to mass[row] as [KVH, context] (for the eviction policies that evict by it)
    mass_requests: list[tuple[int, int, int, str]] = field(default_factory=list)
    mass: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    # the layers that gather that mass (None: every layer): those that attend to the whole context, where other
    # layers attend within a sliding window (their attention says nothing of the tokens before it)
    mass_layers: frozenset[int] | None = None
    scratch: dict = field(default_factory=dict)  # what backends derive once per step, shared by layers
    # a hybrid cache (kv/groups.py): the batch of each layer group but the first (this one), with the group's
    # slots and block tables, and each layer's group
    groups: list[AttentionBatch] = field(default_factory=list)
    layer_group: list[int] = field(default_factory=list)
    # sparse decode attention (attention/sparse.py): the step's, or (for_layer's) a layer's; None: none
    sparse: SparseDecode | None = None

    def for_layer(self, i: int) -> AttentionBatch:
        """The batch that layer i reads: its layer group's (this one where the cache has one group), with layer i's
        sparse attention."""
        g = self.layer_group[i] if self.groups else 0
        batch = self.groups[g - 1] if g else self
        if batch.sparse is None:
            return batch
        key = ("sparse layer", i)          # made once per step, shared by a layer's calls (and its scratch)
        if key not in batch.scratch:
            batch.scratch[key] = replace(batch, sparse=batch.sparse.for_layer(i))
        return batch.scratch[key]

    @property
    def num_prefills(self) -> int:
        return len(self.query_lens) - self.num_decodes


class AttentionBackend:
    """What every backend provides: store the step's K/V in the pages, then attend."""

    name = ""
    supports_cuda_graphs = False   # its decode launches depend on decode_context_bound only, with no host sync
    supports_sparse = False        # its decodes honour AttentionBatch.sparse (sparse attention: kv/sparse.py)

    def store(self, kv_cache: LayerPages, kv: torch.Tensor, batch: AttentionBatch) -> None:
        """Write the new tokens' K and V [tokens, 2, kv_heads, head_dim] into a layer's pages."""
        kv_cache.write_tokens(kv, batch.slot_mapping)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: LayerPages | None,
                batch: AttentionBatch, scale: float, sliding_window: int | None = None,
                logits_soft_cap: float | None = None) -> torch.Tensor:
        """q [T, H, D] and the step's k, v [T, KVH, D] -> [T, H, D], over a layer's pages when kv_cache is given.

        A layer's own attention: with a sliding_window W, the query at position p attends to the positions
        (p - W, p] only (the last W of its context); with logits_soft_cap c, its scores s (scaled) become
        c * tanh(s / c) before the softmax (Gemma 2)."""
        raise NotImplementedError



def soft_cap(scores: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(scores / cap): scores bounded to (-cap, cap), nearly unchanged where small (Gemma 2's)."""
    return torch.tanh(scores / cap).mul_(cap)
