"""Attention backends: all read the same AttentionBatch and the same paged K/V storage."""
from __future__ import annotations

import torch

from kvserve.attention.batch import AttentionBackend, AttentionBatch
from kvserve.attention.flash import FlashBackend
from kvserve.attention.native import NativeBackend
from kvserve.attention.sdpa import SdpaBackend
from kvserve.attention.textbook import TextbookBackend

BACKENDS = {"sdpa": SdpaBackend, "native": NativeBackend, "flash": FlashBackend, "textbook": TextbookBackend}


def get_backend(name: str, device: torch.device):
    """The backend called `name`; `auto` picks the fastest correct one for the device."""
    if name == "auto":
        # CPU: SDPA for prompts, the C kernel for decode (sdpa's decode where it cannot be built)
        name = "triton" if device.type == "cuda" else "native"
    if name == "triton":
        # Imported on demand: triton is not needed otherwise, and its kernels are decorated only
        # after a test has had the chance to set TRITON_INTERPRET.
        from kvserve.attention.triton import TritonBackend
        return TritonBackend()
    if name not in BACKENDS:
        raise ValueError(f"unknown attention_backend {name!r}; choose auto, triton, {', '.join(BACKENDS)}")
    return BACKENDS[name]()


__all__ = ["AttentionBackend", "AttentionBatch", "get_backend", "BACKENDS"]
