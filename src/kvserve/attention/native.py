"""The `native` backend: attention by C kernels (`csrc/paged_decode.c`) that read the pages in place,
dequantizing as they read: one query per sequence for decode steps, and causal tiles of a prompt's
tokens for steps with prompts (the step's K/V are in the pages by then), within a layer's sliding window
and with its soft-capped scores where it has them. What they do not run goes to
the `sdpa` backend: a step with no cache, and, as a fallback (an error under KVSERVE_STRICT_KERNELS=1),
a cache they do not read or kernels that no C compiler could build (see kvserve.kernels).
"""
from __future__ import annotations

import itertools
from collections import Counter

import torch

from kvserve.attention.batch import AttentionBackend, AttentionBatch
from kvserve.attention.sdpa import SdpaBackend
from kvserve.attention.sparse import SparseDecode
from kvserve.kernels import COMPUTE_DTYPES, DTYPE_KINDS, fallback, function
from kvserve.kv.pages import LayerPages

# quantized page formats, as the kernel numbers them (full-precision ones: DTYPE_KINDS)
QUANTIZED_KINDS = {"int8": 3, "fp8": 4, "int4": 5}


def kernel():
    """The compiled paged_decode, or None where the kernels cannot be built here."""
    return function("paged_decode")


def prefill_kernel():
    """The compiled paged_prefill (paged_decode's arguments, and query starts), or None where the kernels
    cannot be built here."""
    return function("paged_prefill")


def page_kind(kv_cache: LayerPages) -> int | None:
    """The kernels' number of a layer's page format (None: one they do not read)."""
    fmt = kv_cache.format
    return QUANTIZED_KINDS.get(fmt.name) if fmt.quantized else DTYPE_KINDS.get(fmt.dtype)


def cache_args(kv_cache: LayerPages) -> tuple | None:
    """The cache as the kernels take it: pages, kind, KV heads, blocks, block size, head_dim, K meta, V meta, the
    keys' summaries and their kind (addresses; None for the scales a full-precision cache lacks, and for summaries
    it does not keep). None where the kernels do not read this cache."""
    _, kvh, nb, bs, d = kv_cache.shape
    kind, tensors = page_kind(kv_cache), kv_cache.tensors
    summaries = None if kv_cache.summaries is None else kv_cache.summaries.data
    if kind is None or not all(t.is_contiguous() for t in tensors) or (
            summaries is not None and (not summaries.is_contiguous() or summaries.dtype not in COMPUTE_DTYPES)):
        return None
    pages, k_meta, v_meta = [t.data_ptr() for t in tensors] + [None] * (3 - len(tensors))
    summary, summary_kind = (None, 0) if summaries is None else (summaries.data_ptr(), DTYPE_KINDS[summaries.dtype])
    return pages, kind, kvh, nb, bs, d, k_meta, v_meta, summary, summary_kind


def sparse_args(sparse: SparseDecode | None) -> tuple:
    """A layer's sparse attention as the kernels take it: its options, counts and record (addresses), or None for
    each."""
    if sparse is None:
        return None, None, None
    record = sparse.layer_record()
    return sparse.params.data_ptr(), sparse.counts.data_ptr(), None if record is None else record.data_ptr()


def _attend(name: str, fn, q: torch.Tensor, kv_cache, block_tables: torch.Tensor, context_lens: torch.Tensor,
            scale: float, window: int | None, cap: float | None, sparse: SparseDecode | None,
            *extra) -> torch.Tensor | None:
    """out [T, H, D] of kernel fn (called `name`) over the pages, the decodes under `sparse` attention where given;
    None (a fallback: see kvserve.kernels) if it is unavailable or does not read this cache. float32 or bfloat16 q
    is read where it is (a view of the step's qkv rows), if its heads are adjacent, and out is of its dtype;
    float16 goes through float32."""
    if q.device.type != "cpu":
        return None
    cache = cache_args(kv_cache) if fn is not None else None
    if cache is None:
        fallback(name, "the kernels are not built" if fn is None else
                 f"it does not read this cache ({kv_cache.format.name} pages, or not contiguous)")
        return None
    d, dtype = q.shape[-1], q.dtype
    if q.dtype not in COMPUTE_DTYPES or q.stride(2) != 1 or q.stride(1) != d:
        q = q.float().contiguous()
    out = torch.empty(q.shape, dtype=q.dtype)
    tables = block_tables.to(torch.int64).contiguous()
    lens = context_lens.to(torch.int64).contiguous()
    fn(q.data_ptr(), DTYPE_KINDS[q.dtype], q.stride(0), out.data_ptr(), len(lens), q.shape[1], tables.data_ptr(),
       tables.shape[1], lens.data_ptr(), scale, *cache, window or 0, cap or 0.0, *sparse_args(sparse), *extra)
    return out.to(dtype)


def paged_decode(q: torch.Tensor, kv_cache: LayerPages, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, sliding_window: int | None = None,
                 logits_soft_cap: float | None = None, sparse: SparseDecode | None = None) -> torch.Tensor | None:
    """Attention of one query per sequence, q [B, H, D], over its pages (AttentionBackend.forward's window and
    soft cap), under sparse attention where `sparse` (a layer's SparseDecode) says; None if the kernel is
    unavailable or does not read this cache."""
    return _attend("paged_decode", kernel(), q, kv_cache, block_tables, context_lens, scale, sliding_window,
                   logits_soft_cap, sparse)


def paged_prefill(q: torch.Tensor, kv_cache: LayerPages, block_tables: torch.Tensor,
                  context_lens: torch.Tensor, query_starts: torch.Tensor, scale: float,
                  sliding_window: int | None = None, logits_soft_cap: float | None = None,
                  sparse: SparseDecode | None = None) -> torch.Tensor | None:
    """Causal attention of every query token, q [T, H, D] (tokens [query_starts[s], query_starts[s + 1])
    of sequence s, the last of its context_lens[s] cached ones), over its sequence's pages (AttentionBackend.
    forward's window and soft cap), the decodes under sparse attention where `sparse` says; None if the kernel is
    unavailable or does not read this cache."""
    return _attend("paged_prefill", prefill_kernel(), q, kv_cache, block_tables, context_lens, scale,
                   sliding_window, logits_soft_cap, sparse, query_starts.data_ptr())


def query_starts(batch: AttentionBatch) -> torch.Tensor:
    """Each sequence's first flat token, and the total (int64): derived once per step, shared by layers."""
    starts = batch.scratch.get("query_starts")
    if starts is None:
        starts = batch.scratch["query_starts"] = torch.tensor([0, *itertools.accumulate(batch.query_lens)],
                                                              dtype=torch.int64)
    return starts


class NativeBackend(AttentionBackend):
    """Decode and prefill by the C kernels, reading the pages in place; `calls` counts the kernels' calls (a call
    per layer of a step), by name.

    What the kernels do not run goes to the `sdpa` backend it holds: a step with no cache (cache_mode none:
    the kernels read pages, and there are none), and, through kvserve.kernels' fallback (an error under
    KVSERVE_STRICT_KERNELS=1), a cache or query they do not read or kernels that could not be built."""

    name = "native"
    supports_sparse = True

    def __init__(self):
        kernel()     # built (or found in the cache) as an engine starts, not inside its first step
        self.calls: Counter[str] = Counter()
        self.sdpa = SdpaBackend()

    def forward(self, q, k, v, kv_cache, batch: AttentionBatch, scale: float, sliding_window: int | None = None,
                logits_soft_cap: float | None = None) -> torch.Tensor:
        """A step with prompts by paged_prefill (its decodes too, as one-token queries), one of decodes only by
        paged_decode, the decodes under the batch's sparse attention; the rest by sdpa."""
        limits = (sliding_window, logits_soft_cap)
        if kv_cache is None:
            return self.sdpa.forward(q, k, v, kv_cache, batch, scale, *limits)
        if batch.num_prefills:
            name = "paged_prefill"
            out = paged_prefill(q, kv_cache, batch.block_tables, batch.context_lens, query_starts(batch), scale,
                                *limits, batch.sparse)
        else:
            name = "paged_decode"
            out = paged_decode(q, kv_cache, batch.block_tables, batch.context_lens, scale, *limits, batch.sparse)
        if out is None:          # the kernel did not run: _attend has called fallback(...), saying why
            return self.sdpa.forward(q, k, v, kv_cache, batch, scale, *limits)
        self.calls[name] += 1
        return out
