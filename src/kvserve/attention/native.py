"""The `native` backend: decode by a C kernel that reads the pages in place, dequantizing as it reads.

`csrc/paged_decode.c` is compiled with the machine's C compiler when the backend is first made
(for this CPU, with OpenMP) and cached under ~/.cache/kvserve (or $KVSERVE_CACHE). Where no
compiler works, the backend decodes as `sdpa` does. Prefill is `sdpa`'s.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

from kvserve.attention.batch import AttentionBatch
from kvserve.attention.paged import SdpaBackend
from kvserve.kv.quant import Fp8PerBlock, Int4, Int8PerToken, QuantizedLayer

log = logging.getLogger(__name__)
SOURCE = Path(__file__).resolve().parent / "csrc" / "paged_decode.c"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
# row kinds, as the kernel numbers them
DTYPE_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
CODEC_KINDS = {Int8PerToken: 3, Fp8PerBlock: 4, Int4: 5}


def _cpu_signature() -> bytes:
    """What -march=native depends on, so that a cache shared between machines never mixes them."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return b""
    keys = ("model name", "flags", "Features", "CPU implementer", "CPU part")     # x86, then arm
    return (platform.machine() + "".join(sorted({line for line in lines if line.startswith(keys)}))).encode()


@lru_cache(maxsize=None)
def kernel():
    """The compiled paged_decode, or None where it cannot be built here."""
    try:
        fn = ctypes.CDLL(str(_build())).paged_decode
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:    # RuntimeError: no home directory
        detail = getattr(e, "stderr", None)
        log.warning("native attention kernel unavailable (%s%s); decoding as sdpa does", e,
                    f": {detail.decode(errors='replace').strip()}" if detail else "")
        return None
    p, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    fn.argtypes = [p, p, i, i, p, i, p, f, p, i, i, i, i, i, p, p, p, i, i, p]
    fn.restype = None
    return fn


def _build() -> Path:
    """The shared library, compiled unless a build of this source for this CPU is cached (in
    $KVSERVE_CACHE or ~/.cache/kvserve, else the temporary directory)."""
    cc = os.environ.get("CC", "cc")
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join((cc, *FLAGS)).encode() + _cpu_signature()).hexdigest()[:16]
    name = f"paged_decode-{key}.so"
    dirs = [Path(os.environ.get("KVSERVE_CACHE") or Path.home() / ".cache" / "kvserve") / "kernels",
            Path(tempfile.gettempdir()) / "kvserve" / "kernels"]
    cached = next((d / name for d in dirs if (d / name).exists()), None)
    if cached is not None:
        return cached
    for d in dirs:
        try:
            d.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(dir=d))
        except OSError:
            continue                    # not writable: the next place
        try:
            subprocess.run([cc, *FLAGS, str(SOURCE), "-o", str(tmp / name), "-lm"], check=True, capture_output=True,
                           timeout=120)
            os.replace(tmp / name, d / name)      # atomic: a concurrent build finds a whole library
            return d / name
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    raise OSError(f"no writable directory for the kernel among {', '.join(map(str, dirs))}")


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
    qf = q.float().contiguous()
    out = torch.empty_like(qf)
    tables = block_tables.to(torch.int64).contiguous()
    lens = context_lens.to(torch.int64).contiguous()
    fn(qf.data_ptr(), out.data_ptr(), qf.shape[0], qf.shape[1], tables.data_ptr(), tables.shape[1], lens.data_ptr(),
       scale, pages, kind, kvh, nb, bs, d, k_meta, v_meta, residual, residual_kind, slots, residual_of)
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
