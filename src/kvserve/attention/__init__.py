"""Attention backends: all read the same AttentionBatch and the same paged K/V storage."""
from __future__ import annotations

import os

import torch

from kvserve.attention.batch import AttentionBackend, AttentionBatch
from kvserve.attention.flash import FlashBackend
from kvserve.attention.native import NativeBackend
from kvserve.attention.sdpa import SdpaBackend
from kvserve.attention.textbook import TextbookBackend

BACKENDS = {"sdpa": SdpaBackend, "native": NativeBackend, "flash": FlashBackend, "textbook": TextbookBackend}


def get_backend(name: str, device: torch.device):
    """The backend called `name`; `auto` picks the fastest correct one for the device. ValueError for one that
    cannot run here (triton off a GPU, unless under Triton's interpreter; triton not installed)."""
    if name == "auto":
        # CPU: SDPA for prompts, the C kernel for decode (sdpa's decode where it cannot be built)
        name = "triton" if device.type == "cuda" else "native"
    if name == "triton":
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"attention_backend 'triton' runs on a CUDA GPU, and this engine's device is "
                             f"{device.type}: use auto, native or sdpa")
        # Imported on demand: triton is not needed otherwise, and its kernels are decorated only
        # after a test has had the chance to set TRITON_INTERPRET.
        try:
            from kvserve.attention.triton import TritonBackend
        except ImportError as e:
            raise ValueError(f"attention_backend 'triton' needs the triton package ({e}): install it, or use "
                             f"attention_backend sdpa or flash") from None
        return TritonBackend()
    if name not in BACKENDS:
        raise ValueError(f"unknown attention_backend {name!r}; choose auto, triton, {', '.join(BACKENDS)}")
    return BACKENDS[name]()


__all__ = ["AttentionBackend", "AttentionBatch", "get_backend", "BACKENDS"]
