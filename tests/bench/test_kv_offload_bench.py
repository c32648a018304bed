"""`kvserve bench offload --quick` on a tiny model: it runs, its JSON holds sane figures, and its figure draws."""
from __future__ import annotations

import json
import math

from kvserve.bench.report import plot_offload
from kvserve.cli import main
from timings import measured

TINY = ["--hidden-size", "64", "--intermediate-size", "128", "--num-layers", "2", "--num-heads", "4",
        "--num-kv-heads", "2", "--vocab-size", "512"]


def test_bench_offload_json(tmp_path):
    path = tmp_path / "offload.json"
    args = ["--documents", "4", "--doc-len", "64", "--questions", "2", "--tokens", "2", "--block-size", "8"]
    assert main(["bench", "offload", "--quick", "--json", str(path), *args, *TINY]) == 0
    res = json.loads(path.read_text())
    modes = ("no_prefix_cache", "prefix_cache", "disk_tier", "after_restart")
    for mode in modes:
        r = res[mode]
        assert len(r["ttft_s"]) == 8 and all(measured(t) for t in r["ttft_s"])
        assert r["p50_ttft_s"] <= r["p99_ttft_s"] <= max(r["ttft_s"]) and math.isclose(
            r["mean_ttft_s"], sum(r["ttft_s"]) / 8)
    # where prompt tokens came from: nothing cached without prefix caching, no tier without one, and the
    # documents that left the pool (a pool of one) came back from the tier, also after the restart
    assert res["no_prefix_cache"]["pool_hit_rate"] == res["no_prefix_cache"]["tier_hit_rate"] == 0
    assert res["prefix_cache"]["tier_hit_rate"] == 0
    for mode in ("disk_tier", "after_restart"):
        r = res[mode]
        assert r["tier_hit_rate"] > 0 and r["kv_offload_bytes_read"] > 0
        assert math.isclose(r["pool_hit_rate"] + r["tier_hit_rate"], 64 / 80)    # every document's blocks, found
    assert math.isclose(res["ttft_speedup"], res["prefix_cache"]["mean_ttft_s"] / res["disk_tier"]["mean_ttft_s"])
    plot_offload(res, tmp_path / "offload.png", "test")
    assert (tmp_path / "offload.png").stat().st_size > 0
