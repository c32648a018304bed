"""Time to first token of requests that share a long system prompt, with and without prefix caching.

Each request is one system prompt followed by its own question (random token ids, fixed seeds) and
generates a few tokens greedily. Every engine first serves one request alone; then all the measured
requests arrive at once, as a burst on a server:
- no cache: prefix caching off (the first request was the system prompt with another question);
- cold cache: prefix caching on, the first request was unrelated, so the burst fills the cache itself
  (prompts admitted in the same step as the first to hold the system prompt cannot share it yet);
- warm cache: prefix caching on, the first request was the system prompt with another question, as on
  a server that has served this system prompt before.
TTFT = first_token_time - arrival_time of each measured request. The speedup is median TTFT with no
cache over median TTFT with the warm cache; the cold-cache speedup is reported beside it. The hit rate
is the warm cache's prefix_cache_hits / prefix_cache_queries over the measured requests.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from kvserve.arg_utils import write_json
from kvserve.bench.common import (add_model_args, describe_shape, make_checkpoint, model_shape, print_table,
                                  random_prompts)
from kvserve.config import ATTENTION_BACKENDS
from kvserve.kv.blocks import cdiv
from kvserve.llm import LLM
from kvserve.sampling import SamplingParams

NAME = "prefix"
MODES = ("no_cache", "cold_cache", "warm_cache")
TARGET_SPEEDUP = 5.0     # median TTFT, no cache / warm cache
TARGET_WORKLOAD = (32, 1024, 64)   # requests, system prompt and question tokens the target is set for


@dataclass
class Workload:
    requests: int
    system_len: int
    question_len: int
    tokens: int

    @property
    def prompt_len(self) -> int:
        return self.system_len + self.question_len

    @property
    def max_len(self) -> int:
        return self.prompt_len + self.tokens


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=None, help="measured requests (default 32; quick: 8)")
    p.add_argument("--system-len", type=int, default=None,
                   help="tokens of the shared system prompt (default 1024; quick: 256)")
    p.add_argument("--question-len", type=int, default=64, help="distinct tokens after the system prompt")
    p.add_argument("--tokens", type=int, default=16, help="generated per request")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS)
    add_model_args(p)


def workload(args: argparse.Namespace) -> Workload:
    w = Workload(args.requests or (8 if args.quick else 32), args.system_len or (256 if args.quick else 1024),
                 args.question_len, args.tokens)
    if min(w.requests, w.system_len, w.question_len, w.tokens) < 1:
        raise ValueError("--requests, --system-len, --question-len and --tokens must be at least 1")
    return w


def make_prompts(w: Workload, vocab_size: int) -> tuple[list[list[int]], list[int], list[int]]:
    """The measured prompts; a first request with the same system prompt; an unrelated one as long."""
    system = random_prompts(1, w.system_len, vocab_size, seed=0)[0]
    prompts = [system + q for q in random_prompts(w.requests + 1, w.question_len, vocab_size, seed=1)]
    return prompts[1:], prompts[0], random_prompts(1, w.prompt_len, vocab_size, seed=2)[0]


def serve(llm: LLM, prompts: list[list[int]], tokens: int) -> tuple[list[float], float]:
    """TTFT (s) of each prompt, all submitted at once, and the seconds until the last one finished."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    total = time.perf_counter() - start
    return [o.metrics["first_token_time"] - o.metrics["arrival_time"] for o in outs], total


def measure(path: Path, caching: bool, first: list[int], prompts: list[list[int]], w: Workload,
            args: argparse.Namespace) -> dict:
    """Serve `first` alone, then the burst of `prompts`; TTFTs, total time and hit rate of the burst."""
    llm = LLM(str(path), dtype=args.dtype, device=args.device, enable_prefix_caching=caching,
              max_model_len=w.max_len, block_size=args.block_size,
              num_kv_blocks=(w.requests + 1) * cdiv(w.max_len, args.block_size),   # no eviction, no preemption
              max_num_batched_tokens=args.max_num_batched_tokens, attention_backend=args.attention_backend)
    serve(llm, [first], w.tokens)
    before = llm.stats()
    ttft, total = serve(llm, prompts, w.tokens)
    after = llm.stats()
    queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    return {"median_ttft_s": statistics.median(ttft), "mean_ttft_s": statistics.mean(ttft), "max_ttft_s": max(ttft),
            "total_s": total, "prefix_hit_rate": hits / queries, "num_preemptions": after["num_preemptions"],
            "ttft_s": ttft}


def report(res: dict, w: Workload) -> None:
    modes = [res[m] for m in MODES]
    speedups = ["", f"{res['cold_ttft_speedup']:.1f}x", f"{res['ttft_speedup']:.1f}x"]
    met = "met" if res["ttft_speedup"] >= TARGET_SPEEDUP else "NOT met"
    if (w.requests, w.system_len, w.question_len) != TARGET_WORKLOAD:
        met = "not judged on this workload"
    rows = [
        ["median TTFT ms", *(f"{r['median_ttft_s'] * 1e3:.1f}" for r in modes), ""],
        ["mean | max TTFT ms", *(f"{r['mean_ttft_s'] * 1e3:.1f} | {r['max_ttft_s'] * 1e3:.1f}" for r in modes), ""],
        ["total s", *(f"{r['total_s']:.2f}" for r in modes), ""],
        ["prefix hit rate", *(f"{r['prefix_hit_rate']:.1%}" for r in modes),
         f"at most {res['max_hit_rate']:.1%} (full blocks of the system prompt)"],
        ["median TTFT speedup vs no cache", *speedups, f"warm: >= {TARGET_SPEEDUP:.0f}x ({met})"],
    ]
    print_table(["", "no cache", "cold cache", "warm cache", "target"], rows)


def run(args: argparse.Namespace) -> int:
    w = workload(args)
    shape = model_shape(args)
    prompts, first, unrelated = make_prompts(w, shape["vocab_size"])
    print(f"prefix: {w.requests} requests x ({w.system_len}-token shared system prompt + {w.question_len}-token "
          f"question), {w.tokens} generated each, greedy; one request served alone first, then all {w.requests} "
          f"at once; {args.dtype}, {describe_shape(shape)}")
    with tempfile.TemporaryDirectory(prefix="kvserve-bench-") as tmp:
        path = make_checkpoint(Path(tmp), shape, w.max_len)
        res: dict = {"no_cache": measure(path, False, first, prompts, w, args),
                     "cold_cache": measure(path, True, unrelated, prompts, w, args),
                     "warm_cache": measure(path, True, first, prompts, w, args)}
    none = res["no_cache"]["median_ttft_s"]
    res.update(ttft_speedup=none / res["warm_cache"]["median_ttft_s"],
               cold_ttft_speedup=none / res["cold_cache"]["median_ttft_s"],
               total_speedup=res["no_cache"]["total_s"] / res["warm_cache"]["total_s"],
               prefix_hit_rate=res["warm_cache"]["prefix_hit_rate"],
               max_hit_rate=w.system_len // args.block_size * args.block_size / w.prompt_len,
               target_ttft_speedup=TARGET_SPEEDUP, workload=asdict(w), model=shape, dtype=args.dtype)
    report(res, w)
    write_json(args.json_path, res)
    return 0
