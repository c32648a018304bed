"""Attention backends: all read the same AttentionBatch and the same paged K/V storage."""
from __future__ import annotations

import torch

from kvserve.attention.batch import AttentionBatch
from kvserve.attention.flash import FlashBackend
from kvserve.attention.paged import SdpaBackend
from kvserve.attention.textbook import TextbookBackend

BACKENDS = {"sdpa": SdpaBackend, "flash": FlashBackend, "textbook": TextbookBackend}


def get_backend(name: str, device: torch.device):
    """The backend called `name`; `auto` picks the fastest correct one for the device."""
    if name == "auto":
        name = "sdpa"
    if name not in BACKENDS:
        raise ValueError(f"unknown attention_backend {name!r}; choose auto, {', '.join(BACKENDS)}")
    return BACKENDS[name]()


__all__ = ["AttentionBatch", "get_backend", "BACKENDS"]
