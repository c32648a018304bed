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
"""
from __future__ import annotations

import argparse
import statistics

import torch

from kvserve.arg_utils import write_json
from kvserve.bench.common import decode_rate, print_table, random_prompts
from kvserve.config import QUANTIZATIONS
from kvserve.eval.data import held_out_text
from kvserve.eval.perplexity import perplexity
from kvserve.eval.retrieval import passkey_accuracy
from kvserve.llm import LLM
from kvserve.planner import weight_bytes

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
