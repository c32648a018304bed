"""`kvserve bench compile` on a tiny model: it runs, its JSON holds sane figures, and a torch step that computes
something else than the native step fails the suite instead of being timed."""
from __future__ import annotations

import json

import pytest

from kvserve.bench import compile as compile_suite
from kvserve.cli import main
from timings import measured

TINY = ["--random-model", "--hidden-size", "64", "--intermediate-size", "128", "--num-layers", "2", "--num-heads",
        "4", "--num-kv-heads", "2", "--vocab-size", "512"]
# one batch, one dtype, a short context: the compile dominates the test's time
SMALL = ["--quick", "--dtypes", "float32", "--batches", "3", "--context", "40", "--steps", "2", "--repeats", "2"]


def test_bench_compile_json(tmp_path):
    path = tmp_path / "compile.json"
    assert main(["bench", "compile", "--json", str(path), *SMALL, *TINY]) == 0
    res = json.loads(path.read_text())
    assert res["workload"] == {"batches": [3], "dtypes": ["float32"], "context": 40, "steps": 2, "repeats": 2,
                               "threads": res["workload"]["threads"]}
    assert res["shape"]["hidden_size"] == 64 and res["model"].startswith("Llama hidden 64")
    [r] = res["results"]
    assert (r["dtype"], r["batch"]) == ("float32", 3)
    assert set(r["tok_s"]) == {"native", "compiled", "eager"} and all(measured(v) for v in r["tok_s"].values())
    assert all(len(runs) == 2 and all(measured(s) for s in runs) for runs in r["runs_s"].values())
    for name, runs in r["runs_s"].items():
        assert r["best_tok_s"][name] == pytest.approx(3 / min(runs)) and r["best_tok_s"][name] >= r["tok_s"][name]
    assert r["compiled_over_native"] == pytest.approx(r["tok_s"]["compiled"] / r["tok_s"]["native"])
    assert r["eager_over_native"] == pytest.approx(r["tok_s"]["eager"] / r["tok_s"]["native"])
    # the compiled step computes the native step's logits
    assert r["logits_match"] and r["max_logit_diff_relative"] <= res["logit_tolerance"]["float32"]
    assert r["top1_agreement"] == 1.0 and measured(r["first_compiled_call_s"])
    wins = r["compiled_over_native"] > 1 and r["tok_s"]["compiled"] > r["tok_s"]["eager"]
    assert res["compiled_wins"] == ([{"dtype": "float32", "batch": 3}] if wins else [])


def test_a_torch_step_that_differs_from_the_native_one_fails_the_suite(tmp_path, monkeypatch, capsys):
    # RMSNorm left out: another step, whose rates would compare nothing
    monkeypatch.setattr(compile_suite.TorchDecode, "norm", lambda self, x, weight: x)
    path = tmp_path / "compile.json"
    assert main(["bench", "compile", "--json", str(path), *SMALL, *TINY]) == 1
    [r] = json.loads(path.read_text())["results"]
    assert not r["logits_match"] and r["max_logit_diff_relative"] > 1e-2
    assert "DIFFER" in capsys.readouterr().out


def test_without_the_native_step_the_suite_says_so_and_measures_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(compile_suite, "function", lambda name: None)   # as where the kernels cannot be built
    path = tmp_path / "compile.json"
    assert main(["bench", "compile", "--json", str(path), *SMALL, *TINY]) == 2
    err = capsys.readouterr().err
    assert "native C decode step" in err and "not available" in err
    assert not path.exists()
