"""The `native` backend: decode by a C kernel (`csrc/paged_decode.c`) that reads the pages in place,
dequantizing as it reads. Where no C compiler works (see kvserve.kernels), it decodes as `sdpa` does.
Prefill is `sdpa`'s.
"""
from __future__ import annotations

import ctypes

import torch

from kvserve.attention.batch import AttentionBatch
from kvserve.attention.paged import SdpaBackend
from kvserve.kernels import function
from kvserve.kv.quant import Fp8PerBlock, Int4, Int8PerToken, QuantizedLayer

# row kinds, as the kernel numbers them
DTYPE_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
CODEC_KINDS = {Int8PerToken: 3, Fp8PerBlock: 4, Int4: 5}


def kernel():
    """The compiled paged_decode, or None where the kernels cannot be built here."""
    p, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    return function("paged_decode", (p, ctypes.c_int64, p, i, i, p, i, p, f, p, i, i, i, i, i, p, p, p, i, i, p))


def paged_decode(q: torch.Tensor, kv_cache: torch.Tensor | QuantizedLayer, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float) -> torch.Tensor | None:
    """Attention of one query per sequence, q [B, H, D], over its pages; None if the kernel is unavailable
    or does not read this cache."""
    fn = kernel()
    if fn is None or q.device.type != "cpu":
        return None
    _, kvh, nb, bs, d = kv_cache.shape
    if isinstance(kv_cache, QuantizedLayer):
        kind = CODEC_KINDS.get(type(kv_cache.k_codec))
        tensors = (kv_cache.pages, *kv_cache.meta, kv_cache.residual, kv_cache.residual_of)
        residual_kind = DTYPE_KINDS.get(kv_cache.residual.dtype)
        slots = kv_cache.residual.shape[2]
    else:
        kind, residual_kind, slots = DTYPE_KINDS.get(kv_cache.dtype), 0, 0
        tensors = (kv_cache,)            # no scales, no residual
    if kind is None or residual_kind is None or not all(t.is_contiguous() for t in tensors):
        return None
    # pages, K meta, V meta, residual, residual_of as addresses; None for those a cache lacks
    pages, k_meta, v_meta, residual, residual_of = [t.data_ptr() for t in tensors] + [None] * (5 - len(tensors))
    # float32 q is read where it is (a view of the step's qkv rows), with its heads adjacent
    qf = q if q.dtype == torch.float32 and q.stride(2) == 1 and q.stride(1) == d else q.float().contiguous()
    out = torch.empty(q.shape, dtype=torch.float32)
    tables = block_tables.to(torch.int64).contiguous()
    lens = context_lens.to(torch.int64).contiguous()
    fn(qf.data_ptr(), qf.stride(0), out.data_ptr(), q.shape[0], q.shape[1], tables.data_ptr(), tables.shape[1],
       lens.data_ptr(), scale, pages, kind, kvh, nb, bs, d, k_meta, v_meta, residual, residual_kind, slots,
       residual_of)
    return out.to(q.dtype)


class NativeBackend(SdpaBackend):
    """sdpa's prefill; decode by the C kernel over the pages (sdpa's decode where it cannot run)."""

    name = "native"

    def __init__(self):
        kernel()     # built (or found in the cache) as an engine starts, not inside its first step

    @staticmethod
    def _decode(q, kv_cache, batch: AttentionBatch, scale: float) -> torch.Tensor:
        nd = batch.num_decodes
        out = paged_decode(q, kv_cache, batch.block_tables[:nd], batch.context_lens[:nd], scale)
        return SdpaBackend._decode(q, kv_cache, batch, scale) if out is None else out
