"""`kvserve bench all`: a report with every suite's output and figure; a failing suite does not stop it."""
from __future__ import annotations

import json

from kvserve.cli import main


def test_report_gathers_suites_and_survives_a_failure(tmp_path, monkeypatch):
    real_main = main

    def small(argv):   # the attention suite at test size
        return real_main(argv + ["--prefill-lengths", "64", "--decode-lengths", "64", "--repeats", "1"]
                         if argv[:2] == ["bench", "attention"] else argv)

    monkeypatch.setattr("kvserve.cli.main", small)
    code = real_main(["bench", "all", "--out", str(tmp_path), "--suites", "attention,no-such-suite",
                      "--json", str(tmp_path / "all.json")])
    assert code == 1
    text = (tmp_path / "report.md").read_text()
    assert "## attention (ok)" in text and "![attention](attention.png)" in text
    assert "## no-such-suite (failed)" in text
    assert (tmp_path / "attention.png").stat().st_size > 0
    statuses = json.loads((tmp_path / "all.json").read_text())
    assert statuses["attention"]["status"] == "ok" and statuses["no-such-suite"]["status"] == "failed"
