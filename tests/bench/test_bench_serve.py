"""`kvserve bench serve` against a real server subprocess, shrunk to a few seconds."""
from __future__ import annotations

import asyncio
import json
import math

import pytest

from kvserve.bench.serve import RequestResult, one_request, summarize
from kvserve.cli import main
from timings import measured


def test_bench_serve_rows(checkpoint, tmp_path):
    ckpt = checkpoint("llama")
    out = tmp_path / "serve.json"
    assert main(["bench", "serve", "--quick", "--model", str(ckpt), "--concurrency", "1,64", "--requests", "4",
                 "--prompt-len", "8", "--output-len", "16", "--repeats", "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert [r["concurrency"] for r in rows] == [1, 64]
    # at 64, served and offline twice each; the row is the median served run
    assert len(report["served_tok_s_at_64"]) == len(report["offline_tok_s_runs"]) == 2
    assert rows[1]["output_tok_s"] in report["served_tok_s_at_64"]
    assert all(measured(x) for x in report["offline_tok_s_runs"])
    assert report["served_over_offline_at_64"] == rows[1]["output_tok_s"] / report["offline_tok_s_at_64"]
    for r in rows:
        assert r["errors"] == 0 and r["requests"] == 4
        assert measured(r["ttft_p50"]) and r["ttft_p50"] <= r["ttft_p99"]
        assert measured(r["tpot_p50"]) and measured(r["output_tok_s"])
        # a tiny model can stream all the tokens after the first in one chunk: no gap to measure (nan)
        assert math.isnan(r["itl_p99"]) or measured(r["itl_p99"])


class _Stream:
    """A streamed completion's body, in the reads the client gets."""

    status = 200

    def __init__(self, reads: list[bytes]):
        self.reads = reads
        self.content = self

    async def iter_any(self):
        for data in self.reads:
            yield data

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return False


class _Session:
    def __init__(self, reads: list[bytes]):
        self.reads = reads

    def post(self, url: str, json: dict) -> _Stream:
        return _Stream(self.reads)


def test_a_stream_gives_a_gap_between_each_two_chunks_and_a_row_the_percentiles_of_its_requests():
    """The client's figures from a stream whose events come split across reads and two in one read: its TTFT,
    a gap between each two chunks with text (the usage chunk has none), the usage's token count; then a row's
    figures from given timings."""
    reads = [b'data: {"choices": [{"text": "a"}]}\n\n', b'data: {"choices": [{"text": "b"}]}\n\ndata: {"cho',
             b'ices": [{"text": "c"}]}\n\ndata: {"choices": [], "usage": {"completion_tokens": 3}}\n\n',
             b"data: [DONE]\n\n"]
    res = asyncio.run(one_request(_Session(reads), "http://server", [5, 6], 3))
    assert res.ok and res.output_tokens == 3 and len(res.itl) == 2
    assert all(measured(x) for x in (res.ttft, res.latency, *res.itl)) and res.ttft <= res.latency
    done = RequestResult(ok=True, ttft=0.1, latency=0.5, output_tokens=5, itl=[0.1, 0.1, 0.1, 0.1])
    row = summarize([done, RequestResult(ok=False)], duration=2.0)
    assert (row["requests"], row["errors"], row["request_s"], row["output_tok_s"]) == (2, 1, 0.5, 2.5)
    assert row["ttft_p50"] == row["tpot_p99"] == row["itl_p99"] == pytest.approx(100.0)     # ms
