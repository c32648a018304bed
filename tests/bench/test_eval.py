"""The evaluation harness: perplexity through the cache equals transformers', passkey cells add up."""
from __future__ import annotations

import json
import math

import pytest
import torch

from kvserve import LLM
from kvserve.cli import main
from kvserve.eval.perplexity import perplexity, transformers_nll, windows
from kvserve.eval.retrieval import passkey_accuracy

TEXT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n" * 3


@pytest.fixture(scope="module")
def ckpt(checkpoint):
    return checkpoint("llama", initializer_range=0.02)


@pytest.mark.parametrize("kwargs", [dict(long_prefill_token_threshold=1), dict(long_prefill_token_threshold=7),
                                    dict(cache_mode="none")])
def test_perplexity_through_the_cache_equals_transformers(ckpt, kwargs):
    llm = LLM(str(ckpt), block_size=4, num_kv_blocks=128, **kwargs)
    ids = llm.get_tokenizer().encode(TEXT, add_special_tokens=False)
    result = perplexity(llm, ids, context=40)
    ref = transformers_nll(ckpt, ids, 40, torch.float32)
    assert result.tokens == sum(len(w) - 1 for w in windows(ids, 40)) and result.windows == len(windows(ids, 40))
    assert result.nll == pytest.approx(ref, rel=1e-4)
    assert result.perplexity == pytest.approx(math.exp(ref), rel=1e-4)
    if llm.engine.cache_config.cache_mode != "none":
        assert 0 < result.peak_kv_bytes <= result.windows * 10 * llm.engine.kv_spec.bytes_per_block


def test_passkey_cells(ckpt):
    llm = LLM(str(ckpt), num_kv_blocks=128, block_size=16)
    cells = passkey_accuracy(llm, [200, 300], [0.0, 0.5, 1.0], trials=2)
    assert [(c.length, c.depth, c.trials) for c in cells] == [(n, d, 2) for n in (200, 300) for d in (0.0, 0.5, 1.0)]
    assert all(0 <= c.accuracy <= 1 for c in cells)


def test_eval_cli(ckpt, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    out = tmp_path / "ppl.json"
    assert main(["eval", "perplexity", "--model", str(ckpt), "--text", str(text), "--context", "32",
                 "--num-kv-blocks", "64", "--block-size", "4", "--transformers", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result) >= {"tokens", "nll", "perplexity", "peak_kv_bytes"}
    assert result["transformers_perplexity"] == pytest.approx(result["perplexity"], rel=1e-4)
    out = tmp_path / "passkey.json"
    assert main(["eval", "passkey", "--model", str(ckpt), "--lengths", "200", "--depths", "0,1", "--trials", "1",
                 "--num-kv-blocks", "64", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert 0 <= report["accuracy"] <= 1 and len(report["rows"]) == 2
