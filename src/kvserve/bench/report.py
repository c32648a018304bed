"""Every bench in one run: DIR/report.md with each suite's output, figures and verdicts.

Each suite runs in this process with `--json`; its printed output goes into the report, and a
plot is drawn from its JSON. A suite that fails is reported as failed and the others still run.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import time
import traceback
from pathlib import Path

from tqdm.auto import tqdm

from kvserve.arg_utils import write_json
from kvserve.extras import pyplot

NAME = "all"
SUITES = ("decode", "throughput", "prefix", "offload", "capacity", "attention", "serve", "quant", "eviction")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="directory for report.md, the JSON files and the plots")
    p.add_argument("--suites", default=",".join(SUITES), help="comma-separated subset")


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()}"


def run(args: argparse.Namespace) -> int:
    from kvserve.cli import main

    pyplot("bench all")     # a missing bench extra fails here, not after the suites have run
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%d")
    sections = []
    for suite in tqdm(args.suites.split(","), desc="benches"):
        json_path, png = out / f"{suite}.json", out / f"{suite}.png"
        argv = ["bench", suite, "--json", str(json_path)] + (["--quick"] if args.quick else [])
        buf, start = io.StringIO(), time.perf_counter()
        try:
            with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
                code = main(argv)
            status = "ok" if code == 0 else f"exit code {code}"
        except (Exception, SystemExit):  # noqa: BLE001
            # one failing bench is reported and the others still run
            status, code = "failed", 1
            buf.write(traceback.format_exc())
        elapsed = time.perf_counter() - start
        figure = None
        if code == 0 and suite in PLOTS:
            PLOTS[suite](json.loads(json_path.read_text()), png, f"{machine()}; {stamp}")
        if png.exists():
            figure = png.name
        sections.append((suite, status, elapsed, buf.getvalue(), figure))
    write_report(out / "report.md", sections, stamp, args.quick)
    print(f"wrote {out / 'report.md'}")
    write_json(args.json_path, {s[0]: {"status": s[1], "seconds": s[2]} for s in sections})
    return 0 if all(s[1] == "ok" for s in sections) else 1


def write_report(path: Path, sections, stamp: str, quick: bool) -> None:
    lines = ["# kvserve benchmark report", "",
             f"Measured on {machine()}, {stamp}{' (quick runs)' if quick else ''}.", "",
             "| suite | status | seconds |", "| --- | --- | --- |"]
    lines += [f"| {suite} | {status} | {elapsed:.0f} |" for suite, status, elapsed, _, _ in sections]
    for suite, status, _, text, figure in sections:
        lines += ["", f"## {suite} ({status})", "", "```", text.rstrip(), "```"]
        if figure:
            lines += ["", f"![{suite}]({figure})"]
    path.write_text("\n".join(lines) + "\n")


def _figure(ncols: int = 1):
    return pyplot("bench all").subplots(1, ncols, figsize=(5.5 * ncols, 4))


def _save(fig, path: Path, title: str) -> None:
    fig.suptitle(title, fontsize=9, wrap=True)    # a single plot's width does not hold a long title
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_decode(data: dict, path: Path, where: str) -> None:
    fig, ax = _figure()
    for mode in ("none", "paged"):
        series = data[mode]["per_token_ms"]
        ax.plot(range(1, len(series) + 1), series, label=f"cache_mode={mode}", linewidth=0.8)
    ax.set(xlabel="generated token", ylabel="ms per token", yscale="log")
    ax.legend()
    _save(fig, path, f"decode: per-token latency, {data['dtype']}; {where}; "
                     f"total speedup {data['speedup_cached_vs_none']:.1f}x")


def plot_throughput(data: dict, path: Path, where: str) -> None:
    fig, (ax1, ax2) = _figure(2)
    dtypes = [d for d in ("float32", "bfloat16") if d in data]
    xs = range(len(dtypes))
    ax1.bar([x - 0.2 for x in xs], [data[d]["ours_tok_s"] for d in dtypes], 0.4, label="kvserve")
    ax1.bar([x + 0.2 for x in xs], [data[d]["hf_tok_s"] for d in dtypes], 0.4, label="transformers")
    ax1.set(xticks=list(xs), xticklabels=dtypes, ylabel="generated tok/s", title="64 requests")
    for offset, key, label in ((-0.27, "batch1_tok_s", "kvserve"), (0.0, "hf_batch1_tok_s", "transformers"),
                               (0.27, "batch1_limit_tok_s", "bandwidth limit")):
        ax2.bar([x + offset for x in xs], [data[d][key] for d in dtypes], 0.27, label=label)
    ax2.set(xticks=list(xs), xticklabels=dtypes, ylabel="tok/s", title="batch-1 decode")
    for ax in (ax1, ax2):
        ax.legend()
    _save(fig, path, f"throughput; {where}")


def plot_prefix(data: dict, path: Path, where: str) -> None:
    fig, ax = _figure()
    modes = ["no_cache", "cold_cache", "warm_cache"]
    ax.bar(modes, [data[m]["median_ttft_s"] * 1e3 for m in modes])
    ax.set(ylabel="median time to first token (ms)")
    _save(fig, path, f"prefix caching, {data['dtype']}; {where}; hit rate {data['prefix_hit_rate']:.0%}")


def plot_offload(data: dict, path: Path, where: str) -> None:
    fig, ax = _figure()
    modes = ["no_prefix_cache", "prefix_cache", "disk_tier", "after_restart"]
    xs = range(len(modes))
    for offset, key in ((-0.27, "mean"), (0.0, "p50"), (0.27, "p99")):
        ax.bar([x + offset for x in xs], [data[m][f"{key}_ttft_s"] * 1e3 for m in modes], 0.27, label=key)
    ax.set(xticks=list(xs), xticklabels=modes, ylabel="time to first token (ms)")
    ax.tick_params(axis="x", labelsize=7)
    ax.legend()
    _save(fig, path, f"multi-document QA, a disk KV tier, {data['dtype']}; {where}; mean TTFT "
                     f"{data['ttft_speedup']:.1f}x lower than prefix caching alone")


def plot_capacity(data: dict, path: Path, where: str) -> None:
    fig, (ax1, ax2) = _figure(2)
    modes = ["contiguous", "paged"]
    ax1.bar(modes, [data[m]["peak_concurrent"] for m in modes])
    ax1.set(ylabel="peak concurrent requests")
    ax2.bar(modes, [data[m]["waste_pct"] for m in modes])
    ax2.set(ylabel="reserved KV holding no token (%)")
    _save(fig, path, f"capacity under one KV budget, {data['dtype']}; {where}")


def plot_serve(data: dict, path: Path, where: str) -> None:
    fig, (ax1, ax2) = _figure(2)
    rows = data["rows"]
    cs = [r["concurrency"] for r in rows]
    for key in ("ttft_p50", "ttft_p99", "tpot_p50", "itl_p99"):
        ax1.plot(cs, [r[key] for r in rows], marker="o", label=key)
    ax1.set(xscale="log", yscale="log", xlabel="concurrent clients", ylabel="ms")
    ax1.legend()
    ax2.plot(cs, [r["output_tok_s"] for r in rows], marker="o", label="served")
    if "offline_tok_s_at_64" in data:
        ax2.scatter([64], [data["offline_tok_s_at_64"]], marker="x", color="black", label="offline LLM.generate")
    ax2.set(xscale="log", xlabel="concurrent clients", ylabel="output tok/s")
    ax2.legend(fontsize=7)
    _save(fig, path, f"serving; {where}")


def plot_attention(data: dict, path: Path, where: str) -> None:
    from kvserve.bench.attention import plot

    plot(data["rows"], str(path), f"{data['dtype']} on {data['device']}")


def plot_quant(data: dict, path: Path, where: str) -> None:
    fig, (ax1, ax2) = _figure(2)
    rows = data["rows"]
    for r in rows:
        ax1.scatter(r["bytes_per_token"], r["perplexity"], s=40)
        ax1.annotate(r["kv_cache_dtype"], (r["bytes_per_token"], r["perplexity"]), textcoords="offset points",
                     xytext=(4, 4))
    ax1.set(xlabel="KV bytes per token (scales included)", ylabel="held-out perplexity through the cache")
    names = [r["kv_cache_dtype"] for r in rows]
    ax2.bar(names, [r["decode_tok_s"] for r in rows])
    ax2.set(ylabel="decode tok/s")
    _save(fig, path, f"quantized KV pages, {data['dtype']}, block {data['block_size']}; {where}")


def plot_eviction(data: dict, path: Path, where: str) -> None:
    fig, (ax1, ax2) = _figure(2)
    context = data["context"]
    shown = min(data["budgets"], key=lambda b: abs(b - 0.2))   # one budget's curves, and the full cache's
    for r in data["rows"]:
        if r.get("segments") and (r["policy"] == "full" or r["budget"] == shown):
            xs = [context * (i + 0.5) for i in range(len(r["segments"]))]
            label = r["policy"] if r["policy"] == "full" else f"{r['policy']} {r['budget']:.0%}"
            style = dict(color="black", linestyle="--") if r["policy"] == "recompute" else {}
            ax1.plot(xs, r["segments"], marker="o", label=label, **style)
    ax1.axvline(context, color="grey", linestyle=":", linewidth=1)
    ax1.set(xlabel="position (tokens)", ylabel="perplexity per context-long segment", yscale="log")
    ax1.legend(fontsize=7)
    for policy in ("sink", "h2o", "h2o-sum", "snapkv"):
        rows = sorted((r for r in data["rows"] if r["policy"] == policy), key=lambda r: r["budget"])
        ax2.plot([r["budget"] for r in rows], [r["passkey_acc"] for r in rows], marker="o", label=policy)
    full = next(r for r in data["rows"] if r["policy"] == "full")
    ax2.axhline(full["passkey_acc"], color="grey", linestyle=":", label="full cache")
    ax2.set(xlabel="budget (share of the context)", ylabel="passkey accuracy", ylim=(-0.05, 1.05))
    ax2.legend(fontsize=7)
    _save(fig, path, f"eviction, {data.get('dtype', '')}, context {context}; {where}")


PLOTS = {"decode": plot_decode, "throughput": plot_throughput, "prefix": plot_prefix, "offload": plot_offload,
         "capacity": plot_capacity,
         "serve": plot_serve, "attention": plot_attention, "quant": plot_quant, "eviction": plot_eviction}
