"""`kvserve bench SUITE`: each suite measures one claim, ours beside a reference, and prints a number.

The benches' own dependencies (matplotlib for figures, aiohttp for `bench serve`'s clients, vllm-router for
`bench replicas`) are the `bench` extra, imported only where used (kvserve.extras), so that the core install
needs none of them. The command registers the suites through add_bench_parser alone; no other module of kvserve
imports this package.
"""
from __future__ import annotations


def add_bench_parser(sub) -> None:
    """The `bench` subcommand and its suites, on the command's subparsers."""
    from kvserve.bench import (attention, capacity, decode, eviction, offload, prefix, quant, replicas, report,
                               serve, sparse, spec, structured, throughput, tp)

    b = sub.add_parser("bench", help="measure the engine's claims on this machine, each beside a reference")
    suites = b.add_subparsers(dest="suite", required=True)
    for module in (decode, throughput, prefix, offload, capacity, serve, replicas, attention, quant, eviction, sparse,
                   tp, spec, structured, report):
        # argparse formats help with %: a docstring's "50%" must reach it as "50%%"
        p = suites.add_parser(module.NAME, help=module.__doc__.splitlines()[0].replace("%", "%%"))
        p.add_argument("--json", dest="json_path", default=None, help="write the figures to this file")
        p.add_argument("--quick", action="store_true", help="a short run (under a minute)")
        module.add_args(p)
        p.set_defaults(func=module.run)

