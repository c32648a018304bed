"""Structured outputs' cost: decode tokens/s with and without a JSON schema, and the grammar masks' time per step.

`kvserve bench structured --shape tinyllama-1.1b` measures TinyLlama-1.1B's shape (random weights: the masks are
what is measured, not what the model writes).

The same greedy batch decodes free and under a JSON schema, alternately, in one engine (one step at a time
both ways: the multi-step C path never takes a constrained request). The masks of a step are computed in a
thread while the model runs; the engine counts the time spent filling them and the time the sampler waited for
them after the forward (the part on the critical path).
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import tempfile
import time
from pathlib import Path

from kvserve.arg_utils import write_json
from kvserve.bench.common import (add_model_args, describe_shape, make_checkpoint, model_shape, print_table,
                                  random_prompts)
from kvserve.llm import LLM
from kvserve.sampling import SamplingParams
from kvserve.structured import StructuredOutputsParams

NAME = "structured"
TARGET_SLOWDOWN = 0.10          # at batch 1: at most 10% fewer tokens/s under a schema
# records of several kinds of values: a random model's greedy tokens stay inside it for the whole run
SCHEMA = {"type": "object", "properties": {"records": {"type": "array", "items": {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0}, "name": {"type": "string"}, "score": {"type": "number"},
    "kind": {"enum": ["alpha", "beta", "gamma"]}, "tags": {"type": "array", "items": {"type": "string"}},
    "ok": {"type": "boolean"}}, "required": ["id", "name", "score", "kind", "tags", "ok"]}}}, "required": ["records"]}
_runs = itertools.count()


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batches", default="1,16", help="comma-separated batch sizes")
    p.add_argument("--tokens", type=int, default=None, help="decode tokens timed per run (default 32; quick: 8)")
    p.add_argument("--repeats", type=int, default=3, help="runs of each kind per batch size, alternated")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    add_model_args(p)


def timed_run(llm: LLM, prompts: list[list[int]], tokens: int, constraint) -> tuple[float, dict]:
    """Decode tokens/s of the batch once each has its first token, and the engine's grammar counters' growth."""
    engine = llm.engine
    params = SamplingParams(max_tokens=tokens + 1, temperature=0, ignore_eos=True, structured_outputs=constraint)
    seqs = [engine.add_request(f"structured-{next(_runs)}", {"prompt_token_ids": p}, params, final_only=True)
            for p in prompts]
    while any(s.num_output_tokens == 0 for s in seqs):
        engine.step()
    before, done = engine.stats(), sum(s.num_output_tokens for s in seqs)
    start = time.perf_counter()
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    elapsed = time.perf_counter() - start
    after = engine.stats()
    grown = {k: after[k] - before[k] for k in ("grammar_masks_overlapped", "grammar_mask_fill_seconds",
                                                "grammar_mask_wait_seconds")}
    return (sum(s.num_output_tokens for s in seqs) - done) / elapsed, {**grown, "steps": steps, "seconds": elapsed}


def measure(llm: LLM, batch: int, tokens: int, repeats: int, vocab_size: int, prompt_len: int) -> dict:
    prompts = random_prompts(batch, prompt_len, vocab_size, seed=batch)
    constraint = StructuredOutputsParams(json=SCHEMA)
    free, constrained, counters = [], [], []
    timed_run(llm, prompts, tokens, None)           # warm-up: the first steps of a batch size pay for allocations
    timed_run(llm, prompts, tokens, constraint)
    for _ in range(repeats):
        free.append(timed_run(llm, prompts, tokens, None)[0])
        rate, grown = timed_run(llm, prompts, tokens, constraint)
        constrained.append(rate)
        counters.append(grown)
    steps = sum(c["steps"] for c in counters)
    return {
        "batch": batch, "free_tokens_per_s": free, "schema_tokens_per_s": constrained,
        "ratio_of_medians": statistics.median(constrained) / statistics.median(free),
        "step_ms": 1e3 * sum(c["seconds"] for c in counters) / steps,
        "masks_per_step": sum(c["grammar_masks_overlapped"] for c in counters) / steps,
        "mask_fill_ms_per_step": 1e3 * sum(c["grammar_mask_fill_seconds"] for c in counters) / steps,
        "mask_wait_ms_per_step": 1e3 * sum(c["grammar_mask_wait_seconds"] for c in counters) / steps,
    }


def report(results: list[dict], setup_s: float) -> None:
    rows = [[str(r["batch"]), f"{statistics.median(r['free_tokens_per_s']):.1f}",
             f"{statistics.median(r['schema_tokens_per_s']):.1f}", f"{r['ratio_of_medians']:.3f}",
             f"{r['step_ms']:.1f}", f"{r['masks_per_step']:.1f}", f"{r['mask_fill_ms_per_step']:.3f}",
             f"{r['mask_wait_ms_per_step']:.3f}"] for r in results]
    print_table(["batch", "free tok/s", "schema tok/s", "schema / free", "step ms", "masks/step", "fill ms/step",
                 "waited ms/step"], rows)
    print(f"grammar engine set up for the vocabulary and the schema compiled: {setup_s:.2f} s (once per engine, "
          f"then per schema)")
    first = results[0]
    if first["batch"] == 1:
        met = "met" if first["ratio_of_medians"] >= 1 - TARGET_SLOWDOWN else "NOT met"
        print(f"batch 1: schema / free = {first['ratio_of_medians']:.3f} (target >= {1 - TARGET_SLOWDOWN:.2f}: {met})")


def run(args: argparse.Namespace) -> int:
    tokens = args.tokens or (8 if args.quick else 32)
    batches = [int(b) for b in args.batches.split(",")]
    shape = model_shape(args)
    print(f"structured: greedy batches {batches}, {args.prompt_len}-token prompts, {tokens} decode tokens a run, "
          f"{args.repeats} runs each way, {args.dtype}, {describe_shape(shape)}")
    with tempfile.TemporaryDirectory(prefix="kvserve-bench-") as tmp:
        length = args.prompt_len + tokens + 1
        path = make_checkpoint(Path(tmp), shape, length)
        llm = LLM(str(path), dtype=args.dtype, device=args.device, max_model_len=length, num_scheduler_steps=1,
                  max_num_seqs=max(batches), enable_prefix_caching=False)
        start = time.perf_counter()
        llm.engine.structured.grammar(SamplingParams(structured_outputs=StructuredOutputsParams(json=SCHEMA)))
        setup_s = time.perf_counter() - start
        results = [measure(llm, b, tokens, args.repeats, shape["vocab_size"], args.prompt_len) for b in batches]
    report(results, setup_s)
    write_json(args.json_path, {"results": results, "grammar_setup_s": setup_s, "tokens": tokens, "model": shape,
                                "dtype": args.dtype, "schema": SCHEMA, "target_slowdown": TARGET_SLOWDOWN})
    return 0
