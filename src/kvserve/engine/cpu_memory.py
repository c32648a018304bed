"""Keep freed activation memory in the process on the CPU, instead of re-faulting it every step."""
from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def reuse_freed_memory() -> bool:
    """Tell glibc's malloc to serve large tensors from its heap and not hand freed memory back.

    By default every allocation over 32 MiB is a fresh mmap, so each prefill pays page faults on
    its large activations (measured here: 12 ms to allocate and fill 46 MB, 0.8 ms reused; 1.55 s
    -> 1.10 s for a 64 x 128-token prefill). The setting is process-wide, as with the
    tcmalloc/jemalloc preloads that CPU inference guides recommend. Returns False where not glibc.
    """
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        ok = libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1
    except (OSError, AttributeError, TypeError):
        ok = False
    if not ok:
        log.debug("mallopt unavailable: large CPU tensors keep the default allocator behaviour")
    return ok
