"""Concurrent requests under one KV memory budget: contiguous slabs vs paged blocks, and n=4 sharing.

Workload: 128 requests (quick: 32) submitted all at once, each a distinct random prompt, greedy with
ignore_eos and max_tokens = its drawn output length. Prompt and output lengths are log-normal (medians
160 and 340 tokens, like chat traffic; sigma 1.0 each, seed 0: chosen, not fitted here), rounded, at
least 1, the prompt at most max_model_len - 1 and the output cut so that prompt + output <= max_model_len
(2048). The KV budget is `--contexts` (16; quick: 4) full max_model_len contexts of this model (KVSpec
bytes per token x max_model_len x contexts); both modes get exactly it, with prefix caching off:
- contiguous: one slab of max_model_len tokens reserved per request at admission;
- paged: blocks of --block-size tokens taken as the sequence grows (preempting when the pool runs dry).
After every engine step: running and waiting requests, and reserved KV tokens (blocks in use x block size)
against tokens held (the running sequences' num_computed_tokens). Peak concurrency is the most requests
running after a step; the loaded mean averages the running count over the steps that left requests
waiting, so the burst's tail, a few long requests alone, does not dilute it. Waste = sum over steps of
(reserved - held) / sum over steps of reserved: the share of reserved memory, weighted by step, that
held no token.
Sharing: the first --shared-prompts prompts, 4 samples each, as one request with n=4 vs 4 separate
requests (paged, prefix caching off, a pool with room for all); peak KV blocks in use of each.

With --model-shape gemma3-1b: a random model with Gemma 3 1B's KV layout (26 layers, five sliding ones of
window 512 to each global one, 1 KV head of head_dim 256, 4 query heads; the hidden, intermediate and vocab
sizes of the flags, which do not change the cache) instead, paged both ways under one budget (--contexts full
contexts with every layer holding every token): the hybrid KV cache (a block table per layer group, the
sliding groups holding their window) against every layer kept whole (disable_hybrid_kv_cache_manager); at
the length mix above, and at --long-context (every request's prompt and output filling it, --long-output new
tokens, --long-requests of them), prompts in chunks of --long-prefill-token-threshold tokens both ways.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from kvserve.arg_utils import write_json
from kvserve.bench.common import (_BOS, _EOS, _PAD, add_model_args, describe_shape, make_checkpoint, model_shape,
                                  print_table, random_prompts, step_times)
from kvserve.config import ATTENTION_BACKENDS, ModelConfig, parse_dtype
from kvserve.engine.engine import LLMEngine
from kvserve.kv import KVSpec
from kvserve.kv.blocks import cdiv
from kvserve.llm import LLM
from kvserve.model.random_checkpoint import make_tokenizer, save_random_model
from kvserve.sampling import SamplingParams

NAME = "capacity"
MODES = ("contiguous", "paged")
# small: the memory arithmetic does not depend on the model's speed
SHAPE = {"hidden_size": 128, "intermediate_size": 384, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
         "vocab_size": 1024}
SAMPLES = 4
TARGET_RATIO = 4.0        # peak concurrent requests, paged / contiguous
TARGET_WASTE_PCT = 4.0    # paged
_WARMUP_TOKENS = 4

Request = tuple[list[int], SamplingParams]


@dataclass
class Workload:
    requests: int
    contexts: int          # the KV budget, in full max_model_len contexts
    shared_prompts: int    # prompts of the n=SAMPLES sharing figure: the first ones
    prompt_lens: list[int]
    output_lens: list[int]


@dataclass
class Trace:
    """What one run held after each step, and what it generated."""

    running: list[int]
    waiting: list[int]
    blocks: list[int]      # KV blocks in use
    held: list[int]        # tokens in the cache of the running sequences (a shared token counted per owner)
    decoding: list[int]    # running sequences past their prompt (not a prompt's chunk that may be preempted)
    generated: int
    seconds: float


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=None, help="requests, all at once (default 128; quick: 32)")
    p.add_argument("--contexts", type=int, default=None,
                   help="KV budget in full max_model_len contexts (default 16; quick: 4)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--prompt-median", type=float, default=160.0)
    p.add_argument("--output-median", type=float, default=340.0)
    p.add_argument("--prompt-sigma", type=float, default=1.0, help="of log(prompt length)")
    p.add_argument("--output-sigma", type=float, default=1.0, help="of log(output length)")
    p.add_argument("--seed", type=int, default=0, help="of the lengths and prompts")
    p.add_argument("--shared-prompts", type=int, default=None,
                   help=f"prompts sampled {SAMPLES} times for the sharing figure (default 8; quick: 4)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="must not cap paged concurrency")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS)
    p.add_argument("--model-shape", choices=sorted(HYBRID_SHAPES), default=None,
                   help="the KV layout of a hybrid model: its hybrid KV cache against every layer kept whole")
    p.add_argument("--long-context", type=int, default=8192, help="with --model-shape: tokens of each long request")
    p.add_argument("--long-output", type=int, default=16, help="with --model-shape: new tokens of each long request")
    p.add_argument("--long-prefill-token-threshold", type=int, default=1024,
                   help="with --model-shape: most prompt tokens of a sequence per step, both ways (a sliding group "
                        "holds every block of the chunk being written, so that it bounds the hybrid cache's peak)")
    p.add_argument("--long-requests", type=int, default=None,
                   help="with --model-shape: long requests, all at once (default 32; quick: 12)")
    add_model_args(p, SHAPE)


def workload(args: argparse.Namespace) -> Workload:
    n = args.requests or (32 if args.quick else 128)
    prompt_lens, output_lens = draw_lengths(args, n)
    return Workload(n, args.contexts or (4 if args.quick else 16),
                    min(n, args.shared_prompts or (4 if args.quick else 8)), prompt_lens, output_lens)


def draw_lengths(args: argparse.Namespace, n: int) -> tuple[list[int], list[int]]:
    """Log-normal prompt and output lengths; the output is cut so that prompt + output <= max_model_len."""
    rng = np.random.default_rng(args.seed)
    top = args.max_model_len
    prompt = np.clip(np.rint(rng.lognormal(np.log(args.prompt_median), args.prompt_sigma, n)), 1, top - 1)
    output = np.clip(np.rint(rng.lognormal(np.log(args.output_median), args.output_sigma, n)), 1, top - prompt)
    return prompt.astype(int).tolist(), output.astype(int).tolist()


def serve(engine: LLMEngine, requests: list[Request]) -> Trace:
    """Submit every request at once and step the engine until all finish, noting its state after each step."""
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    trace = Trace([], [], [], [], [], 0, 0.0)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                trace.generated += sum(len(c.token_ids) for c in out.outputs)
        stats = engine.stats()
        trace.running.append(stats["num_running"])
        trace.waiting.append(stats["num_waiting"])
        trace.blocks.append(stats["kv_blocks_total"] - stats["kv_blocks_free"])
        trace.held.append(sum(s.num_computed_tokens for s in engine.scheduler.running))
        trace.decoding.append(sum(s.num_output_tokens > 0 for s in engine.scheduler.running))
    trace.seconds = time.perf_counter() - start
    return trace


def make_llm(path: Path, args: argparse.Namespace, mode: str, **kv) -> LLM:
    return LLM(str(path), dtype=args.dtype, device=args.device, cache_mode=mode, enable_prefix_caching=False,
               max_model_len=args.max_model_len, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
               attention_backend=args.attention_backend, **kv)


def measure(path: Path, mode: str, budget: int, requests: list[Request], args: argparse.Namespace,
            **engine: object) -> dict:
    """One mode under the KV budget (bytes): concurrency, waste and throughput of the workload; `engine`: more
    of the engine's options."""
    llm = make_llm(path, args, mode, kv_cache_memory=budget, **engine)
    step_times(llm.engine, requests[0][0][:8], _WARMUP_TOKENS, "warmup")
    t = serve(llm.engine, requests)
    stats = llm.stats()
    reserved = [b * stats["kv_block_size"] for b in t.blocks]
    # steps that left requests waiting; none did if all ran at once
    loaded = [r for r, w in zip(t.running, t.waiting) if w] or [max(t.running)]
    return {"peak_concurrent": max(t.running), "loaded_mean_concurrent": statistics.mean(loaded),
            "peak_decoding": max(t.decoding),
            "waste_pct": 100 * (sum(reserved) - sum(t.held)) / sum(reserved),
            "generated_tokens": t.generated, "seconds": t.seconds, "tok_s": t.generated / t.seconds,
            "steps": len(t.running), "num_preemptions": stats["num_preemptions"],
            "kv_block_size": stats["kv_block_size"], "kv_blocks_total": stats["kv_blocks_total"],
            "kv_cache_bytes": stats["kv_cache_bytes"]}


def sharing(path: Path, prompts: list[list[int]], outputs: list[int], args: argparse.Namespace,
            bytes_per_token: int) -> dict:
    """Peak KV blocks of SAMPLES samples of each prompt: one request with n=SAMPLES vs SAMPLES requests."""
    def params(n: int, seed: int, tokens: int) -> SamplingParams:
        return SamplingParams(n=n, max_tokens=tokens, temperature=1.0, seed=seed, ignore_eos=True)

    blocks = SAMPLES * sum(cdiv(len(p) + o, args.block_size) for p, o in zip(prompts, outputs))
    shared = [(p, params(SAMPLES, i * SAMPLES, o)) for i, (p, o) in enumerate(zip(prompts, outputs))]
    separate = [(p, params(1, i * SAMPLES + j, o)) for i, (p, o) in enumerate(zip(prompts, outputs))
                for j in range(SAMPLES)]
    res: dict = {"prompts": len(prompts), "n": SAMPLES}
    for name, requests in (("separate", separate), ("shared", shared)):
        llm = make_llm(path, args, "paged", num_kv_blocks=blocks)
        t = serve(llm.engine, requests)
        res[f"{name}_peak_blocks"] = max(t.blocks)
        res[f"{name}_peak_kv_bytes"] = max(t.blocks) * args.block_size * bytes_per_token
        res[f"{name}_generated_tokens"] = t.generated
        res[f"{name}_preemptions"] = llm.stats()["num_preemptions"]
    res["saved_pct"] = 100 * (1 - res["shared_peak_blocks"] / res["separate_peak_blocks"])
    return res


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def report(res: dict) -> None:
    c, p = res["contiguous"], res["paged"]
    ratio, waste = res["concurrency_ratio"], res["paged_waste_pct"]
    rows = [
        ["peak concurrent requests", str(c["peak_concurrent"]), str(p["peak_concurrent"]),
         f"paged / contiguous {ratio:.1f}x (>= {TARGET_RATIO:.0f}x: {_met(ratio >= TARGET_RATIO)})"],
        ["mean concurrent while requests wait", f"{c['loaded_mean_concurrent']:.1f}",
         f"{p['loaded_mean_concurrent']:.1f}", f"{res['loaded_concurrency_ratio']:.1f}x"],
        ["reserved KV holding no token", f"{c['waste_pct']:.1f}%", f"{waste:.1f}%",
         f"paged < {TARGET_WASTE_PCT:.0f}% ({_met(waste < TARGET_WASTE_PCT)})"],
        ["generated tok/s", f"{c['tok_s']:.1f}", f"{p['tok_s']:.1f}", f"{p['tok_s'] / c['tok_s']:.1f}x"],
        ["steps | preemptions", f"{c['steps']} | {c['num_preemptions']}", f"{p['steps']} | {p['num_preemptions']}",
         ""],
    ]
    print_table(["", "contiguous", "paged", "target"], rows)
    print()
    s = res["sharing"]
    print(f"{s['prompts']} prompts x {s['n']} samples, paged, prefix caching off:")
    print_table(["", f"{s['n']} separate requests", f"1 request, n={s['n']}", "saved"],
                [["peak KV blocks in use", str(s["separate_peak_blocks"]), str(s["shared_peak_blocks"]),
                  f"{s['saved_pct']:.1f}%"],
                 ["peak KV MiB", f"{s['separate_peak_kv_bytes'] / 2**20:.2f}",
                  f"{s['shared_peak_kv_bytes'] / 2**20:.2f}", ""]])


def describe(args: argparse.Namespace, w: Workload, bytes_per_token: int) -> str:
    return (f"capacity: {w.requests} requests at once; prompt ~ lognormal(median {args.prompt_median:g}, sigma "
            f"{args.prompt_sigma:g}), output ~ lognormal(median {args.output_median:g}, sigma {args.output_sigma:g}),"
            f" prompt + output <= {args.max_model_len}, seed {args.seed} (mean prompt "
            f"{statistics.mean(w.prompt_lens):.0f}, output {statistics.mean(w.output_lens):.0f}); KV budget "
            f"{w.contexts} x {args.max_model_len} tokens x {bytes_per_token} B = "
            f"{w.contexts * args.max_model_len * bytes_per_token / 2**20:.1f} MiB; {args.dtype}, "
            f"{describe_shape(model_shape(args))}")


# a published model's KV layout: what its config.json fields say of layers, heads and windows
HYBRID_SHAPES = {"gemma3-1b": dict(num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                                   sliding_window=512, sliding_window_pattern=6, query_pre_attn_scalar=256)}
HYBRID_MODES = {"all_global": True, "hybrid": False}     # mode -> disable_hybrid_kv_cache_manager


def hybrid_checkpoint(path: Path, args: argparse.Namespace, max_positions: int) -> Path:
    """A random-weight Gemma 3 text model of --model-shape's KV layout and the flags' other sizes."""
    from transformers import Gemma3TextConfig

    cfg = Gemma3TextConfig(hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
                           vocab_size=args.vocab_size, max_position_embeddings=max_positions, bos_token_id=_BOS,
                           eos_token_id=_EOS, pad_token_id=_PAD, **HYBRID_SHAPES[args.model_shape])
    return save_random_model(path, cfg, torch.float32, 0, make_tokenizer(total=args.vocab_size))


def run_hybrid(args: argparse.Namespace) -> int:
    """Peak and loaded concurrency of the hybrid KV cache against every layer kept whole, at the length mix and
    at --long-context, each under a budget of --contexts full contexts of every layer."""
    w = workload(args)
    n_long = args.long_requests or (12 if args.quick else 32)
    long_prompt = args.long_context - args.long_output
    res: dict = {"model_shape": args.model_shape, "dtype": args.dtype, "contexts": w.contexts}
    with tempfile.TemporaryDirectory(prefix="kvserve-bench-") as tmp:
        path = hybrid_checkpoint(Path(tmp), args, max(args.max_model_len, args.long_context))
        bytes_per_token = KVSpec.from_model(ModelConfig.from_path(path), parse_dtype(args.dtype)).bytes_per_token
        rows = random_prompts(max(w.requests, n_long), max(max(w.prompt_lens), long_prompt), args.vocab_size,
                              seed=args.seed)
        loads = {
            "mix": (args.max_model_len, [(r[:p], SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True))
                                         for r, p, o in zip(rows, w.prompt_lens, w.output_lens)]),
            "long": (args.long_context, [(r[:long_prompt], SamplingParams(max_tokens=args.long_output,
                                                                           temperature=0.0, ignore_eos=True))
                                         for r in rows[:n_long]]),
        }
        for load, (max_len, requests) in loads.items():
            budget = w.contexts * max_len * bytes_per_token
            print(f"{load}: {len(requests)} requests, max_model_len {max_len}, KV budget {w.contexts} x {max_len} "
                  f"tokens x {bytes_per_token} B = {budget / 2**20:.1f} MiB")
            args.max_model_len = max_len
            res[load] = {mode: measure(path, "paged", budget, requests, args, disable_hybrid_kv_cache_manager=off,
                                       long_prefill_token_threshold=args.long_prefill_token_threshold)
                         for mode, off in HYBRID_MODES.items()}
            res[load].update(requests=len(requests), max_model_len=max_len, kv_budget_bytes=budget)
            res[load]["decoding_ratio"] = (res[load]["hybrid"]["peak_decoding"]
                                           / res[load]["all_global"]["peak_decoding"])
    rows_out = [[f"{load}: {name}", f"{res[load]['all_global'][key]:.3g}", f"{res[load]['hybrid'][key]:.3g}",
                 f"{res[load]['hybrid'][key] / res[load]['all_global'][key]:.2f}x" if res[load]['all_global'][key]
                 else "-"]
                for load in loads for name, key in (("peak requests decoding at once", "peak_decoding"),
                                                    ("mean running while requests wait", "loaded_mean_concurrent"),
                                                    ("preemptions", "num_preemptions"),
                                                    ("generated tok/s", "tok_s"))]
    print_table(["", "every layer whole", "hybrid (per layer group)", "hybrid / whole"], rows_out)
    write_json(args.json_path, res)
    return 0


def run(args: argparse.Namespace) -> int:
    if args.model_shape:
        return run_hybrid(args)
    w = workload(args)
    shape = model_shape(args)
    rows = random_prompts(w.requests, max(w.prompt_lens), shape["vocab_size"], seed=args.seed)
    prompts = [row[:length] for row, length in zip(rows, w.prompt_lens)]
    requests = [(p, SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True))
                for p, o in zip(prompts, w.output_lens)]
    with tempfile.TemporaryDirectory(prefix="kvserve-bench-") as tmp:
        path = make_checkpoint(Path(tmp), shape, args.max_model_len)
        bytes_per_token = KVSpec.from_model(ModelConfig.from_path(path), parse_dtype(args.dtype)).bytes_per_token
        budget = w.contexts * args.max_model_len * bytes_per_token
        print(describe(args, w, bytes_per_token))
        res: dict = {mode: measure(path, mode, budget, requests, args) for mode in MODES}
        res["sharing"] = sharing(path, prompts[:w.shared_prompts], w.output_lens[:w.shared_prompts], args,
                                 bytes_per_token)
    c, p = res["contiguous"], res["paged"]
    res.update(paged_peak_concurrent=p["peak_concurrent"], contiguous_peak_concurrent=c["peak_concurrent"],
               concurrency_ratio=p["peak_concurrent"] / c["peak_concurrent"],
               loaded_concurrency_ratio=p["loaded_mean_concurrent"] / c["loaded_mean_concurrent"],
               paged_waste_pct=p["waste_pct"], contiguous_waste_pct=c["waste_pct"],
               throughput_ratio=p["tok_s"] / c["tok_s"], kv_budget_bytes=budget, kv_bytes_per_token=bytes_per_token,
               targets={"concurrency_ratio": TARGET_RATIO, "paged_waste_pct": TARGET_WASTE_PCT},
               workload={**asdict(w), "max_model_len": args.max_model_len, "seed": args.seed,
                         **{k: getattr(args, k) for k in ("prompt_median", "prompt_sigma", "output_median",
                                                          "output_sigma")}},
               model=shape, dtype=args.dtype)
    report(res)
    write_json(args.json_path, res)
    return 0
