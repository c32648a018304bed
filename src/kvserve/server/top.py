"""kvserve top: a running server's KV cache in the terminal, read from its GET /v1/kv/state (rich)."""
from __future__ import annotations

import argparse
import json
import math
import time
import urllib.error
import urllib.request

from kvserve.engine.kv_state import STATES
from kvserve.extras import MissingDependency

COLORS = {"free": "grey30", "cached": "blue", "used": "green", "shared": "dark_orange"}
# a terminal cell stands for several blocks where the pool outgrows the screen: it shows the most
# telling state among them
PRIORITY = ["shared", "used", "cached", "free"]
GRID_ROWS = 12
MAX_ROWS = 20


def add_top_parser(sub) -> None:
    p = sub.add_parser("top", help="a running server's KV cache in the terminal")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server (kvserve serve)")
    p.add_argument("--api-key", default=None, help="the server's --api-key")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between reads of the state")
    p.add_argument("--once", action="store_true", help="print the state once and exit")
    p.set_defaults(func=cmd_top)


def fetch_state(url: str, api_key: str | None) -> dict:
    """The server's /v1/kv/state; ValueError naming what went wrong (the server's own message if any)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    request = urllib.request.Request(f"{url.rstrip('/')}/v1/kv/state", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return json.load(r)
    except urllib.error.HTTPError as e:
        try:
            message = json.load(e)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = e.reason
        raise ValueError(f"{url}: {e.code} {message}") from None
    except urllib.error.URLError as e:
        raise ValueError(f"{url}: the server does not answer ({e.reason})") from None


def grid_cells(blocks: str, cells: int) -> list[str]:
    """The state of each of at most `cells` terminal cells over the pool's blocks, in order."""
    per = max(1, math.ceil(len(blocks) / cells))
    names = {c: name for name, c in STATES.items()}
    return [min((names[c] for c in set(blocks[i:i + per])), key=PRIORITY.index) for i in range(0, len(blocks), per)]


def render(state: dict, width: int):
    """The state as a rich renderable: counts, the pool as a grid, the requests and their blocks."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    counts, total = state["counts"], state["num_blocks"]
    head = Text(f"kvserve top · {state['model']} · {total} blocks × {state['block_size']} tokens · "
                f"{state['kv_cache_dtype']} · in use {total - counts['free'] - counts['cached']}\n", style="bold")
    for name in STATES:
        if counts[name] or name in ("free", "cached", "used", "shared"):
            head.append("■ ", style=COLORS[name]).append(f"{name} {counts[name]}   ")
    grid = Text()
    for i, name in enumerate(grid_cells(state["blocks"], width * GRID_ROWS)):
        if i and i % width == 0:
            grid.append("\n")
        grid.append("█", style=COLORS[name])
    table = Table("request", "status", "tokens", "computed", "prefix hit", "evicted", "blocks", box=None)
    seqs = state["running"] + state["waiting"]
    for seq in seqs[:MAX_ROWS]:
        table.add_row(seq["request_id"], seq["status"], str(seq["num_tokens"]), str(seq["num_computed_tokens"]),
                      str(seq["num_cached_tokens"]), str(seq["num_evicted_tokens"]), str(len(seq["block_table"])))
    more = Text(f"+{len(seqs) - MAX_ROWS} more", style="dim") if len(seqs) > MAX_ROWS else Text()
    return Group(head, grid, Text(), table, more)


def cmd_top(args: argparse.Namespace) -> int:
    try:
        from rich.console import Console
        from rich.live import Live
    except ImportError as e:
        raise MissingDependency("kvserve top needs rich, which the core install leaves out: "
                                'pip install "kvserve[top]"') from e
    console = Console()
    if args.interval <= 0:
        raise ValueError(f"--interval must be positive, got {args.interval}")
    state = fetch_state(args.url, args.api_key)
    if args.once:
        console.print(render(state, console.width))
        return 0
    with Live(render(state, console.width), console=console, auto_refresh=False) as view:
        try:
            while True:
                time.sleep(args.interval)
                view.update(render(fetch_state(args.url, args.api_key), console.width), refresh=True)
        except KeyboardInterrupt:
            return 0
