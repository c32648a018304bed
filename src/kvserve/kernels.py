"""The project's C kernels (`csrc/`): compiled into one library with the machine's C compiler the
first time an engine needs them (for this CPU, with OpenMP) and cached under ~/.cache/kvserve (or
$KVSERVE_CACHE), else the temporary directory."""
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


@lru_cache(maxsize=None)
def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None where they cannot be built here (the warning says why)."""
    try:
        return ctypes.CDLL(str(build()))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:    # RuntimeError: no home directory
        detail = getattr(e, "stderr", None)
        log.warning("native kernels unavailable (%s%s); the CPU runs torch's ops instead", e,
                    f": {detail.decode(errors='replace').strip()}" if detail else "")
        return None


@lru_cache(maxsize=None)
def function(name: str, argtypes: tuple) -> ctypes._CFuncPtr | None:
    """The library's function `name`, typed (returning nothing), or None where the kernels cannot be built."""
    lib = library()
    if lib is None:
        return None
    fn = getattr(lib, name)
    fn.argtypes, fn.restype = list(argtypes), None
    return fn


def _cpu_signature() -> bytes:
    """What -march=native depends on, so that a cache shared between machines never mixes them."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return b""
    keys = ("model name", "flags", "Features", "CPU implementer", "CPU part")     # x86, then arm
    return (platform.machine() + "".join(sorted({line for line in lines if line.startswith(keys)}))).encode()


def build() -> Path:
    """The shared library, compiled unless a build of these sources for this CPU is cached."""
    cc = os.environ.get("CC", "cc")
    code = b"".join(p.read_bytes() for p in sorted(CSRC.glob("*.[ch]")))
    key = hashlib.sha256(code + " ".join((cc, *FLAGS)).encode() + _cpu_signature()).hexdigest()[:16]
    name = f"kvserve-{key}.so"
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
            subprocess.run([cc, *FLAGS, *map(str, sorted(CSRC.glob("*.c"))), "-o", str(tmp / name), "-lm"], check=True,
                           capture_output=True, timeout=120)
            os.replace(tmp / name, d / name)      # atomic: a concurrent build finds a whole library
            return d / name
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    raise OSError(f"no writable directory for the kernels among {', '.join(map(str, dirs))}")
