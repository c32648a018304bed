"""`kvserve bench spec` on a tiny checkpoint: plain decoding beside n-gram lookup and a draft model, side by side,
each speculating engine's acceptance measured from its own counters, and a verification's cost."""
from __future__ import annotations

import json

import pytest
import torch

from kvserve.bench import llamacpp
from kvserve.cli import main
from timings import measured


def test_bench_spec_json(checkpoint, tmp_path, capsys):
    ckpt = checkpoint(initializer_range=0.02, max_position_embeddings=640)
    path = tmp_path / "spec.json"
    args = ["--model", str(ckpt), "--batches", "1,2", "--tokens", "16", "--cost-shape", "bench",
            "--cost-batches", "1,2", "--cost-context", "32", "--no-llama-cpp"]
    assert main(["bench", "spec", "--quick", "--json", str(path), *args]) == 0
    res = json.loads(path.read_text())
    part = res["end_to_end"]
    assert part["draft"] == f"{ckpt} (int4)"        # by default the model itself, its weights int4
    assert part["llama_cpp"] is None
    assert set(part["results"]) == {f"{w}, batch {b}" for w in ("code", "free") for b in (1, 2)}
    for where, engines in part["results"].items():
        assert list(engines) == ["plain", "ngram", "draft"], where
        plain = engines["plain"]
        assert plain["acceptance"] is None and plain["tokens_per_verification"] is None and plain["vs_plain"] == 1
        for name in ("ngram", "draft"):
            r = engines[name]
            assert measured(r["tok_s"]) and measured(r["vs_plain"]), (where, name)
            # the engine speculated: its counters moved, within what 4 drafts a step allow
            assert 0 <= r["acceptance"] <= 1, (where, name)
            assert 1 <= r["tokens_per_verification"] <= 1 + res["num_speculative_tokens"], (where, name)
    costs = res["costs"]
    assert set(costs["seconds"]) == {"1", "2"}
    for c in costs["seconds"].values():
        assert all(measured(c[k]) for k in ("plain", "verify", "prefill"))
    assert all(measured(r["verify_over_plain"]) for r in costs["ratios"].values())
    out = capsys.readouterr().out
    # one row a workload and batch: plain decoding beside each speculating engine
    header = next(line for line in out.splitlines() if line.startswith("workload"))
    columns = [c.strip() for c in header.split("  ") if c.strip()]
    assert columns[:3] == ["workload", "plain tok/s", "ngram tok/s"] and "draft tok/s" in columns
    assert "code, batch 1" in out and "target: a step of 1+4 tokens at batch 1" in out


@pytest.mark.skipif(not llamacpp.available(), reason="llama-cpp-python and gguf are not installed (the peers extra: "
                                                     "pip install 'kvserve[peers]')")
def test_bench_spec_runs_llama_cpp_lookup_beside_ngram_at_batch_1(checkpoint, tmp_path, capsys):
    ckpt = checkpoint(initializer_range=0.02, max_position_embeddings=640)
    path = tmp_path / "spec.json"
    args = ["--model", str(ckpt), "--batches", "1,2", "--tokens", "16", "--cost-shape", "none"]
    assert main(["bench", "spec", "--quick", "--json", str(path), *args]) == 0
    peer = json.loads(path.read_text())["end_to_end"]["llama_cpp"]
    assert peer["route"] == llamacpp.LOOKUP_ROUTE and peer["threads"] == torch.get_num_threads()
    assert (peer["max_ngram"], peer["num_drafts"]) == (4, 4)
    assert set(peer["results"]) == {"code", "free"}           # batch 1 alone
    for workload, r in peer["results"].items():
        assert measured(r["plain_tok_s"]) and measured(r["lookup_tok_s"]) and measured(r["vs_plain"]), workload
        # each llama_decode gained its token and at most 4 drafts
        assert 1 <= r["tokens_per_decode"] <= 5, workload
        # greedy either way: lookup changes how fast, never which tokens
        assert r["same_tokens"], workload
    # on code that is in the prompt, lookup drafted tokens that llama.cpp accepted
    assert peer["results"]["code"]["tokens_per_decode"] > 1
    out = capsys.readouterr().out
    assert f"llama.cpp's lookup: {llamacpp.LOOKUP_ROUTE}" in out
    header = next(line for line in out.splitlines() if line.startswith("workload") and "llama.cpp" in line)
    columns = [c.strip() for c in header.split("  ") if c.strip()]
    assert columns[:5] == ["workload", "kvserve plain", "kvserve ngram", "vs plain", "llama.cpp plain"]


def test_the_llama_cpp_column_says_why_it_does_not_run(checkpoint):
    from kvserve.bench.spec_llamacpp import why_not

    llama, qwen = checkpoint(), checkpoint(arch="qwen2")
    if not llamacpp.available():
        assert why_not(llama, [1]) == "not installed: pip install 'kvserve[peers]'"
        return
    assert why_not(llama, [1, 16]) is None
    assert why_not(llama, [16]) == "llama-cpp-python's Llama decodes a sequence at a time: --batches has no 1"
    assert why_not(qwen, [1]) == "it converts Llama checkpoints only, not 'qwen2'"
