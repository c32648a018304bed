"""Attention time and peak temporary memory against length: textbook, flash (paged) and torch SDPA.

Prefill: one sequence of L tokens attending causally to itself, its K/V in the paged cache.
Decode: a batch of sequences, one new token each, over contexts of L tokens in the paged cache;
SDPA first gathers each context into a contiguous copy (the gather the paged flash kernel avoids).
Peak temporary memory is the high-water mark of the bytes allocated during the call, from the
PyTorch profiler's memory events. The textbook is skipped where its L x L scores would not fit.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from kvserve.arg_utils import write_json
from kvserve.attention.batch import AttentionBatch
from kvserve.attention.flash import FlashBackend
from kvserve.attention.gather import gather_context
from kvserve.attention.native import NativeBackend
from kvserve.attention.textbook import TextbookBackend
from kvserve.bench.common import print_table
from kvserve.extras import pyplot
from kvserve.kv.pages import FullPages

NAME = "attention"
PREFILL_LENGTHS = (512, 1024, 2048, 4096, 8192, 16384)
DECODE_LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768)
BLOCK_SIZE = 16
TEXTBOOK_MEMORY_CAP = 12 * 2**30


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    # 4 heads sharing 1 KV head (GQA 4) keep the textbook's 16384 x 16384 scores within this machine's memory
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--decode-batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prefill-lengths", default=None, help="comma-separated (default 512..16384; quick: ..2048)")
    p.add_argument("--decode-lengths", default=None, help="comma-separated (default 1024..32768; quick: ..4096)")
    p.add_argument("--plot", default=None, help="write a PNG of time and memory against length")


def paged_case(batch: int, length: int, q_len: int, args, device) -> tuple:
    """Random q [B*q_len, H, D] and a paged cache holding `length` tokens per sequence, shuffled pages."""
    dtype = getattr(torch, args.dtype)
    per_seq = -(-length // BLOCK_SIZE)
    pages = torch.randperm(batch * per_seq, device=device)
    kv_cache = FullPages(torch.randn(2, args.kv_heads, batch * per_seq, BLOCK_SIZE, args.head_dim, dtype=dtype,
                                     device=device))
    tables = pages.view(batch, per_seq)
    q = torch.randn(batch * q_len, args.heads, args.head_dim, dtype=dtype, device=device)
    attn = AttentionBatch(num_decodes=batch if q_len == 1 else 0, slot_mapping=None, block_tables=tables,
                          context_lens=torch.full((batch,), length, device=device), query_lens=[q_len] * batch,
                          context_lens_list=[length] * batch, has_prefix=False)
    return q, kv_cache, attn


def runners(phase: str, q, kv_cache, attn: AttentionBatch, scale: float) -> dict:
    """The ways to compute the same attention, as zero-argument callables."""
    contiguous = lambda: gather_context(kv_cache, attn.block_tables, attn.context_lens_list[0])  # noqa: E731
    textbook, flash = TextbookBackend(), FlashBackend()
    if q.device.type == "cuda":   # on a GPU the flash row is the Triton kernels, reading the pages
        from kvserve.attention.triton import TritonBackend
        flash = TritonBackend()
        attn = AttentionBatch(attn.num_decodes, None, attn.block_tables, attn.context_lens, attn.query_lens,
                              attn.context_lens_list, has_prefix=True)
    b = len(attn.query_lens)

    def sdpa():
        k, v = contiguous().transpose(1, 2)                                  # [B, KVH, L, D]
        qb = q.view(b, -1, q.shape[1], q.shape[2]).transpose(1, 2)
        return F.scaled_dot_product_attention(qb, k, v, is_causal=phase == "prefill", scale=scale, enable_gqa=True)

    # textbook and flash read K/V from the pages (for prefill, the new tokens' K/V are there too)
    runs = {"textbook": lambda: textbook.forward(q, None, None, kv_cache, attn, scale),
            "flash": lambda: flash.forward(q, None, None, kv_cache, attn, scale),
            "sdpa": sdpa}
    if q.device.type == "cpu":    # the CPU's default: the C kernels over the pages
        runs["native"] = lambda: NativeBackend().forward(q, None, None, kv_cache, attn, scale)
    return runs


def peak_temp_bytes(fn, device: torch.device) -> int:
    """High-water mark of bytes allocated during fn(): CUDA's allocator stats, or on the CPU the
    profiler's memory events."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    level = peak = 0
    for _, nbytes in events:
        level += nbytes
        peak = max(peak, level)
    return peak


def measure(fn, repeats: int, device: torch.device) -> float:
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def rates(phase: str, batch: int, length: int, args, ms: float) -> dict:
    """Prefill: TFLOP/s of causal attention (2 matmuls over half the L x L pairs). Decode: GB/s of K/V read."""
    if phase == "prefill":
        return {"tflop_s": 2 * length * length * args.heads * args.head_dim / (ms * 1e-3) / 1e12}
    number = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    kv_bytes = batch * length * 2 * args.kv_heads * args.head_dim * number
    return {"gb_s": kv_bytes / (ms * 1e-3) / 1e9}


def textbook_bytes(phase: str, batch: int, length: int, heads: int) -> int:
    """Its float32 scores and probabilities, each [H, Lq, L]."""
    q_len = 1 if phase == "decode" else length
    return 2 * heads * q_len * length * 4 * (1 if phase == "prefill" else batch)


@torch.inference_mode()
def run(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    prefill = _lengths(args.prefill_lengths, PREFILL_LENGTHS, 2048 if args.quick else None)
    decode = _lengths(args.decode_lengths, DECODE_LENGTHS, 4096 if args.quick else None)
    scale = args.head_dim ** -0.5
    print(f"attention: {args.heads} heads ({args.kv_heads} KV), head_dim {args.head_dim}, {args.dtype}, "
          f"{device}; decode batch {args.decode_batch}; block size {BLOCK_SIZE}")
    rows = []
    for phase, lengths in (("prefill", prefill), ("decode", decode)):
        for length in lengths:
            batch = 1 if phase == "prefill" else args.decode_batch
            q, kv_cache, attn = paged_case(batch, length, length if phase == "prefill" else 1, args, device)
            for backend, fn in runners(phase, q, kv_cache, attn, scale).items():
                if backend == "textbook" and textbook_bytes(phase, batch, length, args.heads) > TEXTBOOK_MEMORY_CAP:
                    rows.append(dict(backend=backend, phase=phase, length=length, time_ms=None,
                                     peak_temp_bytes=None, skipped="scores would exceed the memory cap"))
                    continue
                ms = measure(fn, args.repeats, device)
                rows.append(dict(backend=backend, phase=phase, length=length, time_ms=ms,
                                 peak_temp_bytes=peak_temp_bytes(fn, device),
                                 **rates(phase, batch, length, args, ms)))
    report = {"rows": rows, "dtype": args.dtype, "device": str(device), "heads": args.heads,
              "kv_heads": args.kv_heads, "head_dim": args.head_dim, "decode_batch": args.decode_batch}
    report.update(targets(rows))
    print_report(report)
    write_json(args.json_path, report)     # before the figure, which needs the bench extra
    if args.plot:
        plot(rows, args.plot, f"{args.dtype} on {device}")
        print(f"wrote {args.plot}")
    return 0


def _lengths(given: str | None, default: tuple[int, ...], cap: int | None) -> list[int]:
    if given:
        return [int(x) for x in given.split(",")]
    return [n for n in default if cap is None or n <= cap]


def _row(rows, backend, phase, length):
    return next((r for r in rows if (r["backend"], r["phase"], r["length"]) == (backend, phase, length)), None)


def targets(rows: list[dict]) -> dict:
    """The three claims this bench checks, from the measured rows: flash prefill's peak memory and time
    against the textbook's, and paged decode's time against SDPA over a gathered copy."""
    out = {}
    longest = max(r["length"] for r in rows if r["phase"] == "prefill")
    tb, fl = _row(rows, "textbook", "prefill", longest), _row(rows, "flash", "prefill", longest)
    if tb and tb["peak_temp_bytes"] and fl["peak_temp_bytes"]:
        out["prefill_memory_ratio_textbook_over_flash"] = tb["peak_temp_bytes"] / fl["peak_temp_bytes"]
    timed_textbook = [r for r in rows if r["backend"] == "textbook" and r["phase"] == "prefill" and r["time_ms"]]
    out["prefill_time_flash_over_textbook"] = {
        r["length"]: _row(rows, "flash", "prefill", r["length"])["time_ms"] / r["time_ms"]
        for r in timed_textbook if r["length"] >= 2048}
    out["prefill_time_native_over_sdpa"] = {
        r["length"]: mine["time_ms"] / r["time_ms"]
        for r in rows if r["backend"] == "sdpa" and r["phase"] == "prefill" and (mine := _row(rows, "native", "prefill",
                                                                                                 r["length"]))}
    sdpa_decodes = [r for r in rows if r["backend"] == "sdpa" and r["phase"] == "decode"]
    for backend in ("flash", "native"):
        out[f"decode_time_{backend}_over_sdpa"] = {
            r["length"]: mine["time_ms"] / r["time_ms"]
            for r in sdpa_decodes if (mine := _row(rows, backend, "decode", r["length"]))}
    return out


def print_report(report: dict) -> None:
    fmt_ms = lambda x: "skipped" if x is None else f"{x:.2f}"  # noqa: E731
    fmt_mb = lambda x: "-" if x is None else f"{x / 2**20:.1f}"  # noqa: E731
    rate = lambda r: f"{r['tflop_s']:.3f} TFLOP/s" if "tflop_s" in r else (  # noqa: E731
        f"{r['gb_s']:.1f} GB/s" if "gb_s" in r else "-")
    table = [[r["phase"], str(r["length"]), r["backend"], fmt_ms(r["time_ms"]), fmt_mb(r["peak_temp_bytes"]), rate(r)]
             for r in report["rows"]]
    print_table(["phase", "length", "backend", "time ms", "peak temp MiB", "rate"], table)
    if "prefill_memory_ratio_textbook_over_flash" in report:
        ratio = report["prefill_memory_ratio_textbook_over_flash"]
        print(f"prefill temp memory textbook / flash at the longest measured length: {ratio:.0f}x "
              f"(target >= 50x at 16384: {'met' if ratio >= 50 else 'NOT met'})")
    for length, r in report["prefill_time_flash_over_textbook"].items():
        print(f"prefill {length}: flash / textbook time {r:.2f} (target <= 1: {'met' if r <= 1 else 'NOT met'})")
    for length, r in report.get("prefill_time_native_over_sdpa", {}).items():
        print(f"prefill {length}: native / SDPA time {r:.2f}")
    for length, r in report["decode_time_flash_over_sdpa"].items():
        native = report["decode_time_native_over_sdpa"].get(length)
        print(f"decode {length}: paged flash / SDPA-on-a-copy time {r:.2f} "
              f"(target <= 1.5: {'met' if r <= 1.5 else 'NOT met'})"
              + (f"; native / SDPA-on-a-copy {native:.2f}" if native is not None else ""))


def plot(rows: list[dict], path: str, label: str) -> None:
    plt = pyplot("bench attention --plot")
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for col, phase in enumerate(("prefill", "decode")):
        for backend in ("textbook", "flash", "sdpa", "native"):
            pts = [(r["length"], r["time_ms"], r["peak_temp_bytes"]) for r in rows
                   if r["phase"] == phase and r["backend"] == backend and r["time_ms"] is not None]
            if not pts:
                continue
            xs, ts, ms = zip(*pts)
            axes[0][col].plot(xs, ts, marker="o", label=backend)
            if all(m is not None for m in ms):
                axes[1][col].plot(xs, [m / 2**20 for m in ms], marker="o", label=backend)
        axes[0][col].set(title=f"{phase}: time", xlabel="tokens", ylabel="ms", xscale="log", yscale="log")
        axes[1][col].set(title=f"{phase}: peak temporary memory", xlabel="tokens", ylabel="MiB", xscale="log",
                         yscale="log")
        for ax in axes[:, col]:
            ax.legend()
            ax.grid(True, which="both", alpha=0.3)
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs"
    fig.suptitle(f"kvserve bench attention ({label}; {machine}; {time.strftime('%Y-%m-%d')})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
