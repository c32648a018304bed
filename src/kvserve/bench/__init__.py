"""`kvserve bench SUITE`: each suite measures one claim, ours beside a reference, and prints a number.

The benches' own dependencies (matplotlib for figures, aiohttp for `bench serve`'s clients) are the
`bench` extra, imported only where used, so that the core install needs neither.
"""
from __future__ import annotations

import importlib
from types import ModuleType

BENCH_EXTRA = "pip install 'kvserve[bench]'"


class MissingDependency(ImportError):
    """A module of the `bench` extra is not installed; the message names the install command."""


def optional_import(name: str, needed_for: str) -> ModuleType:
    """Import and return `name`, a module of the `bench` extra; raise MissingDependency saying what
    needs it and how to install it when it is absent."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise MissingDependency(f"{needed_for} needs {name}, which the core install leaves out: {BENCH_EXTRA}") from e


def pyplot(needed_for: str = "drawing figures") -> ModuleType:
    """matplotlib.pyplot on the Agg backend (files only, no display); MissingDependency without matplotlib."""
    optional_import("matplotlib", needed_for).use("Agg")
    return importlib.import_module("matplotlib.pyplot")


def add_bench_parser(sub) -> None:
    from kvserve.bench import (attention, capacity, decode, eviction, offload, prefix, quant, report, serve,
                               throughput, tp)

    b = sub.add_parser("bench", help="measure the engine's claims on this machine, each beside a reference")
    suites = b.add_subparsers(dest="suite", required=True)
    for module in (decode, throughput, prefix, offload, capacity, serve, attention, quant, eviction, tp, report):
        # argparse formats help with %: a docstring's "50%" must reach it as "50%%"
        p = suites.add_parser(module.NAME, help=module.__doc__.splitlines()[0].replace("%", "%%"))
        p.add_argument("--json", dest="json_path", default=None, help="write the figures to this file")
        p.add_argument("--quick", action="store_true", help="a short run (under a minute)")
        module.add_args(p)
        p.set_defaults(func=module.run)

