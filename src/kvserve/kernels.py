"""The project's C kernels (`csrc/`): compiled into one library with the machine's C compiler the
first time an engine needs them (with OpenMP, for this CPU or the target $KVSERVE_MARCH names: see march) and
cached under ~/.cache/kvserve (or $KVSERVE_CACHE), else the temporary directory.

Every kernel's C signature is declared once, in SIGNATURES; the structs the decode step takes are defined
once, in csrc/decode_step.h, whose ctypes structures c_structs builds from the header, check_layout checks
against the library's layout and fill fills by field name. Where a kernel cannot run, its caller falls back
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
import re
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)
CSRC = Path(__file__).resolve().parent / "csrc"
# the dtypes of the numbers the kernels take, as csrc/common.h numbers them; they compute in the first two
DTYPE_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
COMPUTE_DTYPES = (torch.float32, torch.bfloat16)
FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC")
STRICT_ENV = "KVSERVE_STRICT_KERNELS"
MARCH_ENV = "KVSERVE_MARCH"


class Status(ctypes.c_int):
    """The result of a kernel that allocates memory: 0, or -1 where an allocation failed (see _check)."""


_P, _I, _I64, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
# a paged cache (csrc/paged_decode.c): pages, kind, KV heads, blocks, block size, head_dim, K meta, V meta, the
# keys' summaries and their kind
_CACHE = (_P, _I, _I, _I, _I, _I, _P, _P, _P, _I)
# name -> (argument types, result type) of each kernel; pointers (structs by ctypes.byref too) as void *
SIGNATURES: dict[str, tuple[tuple, type | None]] = {
    # csrc/paged_decode.c: q, q kind, q stride, out, sequences, heads, block tables, their width, context lens,
    # scale, the cache, sliding window (0: none), soft cap (0: none), sparse attention's options, counts and record
    # (NULL: none) (and for prefill, query starts)
    "paged_decode": ((_P, _I, _I64, _P, _I, _I, _P, _I, _P, _F, *_CACHE, _I64, _F, _P, _P, _P), Status),
    "paged_prefill": ((_P, _I, _I64, _P, _I, _I, _P, _I, _P, _F, *_CACHE, _I64, _F, _P, _P, _P, _P), Status),
    # whether a task of (kind, head_dim, query heads of a KV head, tokens) runs with its keys in vector lanes
    "keys_in_lanes": ((_I, _I, _I, _I), _I),
    # csrc/decode_step.c: model, n, (steps,) input ids, positions, (groups,) (each group's slots,) each group's
    # block tables, their widths, context lens, cos, sin, the sliding layers' cos, sin, sparse attention's options,
    # counts, record and its width, logits, (tokens,) threads
    "decode_step": ((_P, _I, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _I, _P, _I), Status),
    "decode_steps": ((_P, _I, _I, _P, _P, _I, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _I, _P, _P, _I), Status),
    "linear_rows": ((_P, _I, _P, _I, _I, _I, _P, _I), None),
    "struct_layout": ((_I, *[ctypes.POINTER(ctypes.c_char_p)] * 3), _I64),
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


# C's scalar types the structs of csrc/decode_step.h hold, as ctypes types
_C_SCALARS = {"int": ctypes.c_int, "int64_t": ctypes.c_int64, "float": ctypes.c_float}


def _declaration(text: str, types: dict[str, type]) -> tuple[str, type, list[str]]:
    """One C declaration ("const void *w, *b", "int64_t count", "int"): its C type as struct_layout names it
    ("const void *"), as a ctypes type, and the names it declares (all of one type: ValueError otherwise, and for
    a type the header's structs cannot hold)."""
    m = re.fullmatch(r"\s*((?:const\s+)?\w+)\s*(.*?)\s*", text, re.DOTALL)
    declarators = [re.fullmatch(r"(\**)\s*(\w*)", d.strip()) for d in m[2].split(",")] if m else [None]
    if m is None or None in declarators or len({d[1] for d in declarators}) != 1:
        raise ValueError(f"a declaration that kvserve.kernels.c_structs does not read: {text.strip()!r}")
    base, stars = " ".join(m[1].split()), declarators[0][1]
    bare = base.removeprefix("const ")
    if not stars and (bare in _C_SCALARS or bare in types):
        ctype = _C_SCALARS.get(bare) or types[bare]
    elif stars == "*" and isinstance(types.get(bare), type) and issubclass(types[bare], ctypes.Structure):
        ctype = ctypes.POINTER(types[bare])
    elif stars == "*" and (bare == "void" or bare in _C_SCALARS):
        ctype = ctypes.c_void_p
    else:
        raise ValueError(f"a type that kvserve.kernels.c_structs does not read: {base} {stars}")
    return f"{base} {stars}" if stars else base, ctype, [d[2] for d in declarators]


def c_structs(header: str) -> dict[str, type]:
    """The typedefs of a header of the kernels (its text) as ctypes types, by name: each struct a ctypes.Structure
    of the struct's fields in order (and `c_types`, each field's C type as struct_layout names it), each function
    pointer type a CFUNCTYPE. ValueError for anything else the header declares at its top level."""
    text = re.sub(r"/\*.*?\*/|//[^\n]*|#[^\n]*", " ", header, flags=re.DOTALL)
    typedef = re.compile(r"\s*typedef\s+(?:struct\s*\{(?P<body>[^}]*)\}\s*(?P<name>\w+)"
                         r"|(?P<result>\w+)\s*\(\s*\*\s*(?P<fn>\w+)\s*\)\s*\((?P<params>[^)]*)\))\s*;", re.DOTALL)
    types: dict[str, type] = {}
    at = 0
    while text[at:].strip():
        m = typedef.match(text, at)
        if m is None:
            raise ValueError(f"kvserve.kernels.c_structs reads typedefs of structs and function pointers only: "
                             f"{text[at:].strip()[:60]!r}")
        if m["name"]:
            fields = [(name, c_type, ctype) for decl in m["body"].split(";") if decl.strip()
                      for c_type, ctype, names in [_declaration(decl, types)] for name in names]
            types[m["name"]] = type(m["name"], (ctypes.Structure,), {
                "_fields_": [(name, ctype) for name, _, ctype in fields], "c_types": [c for _, c, _ in fields]})
        else:
            params = [_declaration(p, types)[1] for p in m["params"].split(",")]
            types[m["fn"]] = ctypes.CFUNCTYPE(_declaration(m["result"], types)[1], *params)
        at = m.end()
    return types


def c_layout(lib: ctypes.CDLL) -> dict[str, list[tuple[str, str, int]]]:
    """The structs csrc/decode_step.c takes, as it compiled them: struct -> [("", "", size), then (field, C type,
    offset) of each field in order]."""
    fn, layout = typed(lib, "struct_layout"), {}
    struct, field, c_type = ctypes.c_char_p(), ctypes.c_char_p(), ctypes.c_char_p()
    i = 0
    while (at := fn(i, ctypes.byref(struct), ctypes.byref(field), ctypes.byref(c_type))) >= 0:
        layout.setdefault(struct.value.decode(), []).append((field.value.decode(), c_type.value.decode(), at))
        i += 1
    return layout


def check_layout(lib: ctypes.CDLL, structure: type[ctypes.Structure]) -> None:
    """Raise RuntimeError unless the ctypes structure (c_structs') is the library's struct of its name: its size,
    and the same fields in the same order, of the same C types at the same offsets (a field added, moved or
    retyped on one side only would pass the C code garbage)."""
    want = c_layout(lib).get(structure.__name__, [])
    have = [("", "", ctypes.sizeof(structure)),
            *((name, c_type, getattr(structure, name).offset)
              for (name, _), c_type in zip(structure._fields_, structure.c_types))]
    if want != have:
        first = next(i for i, (a, b) in enumerate(zip([*have, None], [*want, None])) if a != b)
        raise RuntimeError(f"ctypes structure {structure.__name__} does not match the C struct of the library: "
                           f"entry {first} (field, C type, offset; the first: size) is {have[first:first + 1]} in "
                           f"Python, {want[first:first + 1]} in C")


def fill(structure: type[ctypes.Structure], values: Mapping[str, object]) -> ctypes.Structure:
    """The structure with every field set by name from values: a field of a struct type from a mapping, a pointer
    to structs from a list of mappings (an array of them, which the structure keeps alive), each filled alike.
    ValueError naming each field that values leaves unset, or that the structure has not."""
    types = dict(structure._fields_)
    missing, unknown = [n for n in types if n not in values], [n for n in values if n not in types]
    if missing or unknown:
        parts = (("unset:", missing), ("not its fields:", unknown))
        raise ValueError(f"{structure.__name__}: " + "; ".join(f"{what} {', '.join(names)}" for what, names in parts
                                                                if names))
    filled = {}
    for name, value in values.items():
        ctype = types[name]
        if isinstance(value, Mapping):
            value = fill(ctype, value)
        elif isinstance(value, list):
            item = ctype._type_
            value = (item * len(value))(*(fill(item, v) for v in value))
        filled[name] = value
    return structure(**filled)


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


def march() -> str:
    """The instruction set the kernels are built for: $KVSERVE_MARCH as the compiler's -march takes it (x86-64-v3:
    AVX2 and FMA, for CPUs without AVX-512; on ARM64, e.g. armv8.2-a), or native (the default): every instruction
    this CPU has. ValueError
    for a name that is not one word of letters, digits, '-', '_', '.' or '+'."""
    target = os.environ.get(MARCH_ENV) or "native"
    if not re.fullmatch(r"[\w.+-]+", target):
        raise ValueError(f"{MARCH_ENV} must name a target as the C compiler's -march takes it, got {target!r}")
    return target


def compile_flags() -> tuple[str, ...]:
    """The compiler's flags of a build: FLAGS and the target (march)."""
    return (*FLAGS, f"-march={march()}")


def build_key() -> str:
    """What names a build of the kernels: their sources, the compiler and its flags (the target among them), and
    this CPU."""
    cc = os.environ.get("CC", "cc")
    code = b"".join(p.read_bytes() for p in sorted(CSRC.glob("*.[ch]")))
    return hashlib.sha256(code + " ".join((cc, *compile_flags())).encode() + _cpu_signature()).hexdigest()[:16]


def build() -> Path:
    """The shared library, compiled unless a build of these sources for this CPU and target is cached."""
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
            subprocess.run([cc, *compile_flags(), *map(str, sorted(CSRC.glob("*.c"))), "-o", str(tmp / name), "-lm"],
                           check=True, capture_output=True, timeout=120)
            os.replace(tmp / name, d / name)      # atomic: a concurrent build finds a whole library
            return d / name
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    raise OSError(f"no writable directory for the kernels among {', '.join(map(str, dirs))}")
