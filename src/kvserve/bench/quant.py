"""Quantized KV pages (int8, fp8, int4), or weights (--weights), beside full precision: memory, quality, speed.

On the demo model (or --model): for each kv_cache_dtype, the bytes a token costs (scales included),
how many tokens 1 GiB of KV cache holds (nothing set aside),
held-out perplexity with every token streamed through the cache (chunk 1), the mean next-token KL
divergence and top-1 agreement against the full-precision cache on the same tokens, passkey
accuracy, and decode tokens/s of a batch. The block size defaults to the engine's (16): every codec's
scales are per token, so what a token costs does not depend on it.

With --weights, the rows are the weights' quantizations instead (full precision, then int8 and int4:
`quantization`),
over a full-precision cache: the weights' bytes in place of the cache's, and the same quality and decode
columns against the full-precision weights.

With --speed-only (implied by --shape, a published model's shape with random weights, which have no quality to
measure), speed alone: decode tokens/s at each of --decode-batches and the seconds of a prefill of --prefill-batch
prompts, every row's engine timed in turn within each repeat (the machine's noise falls on all alike), medians of
--repeats, and each row's ratio to the first.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kvserve.arg_utils import write_json
from kvserve.bench.common import SHAPES, decode_rate, describe_shape, make_checkpoint, print_table, random_prompts
from kvserve.config import QUANTIZATIONS
from kvserve.eval.data import held_out_text
from kvserve.eval.perplexity import perplexity
from kvserve.eval.retrieval import passkey_accuracy
from kvserve.llm import LLM
from kvserve.planner import weight_bytes
from kvserve.sampling import SamplingParams

NAME = "quant"
KV_DTYPES = ("auto", "int8", "fp8", "int4")
# kv_cache_dtype -> (tokens per budget over full precision at least, perplexity rise at most)
TARGETS = {"int8": (1.9, 0.005), "int4": (3.5, 0.03)}
# weight quantization -> perplexity rise at most (and passkey accuracy no lower than full precision's)
WEIGHT_TARGETS = {"int8": 0.005, "int4": 0.05}
DECODE_TARGET = 0.8        # decode tokens/s of a quantized cache over the full-precision one, at least
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint (default: the bundled demo model)")
    p.add_argument("--dtype", default="auto", help="the model's compute dtype")
    p.add_argument("--kv-dtypes", default=",".join(KV_DTYPES), help="kv_cache_dtypes to compare")
    p.add_argument("--weights", nargs="?", const=",".join(QUANTIZATIONS), default=None,
                   help=f"compare weight quantizations (default {','.join(QUANTIZATIONS)}) over a full-precision "
                        f"cache, instead of kv_cache_dtypes")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--context", type=int, default=None, help="perplexity window (default: max_model_len)")
    p.add_argument("--tokens", type=int, default=None, help="held-out tokens scored (default 8192; quick: 1024)")
    p.add_argument("--passkey-lengths", default=None, help="prompt lengths (default 256,512,max_model_len)")
    p.add_argument("--passkey-trials", type=int, default=None, help="per (length, depth) (default 4; quick: 1)")
    p.add_argument("--decode-batch", type=int, default=16)
    p.add_argument("--decode-prompt", type=int, default=512)
    p.add_argument("--decode-tokens", type=int, default=None, help="timed tokens per sequence (default 64; quick: 16)")
    p.add_argument("--repeats", type=int, default=3, help="decode timings per dtype (median)")
    p.add_argument("--shape", default=None, choices=sorted(SHAPES),
                   help="a published model's shape with random weights, instead of --model (speed only)")
    p.add_argument("--speed-only", action="store_true", help="decode and prefill speed alone, no quality")
    p.add_argument("--decode-batches", default=None,
                   help="speed only: comma-separated batch sizes whose decode is timed (default: --decode-batch)")
    p.add_argument("--prefill-batch", type=int, default=16,
                   help="speed only: prompts of --decode-prompt tokens prefilled at once, timed")


class Agreement:
    """Collects full next-token distributions of a reference run, then compares another run's to them."""

    def __init__(self):
        self.reference: dict[tuple[str, int], torch.Tensor] = {}
        self.kl: list[float] = []
        self.top1: list[bool] = []
        self.compare = False

    def __call__(self, seqs, logits: torch.Tensor, spans) -> None:
        logp = logits.float().log_softmax(-1)
        rows = iter(logp)
        for row, first, num in spans:
            for pos in range(first, first + num):
                key, lp = (seqs[row].request_id, pos), next(rows)
                if not self.compare:
                    self.reference[key] = lp.clone()
                    continue
                ref = self.reference[key]
                self.kl.append(float((ref.exp() * (ref - lp)).sum()))
                self.top1.append(bool(ref.argmax() == lp.argmax()))


def quality(llm: LLM, ids: list[int], context: int, agreement: Agreement) -> dict:
    llm.engine.outputs.prompt_logits_hook = agreement
    result = perplexity(llm, ids, context)
    llm.engine.outputs.prompt_logits_hook = None
    out = {"perplexity": result.perplexity, "nll": result.nll, "peak_kv_bytes": result.peak_kv_bytes}
    if agreement.compare:
        out.update(kl=statistics.fmean(agreement.kl), top1_agreement=statistics.fmean(agreement.top1))
    else:
        out.update(kl=0.0, top1_agreement=1.0)
    agreement.kl, agreement.top1 = [], []
    return out


def variants(args: argparse.Namespace) -> dict[str, dict]:
    """The rows' engines: name -> LLM kwargs; the first, full precision, is the reference."""
    if args.weights is not None:
        names = [q for q in args.weights.split(",") if q]
        unknown = sorted(set(names) - set(QUANTIZATIONS))
        if unknown:
            raise ValueError(f"--weights takes quantizations of {QUANTIZATIONS}, got {', '.join(unknown)}")
        return {"none": {}, **{q: {"quantization": q} for q in names}}
    kv_dtypes = [d for d in args.kv_dtypes.split(",") if d]
    if kv_dtypes[0] != "auto":
        raise ValueError("--kv-dtypes must start with auto: the others are compared to it")
    return {d: {"kv_cache_dtype": d} for d in kv_dtypes}


def run(args: argparse.Namespace) -> int:
    if args.shape or args.speed_only:
        return run_speed(args)
    rows_of = variants(args)
    weights = args.weights is not None
    n_tokens = args.tokens or (1024 if args.quick else 8192)
    trials = args.passkey_trials or (1 if args.quick else 4)
    timed_tokens = args.decode_tokens or (16 if args.quick else 64)
    common = dict(dtype=args.dtype, block_size=args.block_size, max_num_seqs=args.max_num_seqs)
    llms = {name: LLM(args.model, **kwargs, **common) for name, kwargs in rows_of.items()}
    ref = next(iter(llms.values()))
    max_len = ref.engine.max_model_len
    context = min(args.context or max_len - 1, max_len - 1)   # a window is a prompt, and one token is sampled
    lengths = [int(x) for x in (args.passkey_lengths or f"256,512,{max_len}").split(",") if int(x) <= max_len]
    ids = ref.get_tokenizer().encode(held_out_text(), add_special_tokens=False)[:n_tokens]
    print(f"quant{' --weights' if weights else ''}: {ref.engine.model_path.name}, {ref.engine.dtype}, block size "
          f"{args.block_size}; {len(ids)} held-out tokens in windows of {context}, one token a step; passkey "
          f"{lengths} x {len(DEPTHS)} depths x {trials}; decode {args.decode_batch} x {args.decode_prompt}-token "
          f"prompts")
    rows, agreement = {}, Agreement()
    for name, llm in llms.items():
        spec, cfg = llm.engine.kv_spec, llm.engine.model_config
        key = {"weights": name, "weight_bytes": weight_bytes(cfg, llm.engine.dtype.itemsize, rows_of[name].get(
            "quantization"))} if weights else {"kv_cache_dtype": name}
        rows[name] = {**key, "bytes_per_token": spec.bytes_per_token,
                      "tokens_per_gib": spec.num_blocks_for(2**30) * spec.block_size,
                      **quality(llm, ids, context, agreement)}
        agreement.compare = True
        cells = passkey_accuracy(llm, lengths, list(DEPTHS), trials, seed=0)
        rows[name]["passkey_acc"] = sum(c.correct for c in cells) / sum(c.trials for c in cells)
        print(f"  {name}: perplexity {rows[name]['perplexity']:.4f}, passkey {rows[name]['passkey_acc']:.0%}",
              flush=True)
    prompts = random_prompts(args.decode_batch, args.decode_prompt, ref.engine.model_config.vocab_size)
    decode_llms = {name: LLM(args.model, **kwargs, enable_prefix_caching=False, **common)
                   for name, kwargs in rows_of.items()}
    rates: dict[str, list[float]] = {name: [] for name in rows_of}
    for _ in range(args.repeats):          # interleaved, so that the machine's noise falls on all alike
        for name, llm in decode_llms.items():
            rates[name].append(decode_rate(llm, prompts, timed_tokens))
    for name in rows_of:
        rows[name]["decode_tok_s"] = statistics.median(rates[name])
    full = next(iter(rows.values()))
    for row in rows.values():
        row["tokens_ratio"] = row["tokens_per_gib"] / full["tokens_per_gib"]
        row["perplexity_rise"] = row["perplexity"] / full["perplexity"] - 1
        row["decode_ratio"] = row["decode_tok_s"] / full["decode_tok_s"]
    report_weights(rows) if weights else report(rows)
    write_json(args.json_path, {"model": str(ref.engine.model_path), "dtype": str(ref.engine.dtype),
                                "block_size": args.block_size, "max_num_seqs": args.max_num_seqs,
                                "tokens": len(ids), "context": context, "passkey_lengths": lengths,
                                "passkey_trials": trials, "rows": list(rows.values())})
    return 0


def run_speed(args: argparse.Namespace) -> int:
    """--speed-only: each row's decode tokens/s at each batch and prefill seconds, interleaved (module docstring)."""
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if args.shape:
            shape = SHAPES[args.shape]
            model = str(make_checkpoint(Path(tmp), shape, args.decode_prompt + _speed_tokens(args) + 8,
                                        dtype=torch.bfloat16))
            print(f"quant speed: {args.shape} ({describe_shape(shape)}), random weights")
        rows = speed(args, model)
    table = [[name, *(f"{r['decode_tok_s'][b]:.1f} ({r['decode_ratio'][b]:.2f}x)" for b in r["decode_tok_s"]),
              f"{r['prefill_s']:.2f} ({r['prefill_ratio']:.2f}x)", r["gemm"]] for name, r in rows.items()]
    batches = next(iter(rows.values()))["decode_tok_s"]
    print_table(["rows", *(f"decode tok/s, batch {b} (x first)" for b in batches),
                 f"prefill s, {args.prefill_batch} x {args.decode_prompt} (x first)", "GEMMs"], table)
    write_json(args.json_path, {"model": args.shape or model, "dtype": args.dtype, "repeats": args.repeats,
                                "decode_prompt": args.decode_prompt, "decode_tokens": _speed_tokens(args),
                                "prefill_batch": args.prefill_batch, "rows": rows})
    return 0


def _speed_tokens(args: argparse.Namespace) -> int:
    return args.decode_tokens or (16 if args.quick else 64)


def speed(args: argparse.Namespace, model: str | None) -> dict[str, dict]:
    """Row name -> decode tokens/s by batch, prefill seconds (medians), their ratios to the first row's, and the
    row's GEMMs (kernels by layer)."""
    batches = sorted({int(b) for b in (args.decode_batches or str(args.decode_batch)).split(",") if b})
    tokens = _speed_tokens(args)
    rows_of = variants(args)
    seqs = max(*batches, args.prefill_batch)
    # the pages the largest batch takes, no more: every row's engine is held at once
    blocks = seqs * -(-(args.decode_prompt + tokens + 2) // args.block_size)
    common = dict(dtype=args.dtype, block_size=args.block_size, max_num_seqs=seqs, num_kv_blocks=blocks,
                  enable_prefix_caching=False, max_num_batched_tokens=args.prefill_batch * args.decode_prompt)
    llms = {name: LLM(model, **kwargs, **common) for name, kwargs in rows_of.items()}
    vocab = next(iter(llms.values())).engine.model_config.vocab_size
    prompts = {b: random_prompts(b, args.decode_prompt, vocab, seed=b) for b in {*batches, args.prefill_batch}}
    rates = {name: {b: [] for b in batches} for name in llms}
    prefills: dict[str, list[float]] = {name: [] for name in llms}
    for _ in range(args.repeats):          # interleaved, so that the machine's noise falls on all alike
        for name, llm in llms.items():
            for b in batches:
                rates[name][b].append(decode_rate(llm, prompts[b], tokens, repeats=1))
            prefills[name].append(_prefill_seconds(llm, prompts[args.prefill_batch]))
    rows = {name: {"decode_tok_s": {b: statistics.median(r) for b, r in rates[name].items()},
                   "prefill_s": statistics.median(prefills[name]), "gemm": _kernels(llms[name].stats()["gemm"])}
            for name in llms}
    first = next(iter(rows.values()))
    for row in rows.values():
        row["decode_ratio"] = {b: row["decode_tok_s"][b] / first["decode_tok_s"][b] for b in batches}
        row["prefill_ratio"] = row["prefill_s"] / first["prefill_s"]
    return rows


def _prefill_seconds(llm: LLM, prompts: list[list[int]]) -> float:
    """Seconds for every prompt to get its first token (the prefill, one step where the batched tokens allow)."""
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=1, temperature=0),
                 use_tqdm=False)
    return time.perf_counter() - start


def _kernels(report: dict) -> str:
    """The GEMM choice in a few words: the rows from which each kernel runs, by layer."""
    parts = [f"{kernel} from {'/'.join(str(v) for v in sorted({v for v in report[key].values() if v is not None}))}"
             for kernel, key in (("amx", "amx_from"), ("widen", "widen_from"), ("vnni", "vnni_from"))
             if any(v is not None for v in report.get(key, {}).values())]
    return f"{report['weight_format']}: " + (", ".join(parts) or "vector kernel only")


def report_weights(rows: dict[str, dict]) -> None:
    """The --weights table, and its targets (perplexity rise, passkey accuracy kept)."""
    table = [[q, f"{r['weight_bytes'] / 2**20:,.1f}", f"{r['perplexity']:.4f}", f"{r['perplexity_rise']:+.2%}",
              f"{r['kl']:.5f}", f"{r['top1_agreement']:.2%}", f"{r['passkey_acc']:.0%}", f"{r['decode_tok_s']:.0f}",
              f"{r['decode_ratio']:.2f}x"] for q, r in rows.items()]
    print_table(["weights", "weight MiB", "perplexity", "rise", "KL", "top-1", "passkey", "decode tok/s", "vs full"],
                table)
    full = rows["none"]
    for q, rise in WEIGHT_TARGETS.items():
        if q in rows:
            r = rows[q]
            ok = r["perplexity_rise"] <= rise and r["passkey_acc"] >= full["passkey_acc"]
            print(f"target {q} weights: perplexity within +{rise:.1%} ({r['perplexity_rise']:+.2%}), passkey kept "
                  f"({r['passkey_acc']:.0%} against {full['passkey_acc']:.0%}): {'met' if ok else 'NOT met'}")


def report(rows: dict[str, dict]) -> None:
    table = [[d, f"{r['bytes_per_token']:,.0f}", f"{r['tokens_per_gib']:,}", f"{r['tokens_ratio']:.2f}x",
              f"{r['perplexity']:.4f}", f"{r['perplexity_rise']:+.2%}", f"{r['kl']:.5f}", f"{r['top1_agreement']:.2%}",
              f"{r['passkey_acc']:.0%}", f"{r['decode_tok_s']:.0f}", f"{r['decode_ratio']:.2f}x"]
             for d, r in rows.items()]
    print_table(["kv dtype", "bytes/token", "tokens/GiB", "vs full", "perplexity", "rise", "KL", "top-1",
                 "passkey", "decode tok/s", "vs full"], table)
    for d, (ratio, rise) in TARGETS.items():
        if d in rows:
            r = rows[d]
            ok = r["tokens_ratio"] >= ratio and r["perplexity_rise"] <= rise
            print(f"target {d}: >= {ratio}x tokens ({r['tokens_ratio']:.2f}x), perplexity within +{rise:.1%} "
                  f"({r['perplexity_rise']:+.2%}): {'met' if ok else 'NOT met'}")
    slow = [d for d, r in rows.items() if r["decode_ratio"] < DECODE_TARGET]
    print(f"target decode within {1 - DECODE_TARGET:.0%} of full precision: "
          + ("met" if not slow else f"NOT met by {', '.join(slow)}"))
