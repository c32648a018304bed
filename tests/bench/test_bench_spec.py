"""`kvserve bench spec` on a tiny checkpoint: plain decoding beside n-gram lookup and a draft model, side by side,
each speculating engine's acceptance measured from its own counters, and a verification's cost."""
from __future__ import annotations

import json

from kvserve.cli import main
from timings import measured


def test_bench_spec_json(checkpoint, tmp_path, capsys):
    ckpt = checkpoint(initializer_range=0.02, max_position_embeddings=640)
    path = tmp_path / "spec.json"
    args = ["--model", str(ckpt), "--batches", "1,2", "--tokens", "16", "--cost-shape", "bench",
            "--cost-batches", "1,2", "--cost-context", "32"]
    assert main(["bench", "spec", "--quick", "--json", str(path), *args]) == 0
    res = json.loads(path.read_text())
    part = res["end_to_end"]
    assert part["draft"] == f"{ckpt} (int4)"        # by default the model itself, its weights int4
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
