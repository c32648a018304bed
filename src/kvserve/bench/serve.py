"""Serving under load: TTFT, TPOT, ITL and throughput of streaming clients at several concurrencies.

Metrics follow vLLM's `bench serve`: TTFT is the time from sending a request to its first streamed
token, TPOT is (latency - TTFT) / (output tokens - 1) per request, ITL is every gap between streamed
chunks. Unless --url is given, the server runs in a subprocess (`kvserve serve`) so that the
clients do not share the engine's interpreter.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np

from kvserve.arg_utils import write_json
from kvserve.bench.common import print_table, random_prompts
from kvserve.extras import optional_import

if TYPE_CHECKING:   # imported where used (the bench extra): every kvserve command builds this module's parser
    import aiohttp

NAME = "serve"
CONCURRENCIES = (1, 16, 64, 256)
COMPARED = 64               # the concurrency whose throughput is held to offline LLM.generate's
MODEL_NAME = "bench-model"


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    latency: float = 0.0
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=None, help="target a running server instead of starting one")
    p.add_argument("--model", default=None, help="checkpoint to serve (default: the bundled demo model)")
    p.add_argument("--concurrency", default=None, help="comma-separated (default 1,16,64,256)")
    p.add_argument("--requests", type=int, default=None, help="per concurrency (default max(2c, 32))")
    p.add_argument("--request-rate", type=float, default=None,
                   help="Poisson arrivals per second (default: all at once, capped by the concurrency)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--repeats", type=int, default=None,
                   help="served and offline runs at concurrency 64, in turns (default 3; quick: 1)")


def _aiohttp() -> ModuleType:
    """The clients' HTTP library, from the bench extra (vLLM's bench uses it too: little CPU per stream)."""
    return optional_import("aiohttp", "kvserve bench serve")


async def one_request(session: aiohttp.ClientSession, url: str, prompt: list[int] | str,
                      output_len: int) -> RequestResult:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    aiohttp = _aiohttp()
    start = time.perf_counter()
    res, last, pending = RequestResult(ok=False), None, b""
    try:
        async with session.post(f"{url}/v1/completions", json=body) as r:
            if r.status != 200:
                return res
            async for data in r.content.iter_any():
                *events, pending = (pending + data).split(b"\n\n")
                for event in events:
                    if not event.startswith(b"data: ") or event == b"data: [DONE]":
                        continue
                    chunk = json.loads(event[6:])
                    now = time.perf_counter()
                    if chunk.get("usage"):
                        res.output_tokens = chunk["usage"]["completion_tokens"]
                    if not chunk.get("choices"):
                        continue
                    if last is None:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
        res.latency = time.perf_counter() - start
        res.ok = res.output_tokens > 0
    except aiohttp.ClientError:
        res.ok = False
    return res


async def run_load(url: str, prompts: list[list[int]], output_len: int, concurrency: int,
                   rate: float | None) -> tuple[list[RequestResult], float]:
    limit = asyncio.Semaphore(concurrency)
    rng = np.random.default_rng(0)

    async def limited(session, prompt, delay):
        await asyncio.sleep(delay)
        async with limit:
            return await one_request(session, url, prompt, output_len)

    aiohttp = _aiohttp()
    delays = np.cumsum(rng.exponential(1 / rate, len(prompts))) if rate else np.zeros(len(prompts))
    connector = aiohttp.TCPConnector(limit=concurrency + 8)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        start = time.perf_counter()
        results = await asyncio.gather(*(limited(session, p, d) for p, d in zip(prompts, delays)))
        return results, time.perf_counter() - start


def summarize(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    pct = lambda xs, q: float(np.percentile(xs, q)) * 1e3 if xs else float("nan")  # noqa: E731
    ttft = [r.ttft for r in ok]
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [x for r in ok for x in r.itl]
    out_tokens = sum(r.output_tokens for r in ok)
    row = {"requests": len(results), "errors": len(results) - len(ok), "duration_s": duration,
           "request_s": len(ok) / duration, "output_tok_s": out_tokens / duration}
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl)):
        for q in (50, 90, 99):
            row[f"{name}_p{q}"] = pct(xs, q)
    return row


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace, max_model_len: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "kvserve.cli", "serve", "--port", str(port), "--served-model-name", MODEL_NAME,
           "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", str(max_model_len), "--dtype", args.dtype,
           "--log-level", "warning"]
    if args.model:
        cmd += ["--model", args.model]
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, "the server")
    except BaseException:
        proc.kill()
        raise
    return proc, url


def wait_healthy(proc: subprocess.Popen, url: str, what: str, timeout: float = 300) -> None:
    """Return once `url`/health answers 200; RuntimeError naming `what` if the process exits or `timeout`
    seconds pass first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"{what} did not come up within {timeout:.0f} s")


class Offline:
    """LLM.generate on a served workload, for comparison: the same requests, at most `concurrency` in
    flight (as many as the clients keep), so that the engine's batches are the same and the difference
    is what serving costs."""

    def __init__(self, args: argparse.Namespace, max_model_len: int, concurrency: int):
        from kvserve import LLM, SamplingParams

        self.llm = LLM(args.model, dtype=args.dtype, max_num_seqs=min(concurrency, args.max_num_seqs),
                       max_model_len=max_model_len)
        self.params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)

    def tok_s(self, prompts: list[list[int]]) -> float:
        """Generated tokens/s (after a warm-up of two requests that share no prefix with the prompts)."""
        self.llm.generate([{"prompt_token_ids": p[::-1]} for p in prompts[:2]], self.params, use_tqdm=False)
        start = time.perf_counter()
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], self.params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def vocab_size(args: argparse.Namespace) -> int:
    from kvserve.config import ModelConfig
    from kvserve.model.loader import resolve_model

    return ModelConfig.from_path(resolve_model(args.model)).vocab_size


def run(args: argparse.Namespace) -> int:
    _aiohttp()      # a missing bench extra fails before the server starts
    concurrencies = [int(c) for c in args.concurrency.split(",")] if args.concurrency else \
        ([1, 4, 16] if args.quick else list(CONCURRENCIES))
    if args.quick:
        args.prompt_len, args.output_len = min(args.prompt_len, 32), min(args.output_len, 16)
    repeats = args.repeats or (1 if args.quick else 3)
    max_model_len = args.prompt_len + args.output_len
    print(f"serve: {args.prompt_len}-token prompts, {args.output_len} output tokens, streaming completions; "
          f"concurrency {concurrencies}")
    proc, url = (None, args.url) if args.url else start_server(args, max_model_len)
    rows, report = [], {"prompt_len": args.prompt_len, "output_len": args.output_len}
    try:
        for c in concurrencies:
            n = args.requests or max(2 * c, 8 if args.quick else 32)
            vocab = vocab_size(args) if not args.url else 256
            # fresh prompts for every run: a prompt seen before would be served from the prefix cache
            prompts = random_prompts(n, args.prompt_len, vocab, seed=c)
            asyncio.run(run_load(url, [prompts[0][::-1]], args.output_len, 1, None))      # warm-up
            if c != COMPARED or args.url:
                results, duration = asyncio.run(run_load(url, prompts, args.output_len, c, args.request_rate))
                rows.append({"concurrency": c, **summarize(results, duration)})
                continue
            # served and offline in turns (the server idles meanwhile); the medians of each are compared
            offline, served, offline_tok_s = Offline(args, max_model_len, c), [], []
            for r in range(repeats):
                prompts = random_prompts(n, args.prompt_len, vocab, seed=1000 * c + r)
                results, duration = asyncio.run(run_load(url, prompts, args.output_len, c, args.request_rate))
                served.append({"concurrency": c, **summarize(results, duration)})
                offline_tok_s.append(offline.tok_s(prompts))
            del offline
            rows.append(sorted(served, key=lambda r: r["output_tok_s"])[len(served) // 2])
            report.update(served_tok_s_at_64=[r["output_tok_s"] for r in served], offline_tok_s_runs=offline_tok_s,
                          offline_tok_s_at_64=statistics.median(offline_tok_s))
            report["served_over_offline_at_64"] = rows[-1]["output_tok_s"] / report["offline_tok_s_at_64"]
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
    report["rows"] = rows
    print_report(report)
    write_json(args.json_path, report)
    return 0


def print_report(report: dict) -> None:
    cols = ["concurrency", "requests", "errors", "ttft_p50", "ttft_p90", "ttft_p99", "tpot_p50", "tpot_p99",
            "itl_p50", "itl_p99", "request_s", "output_tok_s"]
    rows = [[f"{r[c]:.1f}" if isinstance(r[c], float) else str(r[c]) for c in cols] for r in report["rows"]]
    print("latencies in ms")
    print_table(cols, rows)
    if "offline_tok_s_at_64" in report:
        ratio = report["served_over_offline_at_64"]
        runs = lambda xs: ", ".join(f"{x:.0f}" for x in xs)  # noqa: E731
        print(f"concurrency 64, served and offline LLM.generate in turns (at most 64 requests in flight): served "
              f"{runs(report['served_tok_s_at_64'])} tok/s, offline {runs(report['offline_tok_s_runs'])} tok/s; "
              f"served / offline = {ratio:.2f} (medians; target: within 15%: {'met' if ratio >= 0.85 else 'NOT met'})")
    print(f"errors: {sum(r['errors'] for r in report['rows'])} in all")
