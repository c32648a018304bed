"""The bundled demo model: shipped in the wheel, loaded by default, equal to transformers on its weights."""
from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.cli import main
from kvserve.eval.perplexity import perplexity, transformers_nll
from kvserve.model.loader import DEMO_MODEL_DIR

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
CODE = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(ROOT)], check=True)
    return next(out.glob("kvserve-*.whl"))


def test_the_wheel_ships_the_model_within_25_mb(wheel):
    with zipfile.ZipFile(wheel) as zf:
        sizes = {Path(i.filename).name: i.file_size for i in zf.infolist() if "/assets/demo-model/" in i.filename}
    assert set(SHIPPED) <= set(sizes)
    assert sum(sizes.values()) <= 25 * 2**20


def test_the_installed_package_loads_its_own_model(wheel, tmp_path):
    """Installed from the wheel into a fresh directory and run from elsewhere: not the source tree."""
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True)
    script = ("import kvserve, kvserve.model.loader as l, kvserve.kernels as k; "
              "from kvserve import LLM, SamplingParams; print(l.DEMO_MODEL_DIR); "
              "print(k.CSRC.is_relative_to(l.DEMO_MODEL_DIR.parents[1]) and k.library() is not None); "
              "print(LLM().generate('def add(a, b):', SamplingParams(max_tokens=8, temperature=0))[0].outputs[0].text)")
    env = {**os.environ, "PYTHONPATH": str(target)}
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                         check=True).stdout.splitlines()
    # the package's own model, and the C kernels built from the sources shipped beside its code
    assert out[0].startswith(str(target)) and out[1] == "True" and out[2].strip()


@pytest.fixture(scope="module")
def demo() -> LLM:
    return LLM(dtype="float32")


def test_greedy_tokens_and_logits_equal_transformers(demo):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32)
    ids = demo.get_tokenizer().encode("import os\n\ndef main():\n")
    params = SamplingParams(max_tokens=16, temperature=0, logprobs=1, ignore_eos=True)
    out = demo.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0]
    with torch.inference_mode():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
        ref = ref[0, len(ids):].tolist()
        logits = hf(torch.tensor([ids + out.token_ids])).logits[0, len(ids) - 1:-1].log_softmax(-1)
    assert out.token_ids == ref
    ours = torch.tensor([lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)])
    torch.testing.assert_close(ours, logits[torch.arange(16), torch.tensor(out.token_ids)], atol=1e-4, rtol=1e-4)


def test_chunked_prompts_give_the_same_tokens(demo):
    # a 4096-token vocabulary: the sampler's tiled argmax, also in steps where no sequence samples
    chunked = LLM(dtype="float32", long_prefill_token_threshold=8)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    for prompts in ([CODE[:200]], [CODE[:200], CODE[:90] + "\n", "def"]):    # alone, its first chunks sample nothing
        want = [o.outputs[0].token_ids for o in demo.generate(prompts, params, use_tqdm=False)]
        assert [o.outputs[0].token_ids for o in chunked.generate(prompts, params, use_tqdm=False)] == want


def test_perplexity_through_the_cache_equals_transformers(demo):
    ids = demo.get_tokenizer().encode(CODE * 2, add_special_tokens=False)
    result = perplexity(demo, ids, context=48)
    assert result.nll == pytest.approx(transformers_nll(DEMO_MODEL_DIR, ids, 48, torch.float32), rel=1e-4)


def test_planner_blocks_equal_the_engines_on_the_demo_model():
    from kvserve.planner import num_blocks

    llm = LLM(kv_cache_memory="64MiB")
    assert num_blocks(str(DEMO_MODEL_DIR), "64MiB", 16, "bfloat16") == llm.stats()["kv_blocks_total"]


def test_generate_cli_runs_on_the_default_model(capsys):
    assert main(["generate", "def fibonacci(n):", "--max-tokens", "24"]) == 0
    assert capsys.readouterr().out.strip()


def test_the_kvserve_command_flushes_its_output_and_exit_code():
    # `kvserve` exits without the interpreter's teardown: what it printed must still arrive, piped.
    cmd = [sys.executable, "-m", "kvserve.cli", "generate"]
    ok = subprocess.run(cmd + ["def fibonacci(n):", "--max-tokens", "8"], capture_output=True, text=True,
                        timeout=120)
    assert ok.returncode == 0 and ok.stdout.startswith("def fibonacci(n):") and len(ok.stdout) > 20
    bad = subprocess.run(cmd + ["x", "--max-tokens", "-1"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "max_tokens" in bad.stderr
