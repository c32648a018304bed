"""Replicas behind vLLM's router: prefix hit rate, TTFT and throughput of round robin and cache_aware, each with and
without the shared Redis tier, beside one replica with both pools.

The workload is multi-tenant: `--tenants` long system prompts, each followed by `--questions` short questions,
arriving interleaved in a seeded random order, streamed by `--concurrency` clients through `vllm-router` to
`--replicas` `kvserve serve` processes on this machine. Each replica's pool holds about half the tenants' system
prompts: round robin sends every tenant to every replica, whose pool evicts what the next request needs; the
shared tier (`--kv-offload redis://...`, written through) serves those blocks to whichever replica asks;
cache_aware keeps each tenant on one replica. The reference is one replica with the pools of all of them
(`--num-kv-blocks` times the replicas): the hit rate a single cache would get. The hit rate is the prompt tokens
found cached (in a pool, or in the tier past the pool's hits) over the prompt tokens looked up, from each
replica's /metrics. Each run starts its own processes (and a redis-server of its own unless --redis-url).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvserve.arg_utils import write_json
from kvserve.bench.common import print_table
from kvserve.bench.serve import MODEL_NAME, RequestResult, free_port, one_request, wait_healthy
from kvserve.extras import optional_import

NAME = "replicas"
# (label, router policy, the shared tier); "one replica" is the reference, with every replica's pool
SETUPS = (("round robin", "round_robin", False), ("round robin + tier", "round_robin", True),
          ("cache_aware", "cache_aware", False), ("cache_aware + tier", "cache_aware", True),
          ("one replica", None, False))
# prompt text: words the demo model's tokenizer knows, a few tokens each
WORDS = ("cache block prefix token model replica router request tenant system prompt answer question layer "
         "memory page server engine batch step value key store load write read share route policy").split()


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint each replica serves (default: the bundled demo model)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--tenants", type=int, default=8, help="system prompts (default 8)")
    p.add_argument("--questions", type=int, default=8, help="questions per tenant (default 8)")
    p.add_argument("--system-len", type=int, default=768, help="tokens of a system prompt (default 768)")
    p.add_argument("--question-len", type=int, default=24)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=4, help="clients streaming at once (default 4)")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="each replica's pool (default: about half the tenants' system prompts)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--runs", type=int, default=1, help="runs of every setup, in turns; medians reported")
    p.add_argument("--redis-url", default=None, help="a Redis server to use (default: start redis-server)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of each replica (default 1)")


# ---- the processes -----------------------------------------------------------------------------------------

class RedisServer:
    """redis-server on 127.0.0.1 at a free port, keeping nothing on disk; `extra`: its directives."""

    def __init__(self, workdir: Path, extra: list[str] | None = None):
        binary = shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError("redis-server is not installed (Debian: apt-get install redis-server)")
        self.binary, self.workdir, self.extra = binary, workdir, extra or []
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        redis = optional_import("redis", "a Redis server's client")
        self.proc = subprocess.Popen([self.binary, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "",
                                      "--appendonly", "no", "--dir", str(self.workdir), *self.extra],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while True:
            try:
                self.client().ping()
                return
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.05)

    def client(self):
        return optional_import("redis", "a Redis server's client").Redis(host="127.0.0.1", port=self.port)

    def kill(self) -> None:
        """Stop it at once, as a crash would (SIGKILL)."""
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait()


@dataclass
class Cluster:
    """Replicas (`kvserve serve`) behind a router (`vllm-router`); `url` is the router's."""

    replicas: list[subprocess.Popen]
    replica_urls: list[str]
    router: subprocess.Popen | None
    url: str

    def stop(self) -> None:
        for proc in [*self.replicas, self.router]:
            if proc is not None and proc.poll() is None:
                proc.terminate()
        for proc in [*self.replicas, self.router]:
            if proc is not None:
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def start_replicas(n: int, engine_args: list[str], logs: Path, threads: int = 1) -> tuple[list, list[str]]:
    """`n` replicas of `kvserve serve --served-model-name bench-model ENGINE_ARGS`, each on a free port with
    `threads` torch threads, logging to `logs`; returned once every one answers /health."""
    procs, urls = [], []
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(threads)}
    for i in range(n):
        port = free_port()
        cmd = [sys.executable, "-m", "kvserve.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
               "--served-model-name", MODEL_NAME, "--log-level", "warning", *engine_args]
        with open(logs / f"replica-{port}.log", "w") as log:
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
        urls.append(f"http://127.0.0.1:{port}")
    try:
        for proc, url in zip(procs, urls):
            wait_healthy(proc, url, "a replica")
    except BaseException:
        Cluster(procs, urls, None, "").stop()
        raise
    return procs, urls


def router_binary() -> str:
    """vllm-router's command; FileNotFoundError naming its package where it is not installed."""
    binary = shutil.which("vllm-router")
    if binary is None:
        raise FileNotFoundError("vllm-router is not installed: pip install 'kvserve[bench]' (the vllm-router package)")
    return binary


def start_router(worker_urls: list[str], policy: str, logs: Path) -> tuple[subprocess.Popen, str]:
    """vllm-router with `policy` over the replicas at `worker_urls`, on a free port; returned once it answers."""
    port = free_port()
    cmd = [router_binary(), "--host", "127.0.0.1", "--port", str(port), "--policy", policy, "--worker-urls",
           *worker_urls, "--log-level", "warning", "--worker-startup-timeout-secs", "120"]
    with open(logs / f"router-{port}.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, "vllm-router")
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc, url


def scrape(url: str) -> dict[str, float]:
    """A replica's /metrics: each sample's value by its name (labels aside, summed)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        text = r.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.split("{")[0].split(" ")[0], line.rsplit(" ", 1)[1]
            values[name] = values.get(name, 0.0) + float(value)
    return values


# ---- the workload ------------------------------------------------------------------------------------------

def text_of(tokens: int, rng: random.Random, tokenizer) -> str:
    """Random words of about `tokens` tokens (by `tokenizer`)."""
    words: list[str] = []
    while len(tokenizer.encode(" ".join(words))) < tokens:
        words += rng.choices(WORDS, k=max(1, (tokens - len(tokenizer.encode(" ".join(words)))) // 2))
    return " ".join(words)


def workload(args: argparse.Namespace, seed: int, tokenizer) -> list[str]:
    """Every tenant's questions after its system prompt, in a seeded random order (tenants interleaved)."""
    rng = random.Random(seed)
    systems = [f"Tenant {t} ({seed}). " + text_of(args.system_len, rng, tokenizer) for t in range(args.tenants)]
    prompts = [f"{system}\nQuestion: {text_of(args.question_len, rng, tokenizer)}\nAnswer:"
               for system in systems for _ in range(args.questions)]
    rng.shuffle(prompts)
    return prompts


async def _run_clients(url: str, prompts: list[str], output_len: int, concurrency: int) -> list[RequestResult]:
    aiohttp = optional_import("aiohttp", "kvserve bench replicas")
    queue = list(reversed(prompts))
    results: list[RequestResult] = []

    async def client(session) -> None:
        while queue:
            results.append(await one_request(session, url, queue.pop(), output_len))

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
    return results


def measure(cluster: Cluster, prompts: list[str], args: argparse.Namespace) -> dict:
    """Run the prompts through the cluster: TTFT, throughput, and the replicas' prefix hit rate over the run."""
    before = [scrape(u) for u in cluster.replica_urls]
    start = time.perf_counter()
    results = asyncio.run(_run_clients(cluster.url, prompts, args.output_len, args.concurrency))
    duration = time.perf_counter() - start
    after = [scrape(u) for u in cluster.replica_urls]

    def delta(name: str) -> float:
        return sum(a.get(name, 0.0) - b.get(name, 0.0) for a, b in zip(after, before))

    ok = [r for r in results if r.ok]
    queried = delta("kvserve:prefix_cache_queries_total")
    pool, tier = delta("kvserve:prefix_cache_hits_total"), delta("kvserve:kv_offload_hit_tokens_total")
    ttft = [r.ttft * 1e3 for r in ok]
    done = "kvserve:request_success_total"
    serving = sum(a.get(done, 0.0) > b.get(done, 0.0) for a, b in zip(after, before))
    return {"requests": len(results), "errors": len(results) - len(ok), "replicas_serving": serving,
            "hit_rate": (pool + tier) / queried if queried else float("nan"),
            "pool_hit_rate": pool / queried if queried else float("nan"),
            "tier_hit_rate": tier / queried if queried else float("nan"),
            "ttft_mean_ms": statistics.fmean(ttft) if ttft else float("nan"),
            "ttft_p90_ms": float(np.percentile(ttft, 90)) if ttft else float("nan"),
            "output_tok_s": sum(r.output_tokens for r in ok) / duration, "request_s": len(ok) / duration}


# ---- the run -----------------------------------------------------------------------------------------------

def _engine_args(args: argparse.Namespace, blocks: int, redis_url: str | None) -> list[str]:
    out = ["--num-kv-blocks", str(blocks), "--block-size", str(args.block_size), "--max-num-seqs", "16",
           "--max-model-len", str(args.system_len + args.question_len + args.output_len + 64),
           "--preemption-mode", "recompute"]
    if args.model:
        out += ["--model", args.model]
    if redis_url is not None:
        out += ["--kv-offload", redis_url, "--kv-offload-size", "4GiB"]
    return out


def run(args: argparse.Namespace) -> int:
    optional_import("aiohttp", "kvserve bench replicas")
    router_binary()
    from kvserve.model.loader import load_tokenizer, resolve_model

    if args.quick:
        args.tenants, args.questions, args.system_len, args.runs = 4, 4, 256, 1
    blocks = args.num_kv_blocks or (args.tenants * -(-args.system_len // args.block_size)) // 2 + 16
    tokenizer = load_tokenizer(resolve_model(args.model))
    print(f"replicas: {args.replicas} replicas of {blocks} KV blocks of {args.block_size} tokens behind vllm-router; "
          f"{args.tenants} tenants' {args.system_len}-token system prompts, {args.questions} questions each "
          f"({args.question_len} tokens, {args.output_len} out), interleaved, {args.concurrency} clients; "
          f"{args.runs} run(s) of each setup")
    runs: dict[str, list[dict]] = {label: [] for label, _, _ in SETUPS}
    with tempfile.TemporaryDirectory(prefix="kvserve-bench-replicas-") as tmp:
        logs = Path(tmp)
        redis = None if args.redis_url else RedisServer(logs)
        redis_url = args.redis_url or redis.url
        try:
            for r in range(args.runs):
                for i, (label, policy, tier) in enumerate(SETUPS):
                    if tier:         # a tier that starts empty, as the pools do
                        optional_import("redis", "the Redis tier").Redis.from_url(redis_url).flushdb()
                    prompts = workload(args, seed=1000 * r + i, tokenizer=tokenizer)
                    runs[label].append(_one_setup(args, policy, blocks, redis_url if tier else None, prompts, logs))
                    print(f"  run {r + 1}, {label}: {_brief(runs[label][-1])}", flush=True)
        finally:
            if redis is not None:
                redis.stop()
    rows = {label: _median(results) for label, results in runs.items()}
    report = {"replicas": args.replicas, "num_kv_blocks": blocks, "block_size": args.block_size,
              "tenants": args.tenants, "questions": args.questions, "system_len": args.system_len,
              "question_len": args.question_len, "output_len": args.output_len, "concurrency": args.concurrency,
              "runs": runs, "rows": rows}
    print_report(report)
    write_json(args.json_path, report)
    return 0


def _one_setup(args, policy: str | None, blocks: int, redis_url: str | None, prompts: list[str], logs: Path) -> dict:
    """Start the setup's processes, warm them up (a prompt of no tenant's), measure, stop them."""
    n = args.replicas if policy else 1
    procs, urls = start_replicas(n, _engine_args(args, blocks if policy else blocks * args.replicas, redis_url),
                                 logs, args.threads)
    router, url = (None, urls[0])
    cluster = Cluster(procs, urls, None, url)
    try:
        if policy:
            router, url = start_router(urls, policy, logs)
            cluster = Cluster(procs, urls, router, url)
        asyncio.run(_run_clients(url, ["warm up " * 8] * (2 * n), args.output_len, n))
        return measure(cluster, prompts, args)
    finally:
        cluster.stop()


def _median(results: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in results) for k in results[0]}


def _brief(row: dict) -> str:
    return (f"hit rate {row['hit_rate']:.2f}, mean TTFT {row['ttft_mean_ms']:.0f} ms, "
            f"{row['output_tok_s']:.0f} tok/s, {row['errors']} errors")


def print_report(report: dict) -> None:
    cols = ["setup", "hit_rate", "pool_hit_rate", "tier_hit_rate", "ttft_mean_ms", "ttft_p90_ms", "output_tok_s",
            "request_s", "replicas_serving", "errors"]
    rows = [[label, *(f"{row[c]:.3f}" if "rate" in c else f"{row[c]:.1f}" if isinstance(row[c], float)
                      else str(row[c]) for c in cols[1:])] for label, row in report["rows"].items()]
    print_table(cols, rows)
    rows = report["rows"]
    one, rr, tier = rows["one replica"], rows["round robin"], rows["round robin + tier"]
    within = tier["hit_rate"] >= 0.9 * one["hit_rate"]
    faster = rr["ttft_mean_ms"] / tier["ttft_mean_ms"]
    print(f"round robin + tier: hit rate {tier['hit_rate']:.3f} vs one replica's {one['hit_rate']:.3f} (target: "
          f"within 10%: {'met' if within else 'NOT met'}); mean TTFT {faster:.2f}x lower than round robin alone "
          f"(target 2x: {'met' if faster >= 2 else 'NOT met'})")
