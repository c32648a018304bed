"""Decode tokens/s of the kernels built for each target (KVSERVE_MARCH: native, x86-64-v3), side by side in one run.

A random-weight model of a bench shape (TinyLlama-1.1B's by default) decodes batches of random prompts with each
weight format; each target's engines run in a process of their own (the library is built for the process's
target), the targets taking turns repeat by repeat, so that a busy machine slows them alike. Prints, per weight
format and batch, each target's median tok/s and its ratio to the first target's, with the GEMMs the engine chose
(the GEMM choice measures as it does for users unless KVSERVE_GEMM is set, or --vector-kernel forces each build's
own vector kernel, avx512 or avx2).

    python scripts/decode_by_march.py --shape tinyllama-1.1b --quantization none,int8,int4 --batches 1,16
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from kvserve import LLM
from kvserve.bench.common import SHAPES, decode_rate, make_checkpoint, random_prompts
from kvserve.kernels import MARCH_ENV
from kvserve.model.gemm_choice import GEMM_ENV
from kvserve.model.layers import gemm_kernels, vector_kernel


def worker(args: argparse.Namespace) -> None:
    """One target's engines (this process's KVSERVE_MARCH): a JSON line of tok/s by weight format and batch."""
    torch.set_num_threads(args.threads)
    if args.vector_kernel:
        os.environ[GEMM_ENV] = vector_kernel(gemm_kernels(getattr(torch, args.dtype)))
    out = {}
    for quantization in args.quantization.split(","):
        length, most = args.prompt_len + args.tokens + 2, max(args.batch_list)
        llm = LLM(args.path, dtype=args.dtype, quantization=None if quantization == "none" else quantization,
                  block_size=16, max_num_seqs=most, max_model_len=length, num_kv_blocks=most * (length // 16 + 2))
        rates = {}
        for batch in args.batch_list:
            prompts = random_prompts(batch, args.prompt_len, SHAPES[args.shape]["vocab_size"], seed=batch)
            decode_rate(llm, prompts, 2, repeats=1)           # warm-up: first touches, the GEMM choice's cache
            rates[batch] = decode_rate(llm, prompts, args.tokens, repeats=1)
        gemm = llm.stats()["gemm"]
        out[quantization] = {"tok_s": rates, "gemm": f"{gemm['weight_format']} ({gemm['source']})",
                             "steps": llm.stats()["steps"]}
        llm.shutdown()
        del llm
    print(json.dumps(out), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="tinyllama-1.1b", choices=sorted(SHAPES))
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--marches", default="native,x86-64-v3", help="comma-separated KVSERVE_MARCH targets")
    p.add_argument("--quantization", default="none,int8,int4")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--tokens", type=int, default=32, help="decode tokens timed per sequence")
    p.add_argument("--repeats", type=int, default=3, help="runs of each target, taking turns; medians reported")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--vector-kernel", action="store_true", help="force each build's vector kernel (KVSERVE_GEMM)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--path", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.batch_list = [int(b) for b in args.batches.split(",")]
    if args.worker:
        worker(args)
        return
    marches = args.marches.split(",")
    runs: dict[str, list[dict]] = {m: [] for m in marches}
    with tempfile.TemporaryDirectory() as tmp:
        path = make_checkpoint(Path(tmp) / "model", SHAPES[args.shape], args.prompt_len + args.tokens + 2,
                               getattr(torch, args.dtype))
        for repeat in range(args.repeats):
            for march in marches:
                cmd = [sys.executable, __file__, *sys.argv[1:], "--worker", "--path", str(path)]
                done = subprocess.run(cmd, env={**os.environ, MARCH_ENV: march}, capture_output=True, text=True,
                                      check=True)
                runs[march].append(json.loads(done.stdout.strip().splitlines()[-1]))
                print(f"repeat {repeat + 1}, {march}: {runs[march][-1]}", file=sys.stderr, flush=True)
    print(f"| weights | batch | {' | '.join(f'{m} tok/s' for m in marches)} | "
          f"{' | '.join(f'{m} / {marches[0]}' for m in marches[1:])} | GEMMs ({', '.join(marches)}) |")
    print("| --- " * (3 + 2 * len(marches) - 1) + "|")
    for quantization in args.quantization.split(","):
        for batch in args.batch_list:
            med = {m: statistics.median(r[quantization]["tok_s"][str(batch)] for r in runs[m]) for m in marches}
            ratios = " | ".join(f"{med[m] / med[marches[0]]:.2f}" for m in marches[1:])
            gemms = "; ".join(runs[m][-1][quantization]["gemm"] for m in marches)
            print(f"| {quantization} | {batch} | {' | '.join(f'{med[m]:.1f}' for m in marches)} | {ratios} | "
                  f"{gemms} |")


if __name__ == "__main__":
    main()
