"""`kvserve bench attention`, shrunk: one row per (backend, phase, length), and the claims computed from them."""
from __future__ import annotations

import json

from kvserve.cli import main
from timings import measured


def test_bench_attention_rows(tmp_path):
    out, png = tmp_path / "attention.json", tmp_path / "attention.png"
    assert main(["bench", "attention", "--prefill-lengths", "64,160", "--decode-lengths", "64,200",
                 "--repeats", "1", "--plot", str(png), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = {(r["backend"], r["phase"], r["length"]): r for r in report["rows"]}
    # textbook, flash, sdpa and native for both phases at both lengths
    assert len(rows) == 4 * 4 and ("native", "decode", 200) in rows and ("native", "prefill", 160) in rows
    assert report["decode_time_native_over_sdpa"].keys() == {"64", "200"}
    assert report["prefill_time_native_over_sdpa"].keys() == {"64", "160"}
    for r in rows.values():
        assert measured(r["time_ms"]) and r["peak_temp_bytes"] > 0
    # the textbook's L x L scores dominate its memory: 4 heads x 160 x 160 float32, twice
    assert rows[("textbook", "prefill", 160)]["peak_temp_bytes"] >= 2 * 4 * 160 * 160 * 4
    assert report["prefill_memory_ratio_textbook_over_flash"] == (
        rows[("textbook", "prefill", 160)]["peak_temp_bytes"] / rows[("flash", "prefill", 160)]["peak_temp_bytes"])
    assert png.stat().st_size > 0
