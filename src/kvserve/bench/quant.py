"""Quantized KV pages (int8, fp8, int4) beside the full-precision cache: memory, quality and speed.

On the demo model (or --model): for each kv_cache_dtype, the bytes a token costs (scales included),
how many tokens 1 GiB of KV cache holds (nothing set aside: int4's blocks being filled borrow from
the same blocks as they fill),
held-out perplexity with every token streamed through the cache (chunk 1), the mean next-token KL
divergence and top-1 agreement against the full-precision cache on the same tokens, passkey
accuracy, and decode tokens/s of a batch. The block size defaults to 64: int4 keys are scaled per
channel over a block's tokens, so their scales cost 4 x head_dim / block_size bytes a token.
"""
from __future__ import annotations

import argparse
import statistics

import torch

from kvserve.bench.common import decode_rate, print_table, random_prompts, write_json
from kvserve.eval.data import held_out_text
from kvserve.eval.perplexity import perplexity
from kvserve.eval.retrieval import passkey_accuracy
from kvserve.llm import LLM

NAME = "quant"
KV_DTYPES = ("auto", "int8", "fp8", "int4")
# kv_cache_dtype -> (tokens per budget over full precision at least, perplexity rise at most)
TARGETS = {"int8": (1.9, 0.005), "int4": (3.5, 0.03)}
DECODE_TARGET = 0.8        # decode tokens/s of a quantized cache over the full-precision one, at least
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint (default: the bundled demo model)")
    p.add_argument("--dtype", default="auto", help="the model's compute dtype")
    p.add_argument("--kv-dtypes", default=",".join(KV_DTYPES), help="kv_cache_dtypes to compare")
    p.add_argument("--block-size", type=int, default=64)
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
    llm.engine.prompt_logits_hook = agreement
    result = perplexity(llm, ids, context)
    llm.engine.prompt_logits_hook = None
    out = {"perplexity": result.perplexity, "nll": result.nll, "peak_kv_bytes": result.peak_kv_bytes}
    if agreement.compare:
        out.update(kl=statistics.fmean(agreement.kl), top1_agreement=statistics.fmean(agreement.top1))
    else:
        out.update(kl=0.0, top1_agreement=1.0)
    agreement.kl, agreement.top1 = [], []
    return out


def run(args: argparse.Namespace) -> int:
    kv_dtypes = [d for d in args.kv_dtypes.split(",") if d]
    if kv_dtypes[0] != "auto":
        raise ValueError("--kv-dtypes must start with auto: the others are compared to it")
    n_tokens = args.tokens or (1024 if args.quick else 8192)
    trials = args.passkey_trials or (1 if args.quick else 4)
    timed_tokens = args.decode_tokens or (16 if args.quick else 64)
    common = dict(dtype=args.dtype, block_size=args.block_size, max_num_seqs=args.max_num_seqs)
    llms = {d: LLM(args.model, kv_cache_dtype=d, **common) for d in kv_dtypes}
    ref = llms["auto"]
    max_len = ref.engine.max_model_len
    context = min(args.context or max_len - 1, max_len - 1)   # a window is a prompt, and one token is sampled
    lengths = [int(x) for x in (args.passkey_lengths or f"256,512,{max_len}").split(",") if int(x) <= max_len]
    ids = ref.get_tokenizer().encode(held_out_text(), add_special_tokens=False)[:n_tokens]
    print(f"quant: {ref.engine.model_path.name}, {ref.engine.dtype}, block size {args.block_size}; "
          f"{len(ids)} held-out tokens in windows of {context}, one token a step; passkey {lengths} x "
          f"{len(DEPTHS)} depths x {trials}; decode {args.decode_batch} x {args.decode_prompt}-token prompts")
    rows, agreement = {}, Agreement()
    for d, llm in llms.items():
        spec = llm.engine.kv_spec
        rows[d] = {"kv_cache_dtype": d, "bytes_per_token": spec.bytes_per_token,
                   "tokens_per_gib": spec.num_blocks_for(2**30) * spec.block_size,
                   **quality(llm, ids, context, agreement)}
        agreement.compare = True
        cells = passkey_accuracy(llm, lengths, list(DEPTHS), trials, seed=0)
        rows[d]["passkey_acc"] = sum(c.correct for c in cells) / sum(c.trials for c in cells)
        print(f"  {d}: perplexity {rows[d]['perplexity']:.4f}, passkey {rows[d]['passkey_acc']:.0%}", flush=True)
    prompts = random_prompts(args.decode_batch, args.decode_prompt, ref.engine.model_config.vocab_size)
    decode_llms = {d: LLM(args.model, kv_cache_dtype=d, enable_prefix_caching=False, **common) for d in kv_dtypes}
    rates: dict[str, list[float]] = {d: [] for d in kv_dtypes}
    for _ in range(args.repeats):          # interleaved, so that the machine's noise falls on all alike
        for d, llm in decode_llms.items():
            rates[d].append(decode_rate(llm, prompts, timed_tokens))
    for d in kv_dtypes:
        rows[d]["decode_tok_s"] = statistics.median(rates[d])
    full = rows["auto"]
    for row in rows.values():
        row["tokens_ratio"] = row["tokens_per_gib"] / full["tokens_per_gib"]
        row["perplexity_rise"] = row["perplexity"] / full["perplexity"] - 1
        row["decode_ratio"] = row["decode_tok_s"] / full["decode_tok_s"]
    report(rows)
    write_json(args.json_path, {"model": str(ref.engine.model_path), "dtype": str(ref.engine.dtype),
                                "block_size": args.block_size, "max_num_seqs": args.max_num_seqs,
                                "tokens": len(ids), "context": context, "passkey_lengths": lengths,
                                "passkey_trials": trials, "rows": list(rows.values())})
    return 0


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
