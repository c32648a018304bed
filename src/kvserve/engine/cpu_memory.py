"""CPU memory: freed activations kept in the process; weights on huge pages, each its own mapping."""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import mmap

import torch

log = logging.getLogger(__name__)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
HUGE_PAGE = 2 * 2**20


def reuse_freed_memory() -> bool:
    """Tell glibc's malloc to serve large tensors from its heap and not hand freed memory back.

    By default every allocation over 32 MiB is a fresh mmap, so each prefill pays page faults on
    its large activations, step after step; memory the heap keeps is reused without them. The setting
    is process-wide, as with the tcmalloc/jemalloc preloads that CPU inference guides recommend, so
    only the `kvserve` command (or EngineConfig.cpu_allocator_tuning) asks for it. Returns False where
    not glibc.
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


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """nbytes of zeroed memory (uint8), from a 2 MiB boundary, that the kernel may back with
    transparent huge pages (asked for by madvise, the mode most systems default to).

    Streaming reads run faster on huge pages: fewer TLB misses, and the hardware prefetcher does not
    stop at every 4 KiB boundary. Where the kernel refuses, the memory is ordinary pages.
    """
    if not hasattr(mmap, "MAP_PRIVATE"):     # not a POSIX system
        return torch.zeros(nbytes, dtype=torch.uint8)
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):        # not Linux, or THP unavailable
        log.debug("no transparent huge pages here")
    buffer = torch.frombuffer(mapping, dtype=torch.uint8)   # holds the mapping
    start = -buffer.data_ptr() % HUGE_PAGE
    return buffer[start:start + nbytes]


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros, on huge pages on the CPU: the paged KV cache, which decode attention reads in
    blocks of a few KiB scattered across it: each block a TLB miss on small pages."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    return huge_page_buffer(math.prod(shape) * dtype.itemsize).view(dtype).view(shape)


def cpu_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor for a weight: a mapping of its own (on huge pages, zeroed) from a huge
    page up, else torch.empty. Freeing it unmaps it: memory that glibc's heap would keep
    (reuse_freed_memory) after a weight is loaded, packed and dropped goes back to the system."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_PAGE:
        return torch.empty(shape, dtype=dtype)
    return huge_page_buffer(nbytes).view(dtype).view(shape)
