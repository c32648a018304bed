"""What the Triton tests share: the interpreter on machines without CUDA, the device, tolerances, tiles.

TRITON_INTERPRET must be set before the kernels are decorated, i.e. before kvserve.attention.triton
is first imported; a test module imports this first. Without triton installed, it skips the module.
"""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from kvserve.attention.triton import kernels  # noqa: E402  (after TRITON_INTERPRET)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

if DEVICE.type == "cpu" and not kernels._INTERPRETED:
    pytest.skip("kvserve.attention.triton was imported before TRITON_INTERPRET=1 was set",
                allow_module_level=True)

TOL = {torch.float32: {"atol": 2e-5, "rtol": 1e-5},
       torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
       torch.float16: {"atol": 3e-3, "rtol": 3e-3}}
# small tiles, so that short sequences span several query tiles, key tiles, pages and partitions
SMALL_TILES = {"prefill_block_m": 16, "prefill_block_n": 16, "decode_block_n": 16, "partition_size": 32}


def compile_for_hopper(script: str) -> None:
    """Run `script` (which compiles kernels for an sm_90 target and prints "compiled") in a process without the
    interpreter; skips where Triton's NVIDIA backend (ptxas) is not installed."""
    import triton

    ptxas = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("Triton's NVIDIA backend (ptxas) is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300,
                            check=False)
    assert result.returncode == 0 and "compiled" in result.stdout, result.stderr[-3000:]
