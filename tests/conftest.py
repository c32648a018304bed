"""Tiny random-weight checkpoints built from transformers configs, saved like real ones."""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

# Triton kernels run in Triton's interpreter on a machine without a GPU; the variable must be set
# before the kernels are first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tiny_models import HYBRID, make_checkpoint


def _kernels_run_here() -> bool:
    """A C compiler builds the kernels, and their build multiplies both compute dtypes (AVX-512 and its BF16
    extension): as the engine decides (kvserve.model.layers.gemm_packs), every fast path is then expected."""
    from kvserve.kernels import COMPUTE_DTYPES, library
    from kvserve.model.layers import gemm_packs

    return library() is not None and all(gemm_packs(dtype) for dtype in COMPUTE_DTYPES)


def _vector_kernel() -> str:
    """csrc/gemm.c's vector kernel as built here (avx512, or avx2 in a KVSERVE_MARCH=x86-64-v3 build)."""
    from kvserve.model.layers import gemm_kernels, vector_kernel

    return vector_kernel(gemm_kernels(torch.float32))


# The engines of the tests multiply by csrc/gemm.c's vector kernel wherever it runs, not by what a measurement
# on a busy machine picks from run to run; tests of the choice, and of AMX's kernel, set KVSERVE_GEMM themselves.
os.environ.setdefault("KVSERVE_GEMM", _vector_kernel())

# Where the kernels run, a fast path that falls back to torch's ops fails the test (kvserve.kernels.fallback);
# tests of the fallbacks turn it off for themselves. KVSERVE_STRICT_KERNELS=0 in the environment keeps it off.
if "KVSERVE_STRICT_KERNELS" not in os.environ and _kernels_run_here():
    os.environ["KVSERVE_STRICT_KERNELS"] = "1"


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Callable[..., Path]:
    """`checkpoint(arch, seed=0, dtype=torch.float32, **config_overrides)`: the path of a tiny random-weight
    checkpoint (tiny_models.make_checkpoint), built once per test process for each set of arguments and shared by
    every test that asks for the same one. Tests read it and never change it; a test that changes a checkpoint's
    files builds its own in its tmp_path."""
    made: dict[str, Path] = {}

    def build(arch: str = "llama", seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> Path:
        key = repr((arch, seed, dtype, sorted(overrides.items())))
        if key not in made:
            made[key] = make_checkpoint(tmp_path_factory.mktemp(arch), arch, seed, dtype, **overrides)
        return made[key]

    return build


@pytest.fixture(scope="session")
def tiny_llama(checkpoint):
    return checkpoint("llama")


@pytest.fixture(scope="session")
def gemma3(checkpoint):
    return checkpoint(**HYBRID["gemma3"])


@pytest.fixture(scope="session")
def gemma2(checkpoint):
    return checkpoint(**HYBRID["gemma2"])


@pytest.fixture(scope="session")
def mistral(checkpoint):
    return checkpoint(**HYBRID["mistral"])


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)   # tiny models gain nothing from threads, and a busy machine stalls them


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """A redis-server of the session (each xdist worker's own); tests that share it flush it first."""
    from redis_helper import start_redis

    server = start_redis(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()
