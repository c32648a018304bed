"""Tiny random-weight checkpoints built from transformers configs, saved like real ones."""
from __future__ import annotations

import pytest
import torch

from tiny_models import make_checkpoint


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)   # tiny models gain nothing from threads, and a busy machine stalls them
