"""The kernels built for x86-64-v3 (AVX2, FMA, F16C: KVSERVE_MARCH=x86-64-v3), as for a CPU without AVX-512:
csrc/gemm.c's AVX2 tiles against torch on the same (dequantized) weights, and an engine on that build, whose
greedy tokens are the native build's, every layer multiplied by the AVX2 kernel."""
from __future__ import annotations

import ctypes
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvserve import LLM, SamplingParams, kernels
from kvserve.model import layers

V3 = "x86-64-v3"


def _runs_v3() -> bool:
    if shutil.which("cc") is None or platform.machine() != "x86_64":
        return False
    flags = set(" ".join(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                         if line.startswith("flags")).split())
    return {"avx2", "fma", "f16c"} <= flags


pytestmark = [pytest.mark.skipif(not _runs_v3(), reason="no C compiler, or a CPU that does not run x86-64-v3"),
              pytest.mark.skipif(kernels.march() != "native", reason="these compare x86-64-v3 with the native build: "
                                 "the suite's own build is for another target (KVSERVE_MARCH)")]


@pytest.fixture(scope="module")
def v3_build(tmp_path_factory) -> tuple[Path, ctypes.CDLL]:
    """The kernels built with KVSERVE_MARCH=x86-64-v3 into a cache of the module's: the cache, and the library."""
    cache = tmp_path_factory.mktemp("x86-64-v3")
    with pytest.MonkeyPatch.context() as m:
        m.setenv(kernels.MARCH_ENV, V3)
        m.setenv("KVSERVE_CACHE", str(cache))
        return cache, ctypes.CDLL(str(kernels.build()))


@pytest.fixture
def v3(v3_build, monkeypatch) -> ctypes.CDLL:
    """kvserve.model.layers multiplying by the x86-64-v3 build for the test."""
    monkeypatch.setattr(kernels, "library", lambda: v3_build[1])
    layers._gemm_function.cache_clear()
    yield v3_build[1]
    monkeypatch.undo()
    layers._gemm_function.cache_clear()


def test_the_build_targets_the_march_and_reports_avx2(v3_build, monkeypatch):
    """The library holds no AVX-512 instruction (none of its registers: it runs on an AVX2 CPU), reports the AVX2
    kernel for both dtypes, and its build is named apart from the native one."""
    cache, lib = v3_build
    (path,) = (cache / "kernels").glob("*.so")
    if shutil.which("objdump"):
        code = subprocess.run(["objdump", "-d", str(path)], capture_output=True, text=True, check=True).stdout
        assert "vfmadd" in code and "ymm" in code and "zmm" not in code
    assert kernels.typed(lib, "gemm_dtypes")() == 0b11
    assert kernels.typed(lib, "gemm_kernels")() == 1 << layers.GEMM_KERNELS.index("avx2")
    native_key = kernels.build_key()
    monkeypatch.setenv(kernels.MARCH_ENV, V3)
    assert kernels.build_key() != native_key
    monkeypatch.setenv(kernels.MARCH_ENV, "x86-64-v3; rm -rf ~")
    with pytest.raises(ValueError, match="KVSERVE_MARCH must name a target"):
        kernels.build_key()


def _weight(kind: str, w: torch.Tensor, dtype: torch.dtype, gated: bool) -> tuple[layers.Linear, torch.Tensor]:
    """A layer holding w for csrc/gemm.c as `kind` (plain: dtype's numbers), and the weight (float64) whose
    products it computes."""
    layer = (layers.GateUpLinear if gated else layers.Linear)(w.shape[1], w.shape[0], bias=False, dtype=dtype)
    w = w.to(dtype)
    if kind == "plain":
        exact = w.double()
    elif kind == "int8":
        exact = layers.dequantize(*layers.quantize_int8(w)).double()
    else:
        exact = layers.dequantize_int4(*layers.quantize_int4(w)).double()
    assert layer.load(w.clone(), "gemm", None if kind == "plain" else kind) == "gemm"
    return layer, exact


# (m, k, n): one row and a few (bfloat16 and int8 chunks read in place), 17 and 64 (every chunk widened first, tiles
# of 3 rows and a rest); k past a chunk (128) and an int4 group (32) or short of them, n not a multiple of a panel's
# 32 columns
SHAPES = [(1, 64, 32), (3, 100, 70), (17, 1000, 130), (64, 2048, 96), (1, 33, 40)]


@pytest.mark.parametrize("kind", ["plain", "int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_each_gemm_kind_is_torchs_product_of_the_weight(v3, kind, dtype):
    """Every weight format by the AVX2 tiles, with a bias and rows a stride apart, and gated (SwiGLU): within the
    float32 sum's error of the exact product of the (dequantized) weight, bfloat16 rounded once more at each op."""
    g = torch.Generator().manual_seed(0)
    for m, k, n in SHAPES:
        for gated in (False, True):
            w = torch.randn(2 * n if gated else n, k, generator=g)
            layer, exact_w = _weight(kind, w, dtype, gated)
            wide = torch.randn(m, k + 7, generator=g).to(dtype)
            x = wide[:, :k]                                 # rows k + 7 numbers apart
            bias = None if gated else torch.randn(n, generator=g).to(dtype)
            layer.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
            with torch.inference_mode():
                got = layer(x).double()
            exact = F.linear(x.double(), exact_w, None if bias is None else bias.double())
            size = x.double().abs() @ exact_w.abs().T          # the sum's error scales with sum |x w|
            rounding = 0.0 if dtype == torch.float32 else 2.0 ** -8
            if gated:
                exact = F.silu(exact[:, :n]) * exact[:, n:]
                size = size[:, :n].abs() * size[:, n:]
                rounding *= 4                       # the gate, up, SiLU and their product each rounded
            err = (got - exact).abs()
            assert (err <= exact.abs() * rounding + size * 2e-6 + 1e-6).all(), (m, k, n, gated, err.max().item())
            assert layer.own_gemm


@pytest.mark.parametrize("kind", ["plain", "int8", "int4"])
def test_an_embedding_reads_the_rows_of_its_packed_lm_head(v3, kind):
    """A tied table's rows come from lm_head's panels as packed for the AVX2 build (bfloat16 k row by k row): the
    rows of the dequantized weight, rounded to bfloat16."""
    w = torch.randn(70, 100, generator=torch.Generator().manual_seed(1))
    head, exact = _weight(kind, w, torch.bfloat16, False)
    table = layers.Embedding(70, 100, dtype=torch.bfloat16)
    table.share_with(head)
    ids = torch.tensor([[0, 69, 33], [31, 32, 5]])
    assert torch.equal(table(ids), exact.float().bfloat16()[ids])


# Engines on the x86-64-v3 build, in a process of their own (the library is built for the process's target), for
# each quantization: their greedy tokens, GEMM choice and steps, and the kernels the build had
ENGINE = """
import json, sys, torch
from kvserve import LLM, SamplingParams
from kvserve.model import layers
path, prompts = sys.argv[1], json.loads(sys.argv[2])
torch.set_num_threads(1)
runs = {}
for quantization in json.loads(sys.argv[3]):
    llm = LLM(path, dtype="float32", block_size=4, num_kv_blocks=64, quantization=quantization)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
    runs[str(quantization)] = {"tokens": [o.outputs[0].token_ids for o in outs], "stats": llm.stats()}
print(json.dumps({"runs": runs, "kernels": layers.gemm_kernels(torch.float32)}))
"""
QUANTIZATIONS = [None, "int8", "int4"]


def test_engines_on_the_v3_build_decode_the_native_builds_tokens(v3_build, tiny_llama):
    """Float32 weights, int8 and int4: the same greedy tokens as the native build's engines, prefill and decode,
    step by step the same executors (the decode steps in the C step, csrc/decode_step.c), and every GEMM the AVX2
    kernel's (KVSERVE_GEMM=avx2, under KVSERVE_STRICT_KERNELS=1: no fallback to torch's ops)."""
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 30)]
    env = {**os.environ, kernels.MARCH_ENV: V3, "KVSERVE_CACHE": str(v3_build[0]), "KVSERVE_GEMM": "avx2",
           kernels.STRICT_ENV: "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    run = subprocess.run([sys.executable, "-c", ENGINE, str(tiny_llama), json.dumps(prompts),
                          json.dumps(QUANTIZATIONS)], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    v3 = json.loads(run.stdout.strip().splitlines()[-1])
    assert v3["kernels"] == ["avx2"]
    assert layers.vector_kernel(layers.gemm_kernels(torch.float32)) != "avx2"      # here: the native build's tiles
    for quantization in QUANTIZATIONS:
        got = v3["runs"][str(quantization)]
        assert got["stats"]["gemm"]["weight_format"] == "gemm"
        assert got["stats"]["gemm"]["source"] == "KVSERVE_GEMM=avx2"
        assert got["stats"]["steps"].get("native_multi_step", 0) > 0
        llm = LLM(str(tiny_llama), dtype="float32", block_size=4, num_kv_blocks=64, quantization=quantization)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
        assert got["tokens"] == [o.outputs[0].token_ids for o in outs], quantization
        assert got["stats"]["steps"] == llm.stats()["steps"]
