"""Multi-document QA over a pool too small for the documents: a disk tier against prefix caching alone.

N documents of L tokens (random ids, fixed seeds) are each asked Q questions of a few tokens; the
questions of all documents come in one shuffled order, one request at a time, each generating a few
tokens greedily. The pool holds about a quarter of the documents. As in vLLM's long-document QA
measurement, every engine first reads each document once (a warm-up, not measured), then serves the
questions:
- no_prefix_cache: prefix caching off: every question computes its document again;
- prefix_cache: a question finds its document only while it is still in the pool;
- disk_tier: prefix caching with kv_offload="disk:DIR": a document that left the pool is loaded from
  the tier instead of computed;
- after_restart: a new engine on the same directory, with no warm-up, serves as many new questions
  (other tokens, about the same documents).
TTFT = first_token_time - arrival_time of each question. Targets: mean TTFT of prefix_cache over
disk_tier >= 3x; after_restart's mean TTFT within 20% of disk_tier's (the warm engine's).
"""
from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from kvserve.arg_utils import write_json
from kvserve.bench.common import (
    add_model_args,
    describe_shape,
    make_checkpoint,
    model_shape,
    print_table,
    random_prompts,
)
from kvserve.kv.blocks import cdiv
from kvserve.llm import LLM
from kvserve.sampling import SamplingParams

NAME = "offload"
MODES = ("no_prefix_cache", "prefix_cache", "disk_tier", "after_restart")
TARGET_SPEEDUP = 3.0           # mean TTFT, prefix_cache / disk_tier
TARGET_RESTART = 1.2           # mean TTFT, after_restart / disk_tier, at most


@dataclass
class Workload:
    documents: int
    doc_len: int
    questions: int            # per document
    question_len: int
    tokens: int

    @property
    def max_len(self) -> int:
        return self.doc_len + self.question_len + self.tokens


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--documents", type=int, default=None, help="documents (default 32; quick: 4)")
    p.add_argument("--doc-len", type=int, default=None, help="tokens a document (default 2000; quick: 128)")
    p.add_argument("--questions", type=int, default=None, help="questions a document (default 4; quick: 2)")
    p.add_argument("--question-len", type=int, default=16, help="tokens a question, after its document")
    p.add_argument("--tokens", type=int, default=8, help="generated per question")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-offload-dir", default=None,
                   help="the disk tier's directory (default: a temporary one, removed after)")
    p.add_argument("--kv-offload-size", default=None, help="the tier's size (default: twice the documents' KV)")
    p.add_argument("--seed", type=int, default=0, help="of the documents, the questions and their order")
    add_model_args(p)


def workload(args: argparse.Namespace) -> Workload:
    w = Workload(args.documents or (4 if args.quick else 32), args.doc_len or (128 if args.quick else 2000),
                 args.questions or (2 if args.quick else 4), args.question_len, args.tokens)
    if min(w.documents, w.doc_len, w.questions, w.question_len, w.tokens) < 1:
        raise ValueError("--documents, --doc-len, --questions, --question-len and --tokens must be at least 1")
    return w


def make_documents(w: Workload, vocab_size: int, seed: int) -> list[list[int]]:
    return random_prompts(w.documents, w.doc_len, vocab_size, seed=seed)


def make_questions(w: Workload, docs: list[list[int]], vocab_size: int, seed: int) -> list[list[int]]:
    """`questions` questions about each document (each after its document's tokens), in a shuffled order."""
    asks = random_prompts(w.documents * w.questions, w.question_len, vocab_size, seed=seed)
    questions = [docs[i // w.questions] + q for i, q in enumerate(asks)]
    random.Random(seed).shuffle(questions)
    return questions


def serve(llm: LLM, prompts: list[list[int]], tokens: int) -> tuple[list[float], float]:
    """Each prompt alone, one after another: TTFT (s) of each, and the seconds of them all."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    ttft = []
    start = time.perf_counter()
    for p in prompts:
        out = llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0]
        ttft.append(out.metrics["first_token_time"] - out.metrics["arrival_time"])
    return ttft, time.perf_counter() - start


def percentile(xs: list[float], q: float) -> float:
    """The q-th percentile (0-100), linearly interpolated between the nearest ranks."""
    xs = sorted(xs)
    at = (len(xs) - 1) * q / 100
    lo = int(at)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (at - lo)


def measure(llm: LLM, docs: list[list[int]] | None, questions: list[list[int]], w: Workload) -> dict:
    """Warm up on the documents (unless None), then the questions: their TTFTs, total time, and where
    their prompt tokens came from (pool hits, tier hits)."""
    if docs is not None:
        serve(llm, docs, 1)
    before = llm.stats()
    ttft, total = serve(llm, questions, w.tokens)
    after = llm.stats()
    prompt_tokens = sum(len(q) for q in questions)
    pool = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    tier = after.get("kv_offload_hit_tokens", 0) - before.get("kv_offload_hit_tokens", 0)
    return {"mean_ttft_s": statistics.mean(ttft), "p50_ttft_s": percentile(ttft, 50),
            "p99_ttft_s": percentile(ttft, 99), "total_s": total, "pool_hit_rate": pool / prompt_tokens,
            "tier_hit_rate": tier / prompt_tokens, "num_preemptions": after["num_preemptions"],
            "kv_offload_bytes_read": after.get("kv_offload_bytes_read", 0), "ttft_s": ttft}


def report(res: dict) -> None:
    modes = [res[m] for m in MODES]
    met = "met" if res["ttft_speedup"] >= TARGET_SPEEDUP else "NOT met"
    restart_met = "met" if res["restart_over_warm"] <= TARGET_RESTART else "NOT met"
    rows = [
        ["mean TTFT ms", *(f"{r['mean_ttft_s'] * 1e3:.1f}" for r in modes), ""],
        ["p50 | p99 TTFT ms", *(f"{r['p50_ttft_s'] * 1e3:.1f} | {r['p99_ttft_s'] * 1e3:.1f}" for r in modes), ""],
        ["total s (questions)", *(f"{r['total_s']:.2f}" for r in modes), ""],
        ["prompt tokens from pool | tier",
         *(f"{r['pool_hit_rate']:.0%} | {r['tier_hit_rate']:.0%}" for r in modes), ""],
        ["mean TTFT vs prefix_cache", *(f"{res['prefix_cache']['mean_ttft_s'] / r['mean_ttft_s']:.1f}x" for r in modes),
         f"disk_tier >= {TARGET_SPEEDUP:.0f}x ({met})"],
        ["mean TTFT vs disk_tier", *(f"{r['mean_ttft_s'] / res['disk_tier']['mean_ttft_s']:.2f}" for r in modes),
         f"after_restart <= {TARGET_RESTART:.2f} ({restart_met})"],
    ]
    print_table(["", *MODES, "target"], rows)


def run(args: argparse.Namespace) -> int:
    w = workload(args)
    shape = model_shape(args)
    docs = make_documents(w, shape["vocab_size"], args.seed)
    questions, later = (make_questions(w, docs, shape["vocab_size"], args.seed + i) for i in (1, 2))
    bs = args.block_size
    # about a quarter of the documents, each with a question and its answer (at least one request)
    num_blocks = max(1, w.documents // 4) * cdiv(w.max_len, bs)
    print(f"offload: {w.documents} documents x {w.doc_len} tokens, {w.questions} questions of {w.question_len} "
          f"tokens each in a shuffled order, one at a time, {w.tokens} generated greedily; a pool of {num_blocks} "
          f"blocks of {bs} (about {max(1, w.documents // 4)} documents); {args.dtype}, {describe_shape(shape)}")
    with tempfile.TemporaryDirectory(prefix="kvserve-bench-") as tmp:
        path = make_checkpoint(Path(tmp), shape, w.max_len)
        tier_dir = Path(args.kv_offload_dir) if args.kv_offload_dir else Path(tmp) / "tier"

        def engine(**kw) -> LLM:
            return LLM(str(path), dtype=args.dtype, device=args.device, max_model_len=w.max_len, block_size=bs,
                       num_kv_blocks=num_blocks, **kw)

        probe = engine()
        size = args.kv_offload_size or 2 * w.documents * cdiv(w.doc_len, bs) * probe.engine.kv_spec.bytes_per_block
        del probe
        tiered = {"kv_offload": f"disk:{tier_dir}", "kv_offload_size": size}
        res: dict = {"no_prefix_cache": measure(engine(enable_prefix_caching=False), docs, questions, w),
                     "prefix_cache": measure(engine(), docs, questions, w)}
        warm = engine(**tiered)
        res["disk_tier"] = measure(warm, docs, questions, w)
        warm.engine.close()
        del warm
        res["after_restart"] = measure(engine(**tiered), None, later, w)
    res.update(ttft_speedup=res["prefix_cache"]["mean_ttft_s"] / res["disk_tier"]["mean_ttft_s"],
               restart_over_warm=res["after_restart"]["mean_ttft_s"] / res["disk_tier"]["mean_ttft_s"],
               total_speedup=res["prefix_cache"]["total_s"] / res["disk_tier"]["total_s"],
               target_ttft_speedup=TARGET_SPEEDUP, target_restart_over_warm=TARGET_RESTART,
               workload=asdict(w), num_kv_blocks=num_blocks, kv_offload_size=size, model=shape, dtype=args.dtype)
    report(res)
    write_json(args.json_path, res)
    return 0
