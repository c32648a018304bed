"""Tensor parallelism: a decode step's time at TP=1 and TP=2, split into compute and communication.

Each row is a batch of greedy decodes on a random-weight model shaped like a real one (by default
TinyLlama's: hidden 2048, 22 layers, 32 heads, 4 KV heads). TP=1 runs twice: by its default executor
(on the CPU, the native C step) and op by op (eager, as every TP rank runs); TP=2 by eager_tp. Rank 0
times its collectives (kvserve.distributed.TensorParallel.comm_seconds): that time includes waiting
for the slower rank, so it is an upper bound of the pure communication. Two ranks sharing a few CPU
cores are not faster than one; docs/performance.md projects what the all-reduce count costs on GPUs.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from kvserve.bench.common import add_model_args, describe_shape, make_checkpoint, model_shape, print_table, \
    random_prompts, write_json
from kvserve.llm import LLM
from kvserve.sampling import SamplingParams

NAME = "tp"
# TinyLlama-1.1B's shape
SHAPE = {"hidden_size": 2048, "intermediate_size": 5632, "num_layers": 22, "num_heads": 32, "num_kv_heads": 4,
         "vocab_size": 32000}
RUNS = (("tp1", 1, False), ("tp1_eager", 1, True), ("tp2", 2, True))


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-sizes", default="1,64", help="comma-separated decode batch sizes")
    p.add_argument("--steps", type=int, default=None, help="decode steps timed per batch (default 8; quick: 3)")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    add_model_args(p, SHAPE)


def measure(llm: LLM, prompts: list[list[int]], steps: int) -> dict:
    """Median decode step of the batch (after its prefill and one warm-up step), and rank 0's collectives per
    step (none at TP=1)."""
    engine = llm.engine
    params = SamplingParams(max_tokens=steps + 2, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"tp{i}", {"prompt_token_ids": prompt}, params)
    engine.step()                                  # the prompts
    engine.step()                                  # warm-up
    tp = engine.model.tp
    times, comm, reduces = [], [], []
    for _ in range(steps):
        c0, n0 = (tp.comm_seconds, tp.num_all_reduces) if tp else (0.0, 0)
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
        if tp:
            comm.append(tp.comm_seconds - c0)
            reduces.append(tp.num_all_reduces - n0)
    while engine.has_unfinished_requests():
        engine.step()
    step = statistics.median(times)
    comm_s = statistics.median(comm) if comm else 0.0
    return {"step_ms": step * 1e3, "comm_ms": comm_s * 1e3, "compute_ms": (step - comm_s) * 1e3,
            "all_reduces_per_step": reduces[0] if reduces else 0, "comm_share": comm_s / step}


def run(args: argparse.Namespace) -> int:
    steps = args.steps or (3 if args.quick else 8)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    shape = model_shape(args)
    if args.quick:
        shape["num_layers"] = min(shape["num_layers"], 4)
    print(f"tp: decode steps at batch {', '.join(map(str, batches))}, {args.dtype}, {describe_shape(shape)}")
    res: dict = {"model": shape, "dtype": args.dtype, "steps": steps, "runs": {}}
    with tempfile.TemporaryDirectory(prefix="kvserve-bench-") as tmp:
        path = make_checkpoint(Path(tmp), shape, args.prompt_len + steps + 8)
        for name, size, eager in RUNS:
            # one decode step a call (num_scheduler_steps=1): a step's time is one token's
            llm = LLM(str(path), dtype=args.dtype, device=args.device, tensor_parallel_size=size,
                      enforce_eager=eager, max_num_seqs=max(batches), enable_prefix_caching=False,
                      num_scheduler_steps=1, num_kv_blocks=max(batches) * -(-(args.prompt_len + steps + 8) // 16),
                      skip_tokenizer_init=True)
            try:
                res["runs"][name] = {str(b): measure(llm, random_prompts(b, args.prompt_len, shape["vocab_size"], b),
                                                     steps) for b in batches}
            finally:
                llm.shutdown()
    rows = [[name, str(b), f"{r['step_ms']:.1f}", f"{r['compute_ms']:.1f}", f"{r['comm_ms']:.1f}",
             f"{r['comm_share']:.0%}", str(r["all_reduces_per_step"])]
            for name, by_batch in res["runs"].items() for b, r in ((int(k), v) for k, v in by_batch.items())]
    print_table(["run", "batch", "step ms", "compute ms", "collectives ms", "share", "all-reduces/step"], rows)
    write_json(args.json_path, res)
    return 0
