"""The project's C kernels (`csrc/`): compiled into one library with the machine's C compiler the
first time an engine needs them (for this CPU, with OpenMP) and cached under ~/.cache/kvserve (or
$KVSERVE_CACHE), else the temporary directory.

Every kernel's C signature is declared once, in SIGNATURES; the structs the decode step takes are
checked against their ctypes copies by check_layout. Where a kernel cannot run, its caller falls back
to torch's ops and says so through `fallback`, which raises instead under KVSERVE_STRICT_KERNELS=1:
the mode in which the tests run where the CPU has what the kernels need, so that a test of a fast path
cannot pass by its fallback.
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

log = logging.getLogger(__name__)
CSRC = Path(__file__).resolve().parent / "csrc"
# the dtypes of the numbers the kernels take, as csrc/common.h numbers them; they compute in the first two
DTYPE_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
COMPUTE_DTYPES = (torch.float32, torch.bfloat16)
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
STRICT_ENV = "KVSERVE_STRICT_KERNELS"


class Status(ctypes.c_int):
    """The result of a kernel that allocates memory: 0, or -1 where an allocation failed (see _check)."""


_P, _I, _I64, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
# a paged cache (csrc/paged_decode.c): pages, kind, KV heads, blocks, block size, head_dim, K meta, V meta
_CACHE = (_P, _I, _I, _I, _I, _I, _P, _P)
# name -> (argument types, result type) of each kernel; pointers (structs by ctypes.byref too) as void *
SIGNATURES: dict[str, tuple[tuple, type | None]] = {
    # csrc/paged_decode.c: q, q kind, q stride, out, sequences, heads, block tables, their width, context lens,
    # scale, the cache, sliding window (0: none), soft cap (0: none) (and for prefill, query starts)
    "paged_decode": ((_P, _I, _I64, _P, _I, _I, _P, _I, _P, _F, *_CACHE, _I64, _F), Status),
    "paged_prefill": ((_P, _I, _I64, _P, _I, _I, _P, _I, _P, _F, *_CACHE, _I64, _F, _P), Status),
    # whether a task of (kind, head_dim, query heads of a KV head, tokens) runs with its keys in vector lanes
    "keys_in_lanes": ((_I, _I, _I, _I), _I),
    # csrc/decode_step.c: model, n, (steps,) input ids, positions, (groups,) (each group's slots,) each group's
    # block tables, their widths, context lens, cos, sin, the sliding layers' cos, sin, logits, (tokens,) threads
    "decode_step": ((_P, _I, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _I), Status),
    "decode_steps": ((_P, _I, _I, _P, _P, _I, _P, _P, _P, _P, _P, _P, _P, _P, _P, _I), Status),
    "linear_rows": ((_P, _I, _P, _I, _I, _I, _P, _I), None),
    "struct_layout": ((_I, ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_char_p)), _I64),
    # csrc/gemm.c
    "gemm_dtypes": ((), _I),
    # (kind: of the weight's numbers, the dtype's, int8 or int4; dtype: the products')
    "gemm_packed_size": ((_I, _I, _I, _I, _I), _I64),
    "gemm_pack": ((_P, _I, _I, _I, _I, _I, _P), None),
    # int4's scales and minimums: dtype, n, k, gated; scales, mins, dtype, n, k, gated, out
    "gemm_groups_size": ((_I, _I, _I, _I), _I64),
    "gemm_pack_groups": ((_P, _P, _I, _I, _I, _I, _P), None),
    "gemm_kernels": ((), _I),
    # packed, scales, kind, bias, dtype, x, ldx, m, k, n, y, gated, kernel, threads
    "gemm": ((_P, _P, _I, _P, _I, _P, _I64, _I, _I, _I, _P, _I, _I, _I), None),
    # packed, scales, kind, dtype, k, ids, count, out, threads
    "gemm_rows": ((_P, _P, _I, _I, _I, _P, _I, _P, _I), None),
    # csrc/layer_ops.c
    "add_rms_norm": ((_P, _P, _P, _P, _I, _I, _F, _I, _I), Status),
    "rope": ((_P, _I64, _I, _I, _I, _P, _P, _I, _I), None),
    "store_kv": ((_P, _I64, _I, _I, _I, _P, _P, _I64, _I, _I), None),
    # csrc/sampling.c
    "argmax_rows": ((_P, _I, _I, _I64, _I, _P, _I), None),
}


def strict() -> bool:
    """Whether a fast path that cannot run raises rather than falls back (KVSERVE_STRICT_KERNELS=1)."""
    return os.environ.get(STRICT_ENV, "") not in ("", "0")


def fallback(kernel: str, why: str) -> None:
    """Called where `kernel` was to run and a slower path runs instead (why): under KVSERVE_STRICT_KERNELS=1,
    a RuntimeError naming both."""
    if strict():
        raise RuntimeError(f"{kernel} did not run: {why} ({STRICT_ENV}=1 makes this an error, not a fallback to "
                           f"torch's ops)")


@lru_cache(maxsize=None)
def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None where they cannot be built here (the warning says why; under
    KVSERVE_STRICT_KERNELS=1, a RuntimeError)."""
    try:
        return ctypes.CDLL(str(build()))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:    # RuntimeError: no home directory
        detail = getattr(e, "stderr", None)
        why = f"{e}: {detail.decode(errors='replace').strip()}" if detail else str(e)
        fallback("the native kernels (csrc/)", f"they cannot be built: {why}")
        log.warning("native kernels unavailable (%s); the CPU runs torch's ops instead", why)
        return None


def function(name: str) -> ctypes._CFuncPtr | None:
    """The library's kernel `name`, typed as SIGNATURES declares it, or None where the kernels cannot be built."""
    lib = library()
    return None if lib is None else typed(lib, name)


@lru_cache(maxsize=None)
def typed(lib: ctypes.CDLL, name: str) -> ctypes._CFuncPtr:
    """Kernel `name` of lib (the library, or a build of its sources with other flags), typed as SIGNATURES
    declares it; one that returns a status raises MemoryError where it reports a failed allocation."""
    argtypes, restype = SIGNATURES[name]
    fn = getattr(lib, name)
    fn.argtypes, fn.restype = list(argtypes), restype
    if restype is Status:
        fn.errcheck = _check
    return fn


def _check(status: Status, fn: ctypes._CFuncPtr, args: tuple) -> int:
    if status.value:
        raise MemoryError(f"{fn.__name__}: out of memory (an allocation in the C kernel failed)")
    return status.value


def c_layout(lib: ctypes.CDLL) -> dict[str, dict[str, int]]:
    """The structs csrc/decode_step.c takes, as it compiled them: struct -> {field: offset, "": size}."""
    fn, layout = typed(lib, "struct_layout"), {}
    struct, field = ctypes.c_char_p(), ctypes.c_char_p()
    i = 0
    while (at := fn(i, ctypes.byref(struct), ctypes.byref(field))) >= 0:
        layout.setdefault(struct.value.decode(), {})[field.value.decode()] = at
        i += 1
    return layout


def check_layout(lib: ctypes.CDLL, structure: type[ctypes.Structure], c_name: str) -> None:
    """Raise RuntimeError unless the ctypes structure is C's struct `c_name`: its size, and the same fields
    at the same offsets (a field added, moved or retyped on one side only would pass the C code garbage)."""
    want = c_layout(lib).get(c_name)
    have = {"": ctypes.sizeof(structure), **{name: getattr(structure, name).offset for name, *_ in structure._fields_}}
    if want != have:
        raise RuntimeError(f"ctypes structure {structure.__name__} does not match the C struct {c_name}: "
                           f"{have} against {want} (field: offset; '': size)")


def _cpu_signature() -> bytes:
    """What -march=native depends on, so that a cache shared between machines never mixes them."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return b""
    keys = ("model name", "flags", "Features", "CPU implementer", "CPU part")     # x86, then arm
    return (platform.machine() + "".join(sorted({line for line in lines if line.startswith(keys)}))).encode()


def cache_dirs(what: str) -> list[Path]:
    """Where kvserve caches `what` (a subdirectory): under $KVSERVE_CACHE or ~/.cache/kvserve, else (not
    writable) under the temporary directory."""
    return [Path(os.environ.get("KVSERVE_CACHE") or Path.home() / ".cache" / "kvserve") / what,
            Path(tempfile.gettempdir()) / "kvserve" / what]


def build_key() -> str:
    """What names a build of the kernels: their sources, the compiler and its flags, and this CPU."""
    cc = os.environ.get("CC", "cc")
    code = b"".join(p.read_bytes() for p in sorted(CSRC.glob("*.[ch]")))
    return hashlib.sha256(code + " ".join((cc, *FLAGS)).encode() + _cpu_signature()).hexdigest()[:16]


def build() -> Path:
    """The shared library, compiled unless a build of these sources for this CPU is cached."""
    cc = os.environ.get("CC", "cc")
    name = f"kvserve-{build_key()}.so"
    dirs = cache_dirs("kernels")
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
            subprocess.run([cc, *FLAGS, *map(str, sorted(CSRC.glob("*.c"))), "-o", str(tmp / name), "-lm"], check=True,
                           capture_output=True, timeout=120)
            os.replace(tmp / name, d / name)      # atomic: a concurrent build finds a whole library
            return d / name
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    raise OSError(f"no writable directory for the kernels among {', '.join(map(str, dirs))}")
