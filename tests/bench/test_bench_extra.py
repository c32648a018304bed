"""The bench extra: matplotlib and aiohttp stay out of the core install, and a command that needs them
without them says how to install them."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve.cli import main

ROOT = Path(__file__).resolve().parents[2]
BENCH_MODULES = ("matplotlib", "aiohttp")


@pytest.fixture
def without_bench_extra(monkeypatch):
    """Imports of matplotlib and aiohttp fail, as in an install without the extra."""
    for name in BENCH_MODULES:
        for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            monkeypatch.delitem(sys.modules, loaded)
        monkeypatch.setitem(sys.modules, name, None)


def test_the_core_install_needs_no_bench_module():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    named = lambda specs: {s.split(">")[0].split("[")[0].strip().lower() for s in specs}  # noqa: E731
    assert not named(project["dependencies"]) & set(BENCH_MODULES)
    extras = project["optional-dependencies"]
    # CI installs only the test extra and runs the bench tests
    assert set(BENCH_MODULES) <= named(extras["bench"]) & named(extras["test"])
    # and the core, its server and its command line import neither
    code = ("import sys\n"
            "import kvserve, kvserve.cli, kvserve.server.app, kvserve.planner, kvserve.eval.cli\n"
            "kvserve.cli.build_parser()\n"
            f"print(sorted(m for m in {BENCH_MODULES!r} if m in sys.modules))\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("argv", [
    ["plan", "--model", "llama-3.2-1b", "--gpu", "h100", "--plot", "PNG"],
    ["bench", "serve", "--url", "http://127.0.0.1:9"],
    ["bench", "all", "--out", "DIR", "--suites", "capacity"],
])
def test_a_command_that_needs_the_extra_names_its_install(argv, without_bench_extra, tmp_path, capsys):
    argv = [str(tmp_path / "x") if a in ("PNG", "DIR") else a for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvserve: error:") and "pip install 'kvserve[bench]'" in err
    assert not (tmp_path / "x").exists()      # failed before doing the work, not after


def test_bench_help_lists_every_suite(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "budgets of 10/20/50%" in out and "Every bench in one run" in out
