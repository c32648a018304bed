"""Tiny random-weight checkpoints built from transformers configs, saved like real ones."""
from __future__ import annotations

import os

import pytest
import torch

# Triton kernels run in Triton's interpreter on a machine without a GPU; the variable must be set
# before the kernels are first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tiny_models import make_checkpoint


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)   # tiny models gain nothing from threads, and a busy machine stalls them
