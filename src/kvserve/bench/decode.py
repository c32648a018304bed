"""Time per generated token against position: no cache (recompute the prefix) vs the paged KV cache.

Without a cache, step t recomputes all prompt + t tokens, so a token's cost grows linearly with its
position; with the cache, a step computes one new token and reads the cached K/V, so it stays nearly flat.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import numpy as np

from kvserve.arg_utils import write_json
from kvserve.bench.common import (add_model_args, describe_shape, make_checkpoint, model_shape, print_table,
                                  random_prompts, step_times)
from kvserve.config import ATTENTION_BACKENDS
from kvserve.llm import LLM

NAME = "decode"
MODES = ("none", "paged")
POSITIONS = (1, 128, 256, 512, 1024)
TARGET_SPEEDUP = 20.0      # total time, no cache / paged, for TARGET_TOKENS generated tokens
TARGET_TOKENS = 1024
_WINDOW = 8      # a position's time is the median of the steps within this many positions of it
_WARMUP_TOKENS = 4


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=None, help="tokens to generate (default 1024; quick: 256)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS)
    add_model_args(p)


def at_position(times: list[float], pos: int) -> float:
    """Median step time (s) of decode tokens near generated-token number `pos` (1-based), prefill excluded."""
    lo, hi = max(2, pos - _WINDOW), min(len(times), pos + _WINDOW)
    return statistics.median(times[lo - 1:hi])


def summarize(times: list[float], positions: list[int]) -> dict:
    decode_pos = np.arange(2, len(times) + 1)
    slope = np.polyfit(decode_pos, np.array(times[1:]) * 1e3, 1)[0] * 100
    at = {p: at_position(times, p) for p in positions}
    return {
        "total_s": sum(times),
        "first_token_s": times[0],
        "at_positions_ms": {str(p): t * 1e3 for p, t in at.items()},
        "slope_ms_per_100_positions": float(slope),
        "growth_last_over_first": at[positions[-1]] / at[positions[0]],
        "per_token_ms": [t * 1e3 for t in times],
    }


def measure(path: Path, mode: str, prompt: list[int], tokens: int, args: argparse.Namespace) -> list[float]:
    block_size = args.block_size
    # no prefix cache: the timed run computes the prompt that the warm-up computed too
    llm = LLM(str(path), dtype=args.dtype, device=args.device, cache_mode=mode, max_num_seqs=1,
              max_model_len=len(prompt) + tokens, block_size=block_size, enable_prefix_caching=False,
              num_kv_blocks=-(-(len(prompt) + tokens) // block_size), attention_backend=args.attention_backend)
    step_times(llm.engine, prompt, min(_WARMUP_TOKENS, tokens))
    return step_times(llm.engine, prompt, tokens)


def report(res: dict, positions: list[int], tokens: int) -> None:
    none, paged = res["none"], res["paged"]
    rows = [[str(p), f"{none['at_positions_ms'][str(p)]:.2f}", f"{paged['at_positions_ms'][str(p)]:.2f}",
             f"{none['at_positions_ms'][str(p)] / paged['at_positions_ms'][str(p)]:.1f}x"] for p in positions]
    print(f"ms per token: median of the decode steps within {_WINDOW} tokens of each position")
    print_table(["generated token", "no cache ms/token", "paged ms/token", "none / paged"], rows)
    print()
    speedup = res["speedup_cached_vs_none"]
    met = ("met" if speedup >= TARGET_SPEEDUP else "NOT met") if tokens >= TARGET_TOKENS else "not judged here"
    rows = [
        ["first token (prefill) ms", f"{none['first_token_s'] * 1e3:.2f}", f"{paged['first_token_s'] * 1e3:.2f}", ""],
        [f"total for {tokens} tokens s", f"{none['total_s']:.2f}", f"{paged['total_s']:.2f}",
         f"speedup {speedup:.1f}x (target >= {TARGET_SPEEDUP:.0f}x at {TARGET_TOKENS} tokens: {met})"],
        ["growth ms per 100 positions", f"{none['slope_ms_per_100_positions']:.3f}",
         f"{paged['slope_ms_per_100_positions']:.3f}", "linear fit of decode steps"],
        [f"growth last / first (token {positions[-1]} / {positions[0]})", f"{none['growth_last_over_first']:.2f}x",
         f"{paged['growth_last_over_first']:.2f}x", ""],
    ]
    print_table(["", "no cache", "paged", ""], rows)


def run(args: argparse.Namespace) -> int:
    tokens = args.tokens or (256 if args.quick else 1024)
    if tokens < 3:
        raise ValueError("--tokens must be at least 3: a first token and two decode steps to fit a slope")
    shape = model_shape(args)
    prompt = random_prompts(1, args.prompt_len, shape["vocab_size"])[0]
    positions = sorted({p for p in POSITIONS if p < tokens} | {tokens})
    print(f"decode: 1 request, {args.prompt_len}-token prompt, {tokens} generated tokens, {args.dtype}, "
          f"{describe_shape(shape)}")
    with tempfile.TemporaryDirectory(prefix="kvserve-bench-") as tmp:
        path = make_checkpoint(Path(tmp), shape, args.prompt_len + tokens)
        res: dict = {mode: summarize(measure(path, mode, prompt, tokens, args), positions) for mode in MODES}
    res["speedup_cached_vs_none"] = res["none"]["total_s"] / res["paged"]["total_s"]
    res["speedup_at_last_position"] = (res["none"]["at_positions_ms"][str(tokens)]
                                       / res["paged"]["at_positions_ms"][str(tokens)])
    res.update(generated_tokens=tokens, prompt_len=args.prompt_len, dtype=args.dtype, model=shape,
               target_speedup=TARGET_SPEEDUP, target_tokens=TARGET_TOKENS)
    report(res, positions, tokens)
    write_json(args.json_path, res)
    return 0
