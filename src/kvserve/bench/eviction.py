"""Eviction policies at budgets of 10/20/50%: perplexity past the training length, passkey, memory, speed.

On the demo model (or --model):
- perplexity of a long held-out text (8x the model's context; quick: 2x) streamed through the cache
  one token a step, per segment of `context` positions: the full cache (allowed past the trained
  positions), a window alone (sink with no sinks), sink+window (StreamingLLM) and h2o (its default
  score=max, and h2o-sum: the paper's accumulated attention), each budget a share of the training
  context; and StreamingLLM's oracle, the sliding window of the same budget with re-computation,
  that sink+window is held to;
- passkey accuracy of training-length prompts whose cache is cut to each budget after the prompt:
  sink+window, h2o, h2o-sum and snapkv (the prompt is computed whole, as a server does);
- peak KV bytes and decode tokens/s of a batch under each policy.
"""
from __future__ import annotations

import argparse
import math
import statistics

from kvserve.arg_utils import write_json
from kvserve.bench.common import decode_rate, print_table, random_prompts
from kvserve.eval.data import held_out_text
from kvserve.eval.retrieval import passkey_accuracy
from kvserve.llm import LLM
from kvserve.sampling import SamplingParams

NAME = "eviction"
BUDGETS = (0.1, 0.2, 0.5)
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
SINK_TARGET = 0.10          # sink+window: every segment within 10% of the in-context perplexity
PASSKEY_TARGET = 0.80       # h2o and snapkv at a 20% budget


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint (default: the bundled demo model)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--budgets", default=None, help="shares of the context kept (default 0.1,0.2,0.5; quick: 0.2)")
    p.add_argument("--length-factor", type=int, default=None, help="text length in contexts (default 8; quick: 2)")
    p.add_argument("--passkey-trials", type=int, default=None, help="per depth (default 4; quick: 1)")
    p.add_argument("--decode-batch", type=int, default=8)
    p.add_argument("--decode-tokens", type=int, default=None, help="timed tokens (default 64; quick: 16)")
    p.add_argument("--repeats", type=int, default=3)


def policies(budget: int, block_size: int) -> dict[str, str | None]:
    """The policies compared at a budget of `budget` tokens (sink's rounding to blocks included)."""
    window = max(1, budget - 2 * block_size)        # sink keeps its window's partial blocks too
    return {"window": f"sink:sinks=0,window={window + block_size}",
            "sink": f"sink:sinks=4,window={window}",
            "h2o": f"h2o:budget={budget},recent={max(1, budget // 4)}",
            "h2o-sum": f"h2o:budget={budget},recent={max(1, budget // 4)},score=sum",
            "snapkv": f"snapkv:budget={budget},window={min(32, budget // 2)}"}


def streamed_nll(llm: LLM, ids: list[int]) -> tuple[list[float], int]:
    """Next-token losses of the text fed one token a step through the cache, and the peak KV bytes."""
    engine = llm.engine
    engine.add_request("text", {"prompt_token_ids": ids},
                       SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0, ignore_eos=True))
    peak, out = 0, None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
        peak = max(peak, engine.kv_bytes_in_use())
    return [-entry[t].logprob for t, entry in zip(ids[1:], out.prompt_logprobs[1:])], peak


def recomputed_nll(llm: LLM, ids: list[int], window: int) -> list[float]:
    """StreamingLLM's oracle, the sliding window with re-computation: each token's loss with the model
    run afresh (positions from 0) on the up to `window` tokens before it. In strides of window // 8:
    the tokens of a stride share one recomputed window, so each sees 7/8 of a window or more."""
    stride = max(1, window // 8)
    ends = list(range(stride + 1, len(ids), stride)) + [len(ids)]
    prompts = [{"prompt_token_ids": ids[max(0, end - window):end]} for end in ends]
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0, ignore_eos=True)
    nll, scored = [], 1          # ids[0] has no context: the first loss is for ids[1]
    for end, out in zip(ends, llm.generate(prompts, params, use_tqdm=False)):
        start = max(0, end - window)
        nll += [-out.prompt_logprobs[t - start][ids[t]].logprob for t in range(scored, end)]
        scored = end
    return nll


def segments(nll: list[float], context: int) -> list[float]:
    """Perplexity of each run of `context` positions."""
    return [math.exp(statistics.fmean(nll[i:i + context])) for i in range(0, len(nll), context)]


def run(args: argparse.Namespace) -> int:
    budgets = [float(b) for b in (args.budgets or ("0.2" if args.quick else ",".join(map(str, BUDGETS)))).split(",")]
    factor = args.length_factor or (2 if args.quick else 8)
    trials = args.passkey_trials or (1 if args.quick else 4)
    timed = args.decode_tokens or (16 if args.quick else 64)
    probe = LLM(args.model, dtype=args.dtype, block_size=args.block_size, num_kv_blocks=1)
    context, bs, vocab = probe.engine.max_model_len, args.block_size, probe.engine.model_config.vocab_size
    dtype = str(probe.engine.dtype).removeprefix("torch.")
    ids = probe.get_tokenizer().encode(held_out_text(), add_special_tokens=False)[:factor * context + 1]
    common = dict(dtype=args.dtype, block_size=bs, long_prefill_token_threshold=1,
                  max_model_len=len(ids) + 1, allow_long_max_model_len=True)
    print(f"eviction: {probe.engine.model_path.name}, context {context}; {len(ids)}-token text one token a step; "
          f"budgets {budgets} of the context; passkey {trials} x {len(DEPTHS)} depths at length {context}")
    del probe
    rows = []
    nll, peak = streamed_nll(LLM(args.model, **common), ids)
    rows.append(_row("full", None, 1.0, nll, peak, context))
    for share in budgets:
        budget = int(share * context)
        reference = LLM(args.model, dtype=args.dtype, block_size=bs, enable_prefix_caching=False)
        rows.append(_row("recompute", None, share, recomputed_nll(reference, ids, budget), None, context))
        del reference
        for name, spec in policies(budget, bs).items():
            if name == "snapkv":        # it compresses a prompt once; streamed text never ends its prompt
                continue
            nll, peak = streamed_nll(LLM(args.model, eviction=spec, **common), ids)
            rows.append(_row(name, spec, share, nll, peak, context))
            print(f"  {name} {share:.0%}: perplexity {rows[-1]['perplexity']:.3f}, segments "
                  + " ".join(f"{p:.2f}" for p in rows[-1]["segments"]), flush=True)
    prompts = random_prompts(args.decode_batch, context - timed - 4, vocab)
    _passkey_and_speed(args, rows, budgets, context, trials, prompts, timed)
    report(rows, budgets)
    write_json(args.json_path, {"model": args.model or "demo", "dtype": dtype, "context": context,
                                "text_tokens": len(ids), "block_size": bs, "budgets": budgets, "rows": rows})
    return 0


def _row(name: str, spec: str | None, share: float, nll: list[float], peak: int | None, context: int) -> dict:
    return {"policy": name, "spec": spec, "budget": share, "perplexity": math.exp(statistics.fmean(nll)),
            "segments": segments(nll, context), "peak_kv_bytes": peak, "passkey_acc": None, "decode_tok_s": None}


def _passkey_and_speed(args, rows: list[dict], budgets: list[float], context: int, trials: int,
                       prompts: list[list[int]], timed: int) -> None:
    """Passkey accuracy and decode speed of every (policy, budget), full cache included."""
    by_key = {(r["policy"], r["budget"]): r for r in rows}
    setups = [("full", 1.0, None)] + [(name, share, spec) for share in budgets
                                      for name, spec in policies(int(share * context), args.block_size).items()]
    for name, share, spec in setups:
        llm = LLM(args.model, dtype=args.dtype, block_size=args.block_size, eviction=spec, enable_prefix_caching=False)
        cells = passkey_accuracy(llm, [context], list(DEPTHS), trials)
        row = by_key.setdefault((name, share), {"policy": name, "spec": spec, "budget": share, "perplexity": None,
                                                "segments": None, "peak_kv_bytes": None})
        if row not in rows:
            rows.append(row)
        row["passkey_acc"] = sum(c.correct for c in cells) / sum(c.trials for c in cells)
        row["decode_tok_s"] = statistics.median(decode_rate(llm, prompts, timed) for _ in range(args.repeats))
        print(f"  {name} {share:.0%}: passkey {row['passkey_acc']:.0%}, decode {row['decode_tok_s']:.0f} tok/s",
              flush=True)


def report(rows: list[dict], budgets: list[float]) -> None:
    fmt = lambda x, f: "-" if x is None else format(x, f)  # noqa: E731
    print_table(["policy", "budget", "perplexity", "first segment", "last segment", "peak KV MiB", "passkey",
                 "decode tok/s"],
                [[r["policy"], f"{r['budget']:.0%}", fmt(r["perplexity"], ".3f"),
                  fmt(r["segments"] and r["segments"][0], ".2f"), fmt(r["segments"] and r["segments"][-1], ".2f"),
                  fmt(r["peak_kv_bytes"] and r["peak_kv_bytes"] / 2**20, ".2f"), fmt(r.get("passkey_acc"), ".0%"),
                  fmt(r.get("decode_tok_s"), ".0f")] for r in rows])
    for r in rows:
        if r["policy"] == "sink" and r["segments"]:
            # its in-context perplexity: the same tokens, each scored by the model recomputing the window
            # of the same budget before it (StreamingLLM's oracle), segment by segment
            oracle = next(o for o in rows if o["policy"] == "recompute" and o["budget"] == r["budget"])
            ratios = [s / o for s, o in zip(r["segments"], oracle["segments"])]
            r["worst_over_recompute"] = worst = max(ratios) - 1
            print(f"target sink+window {r['budget']:.0%}: every segment within {SINK_TARGET:.0%} of the sliding "
                  f"window with re-computation (worst {worst:+.1%}; segments "
                  + " ".join(f"{x:.2f}" for x in ratios) + f"): {'met' if worst <= SINK_TARGET else 'NOT met'}")
    full = next(r for r in rows if r["policy"] == "full")
    print(f"full cache: last segment / first {full['segments'][-1] / full['segments'][0]:.2f}x; window alone: "
          + ", ".join(f"{r['budget']:.0%} {max(r['segments']) / r['segments'][0]:.2f}x" for r in rows
                      if r["policy"] == "window" and r["segments"]) + " (worst segment / first)")
    for r in rows:
        if r["policy"] in ("h2o", "snapkv") and r["budget"] == 0.2:
            ok = r["passkey_acc"] >= PASSKEY_TARGET
            print(f"target {r['policy']} 20%: passkey >= {PASSKEY_TARGET:.0%} ({r['passkey_acc']:.0%}): "
                  f"{'met' if ok else 'NOT met'}")
