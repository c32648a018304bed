"""`kvserve bench SUITE`: each suite measures one claim, ours beside a reference, and prints a number."""
from __future__ import annotations


def add_bench_parser(sub) -> None:
    from kvserve.bench import attention, capacity, decode, eviction, prefix, quant, report, serve, throughput

    b = sub.add_parser("bench", help="measure the seeds' claims on this machine")
    suites = b.add_subparsers(dest="suite", required=True)
    for module in (decode, throughput, prefix, capacity, serve, attention, quant, eviction, report):
        p = suites.add_parser(module.NAME, help=module.__doc__.splitlines()[0])
        p.add_argument("--json", dest="json_path", default=None, help="write the figures to this file")
        p.add_argument("--quick", action="store_true", help="a short run (under a minute)")
        module.add_args(p)
        p.set_defaults(func=module.run)

