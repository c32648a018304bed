"""`kvserve bench serve` against a real server subprocess, shrunk to a few seconds."""
from __future__ import annotations

import json

from kvserve.cli import main
from tiny_models import make_checkpoint


def test_bench_serve_rows(tmp_path):
    ckpt = make_checkpoint(tmp_path / "model", "llama")
    out = tmp_path / "serve.json"
    assert main(["bench", "serve", "--quick", "--model", str(ckpt), "--concurrency", "1,64", "--requests", "4",
                 "--prompt-len", "8", "--output-len", "16", "--repeats", "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert [r["concurrency"] for r in rows] == [1, 64]
    # at 64, served and offline twice each; the row is the median served run
    assert len(report["served_tok_s_at_64"]) == len(report["offline_tok_s_runs"]) == 2
    assert rows[1]["output_tok_s"] in report["served_tok_s_at_64"] and min(report["offline_tok_s_runs"]) > 0
    assert report["served_over_offline_at_64"] == rows[1]["output_tok_s"] / report["offline_tok_s_at_64"]
    for r in rows:
        assert r["errors"] == 0 and r["requests"] == 4
        assert 0 < r["ttft_p50"] <= r["ttft_p99"] and r["tpot_p50"] > 0 and r["output_tok_s"] > 0
        # a tiny model can stream all the tokens after the first in one chunk: no gap to measure (nan)
        assert not r["itl_p99"] <= 0
    assert any(r["itl_p99"] > 0 for r in rows)
