"""`kvserve eval perplexity | passkey`: what a cache setting costs in quality, on the demo model by default."""
from __future__ import annotations

import argparse
import math
from pathlib import Path

from kvserve.arg_utils import add_engine_args, engine_kwargs, write_json


def add_eval_parser(sub) -> None:
    e = sub.add_parser("eval", help="measure quality through the engine's KV cache")
    tasks = e.add_subparsers(dest="task", required=True)
    p = tasks.add_parser("perplexity", help="perplexity of a text streamed through the cache")
    p.add_argument("--text", default=None, help="a text file (default: the held-out standard-library modules)")
    p.add_argument("--context", type=int, default=None, help="tokens per window (default: max_model_len - 1)")
    p.add_argument("--chunk", type=int, default=1, help="prompt tokens per step through the cache")
    p.add_argument("--limit-tokens", type=int, default=16384, help="score at most this many tokens of the text")
    p.add_argument("--transformers", action="store_true",
                   help="also score the same windows with transformers (whole windows, no cache) and compare")
    p.add_argument("--json", dest="json_path", default=None)
    add_engine_args(p)
    p.set_defaults(func=lambda args: run_perplexity(args, engine_kwargs(args)))
    k = tasks.add_parser("passkey", help="passkey retrieval accuracy over length x depth")
    k.add_argument("--lengths", default="256,512,1024", help="prompt lengths in tokens")
    k.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="needle depths in [0, 1]")
    k.add_argument("--trials", type=int, default=10)
    k.add_argument("--json", dest="json_path", default=None)
    add_engine_args(k)
    k.set_defaults(func=lambda args: run_passkey(args, engine_kwargs(args)))


def run_perplexity(args: argparse.Namespace, kwargs: dict) -> int:
    from kvserve.eval.data import held_out_text
    from kvserve.eval.perplexity import perplexity
    from kvserve.llm import LLM

    kwargs["long_prefill_token_threshold"] = args.chunk
    llm = LLM(**kwargs)
    text = Path(args.text).read_text() if args.text else held_out_text()
    ids = llm.get_tokenizer().encode(text, add_special_tokens=False)[:args.limit_tokens]
    context = args.context or llm.engine.max_model_len - 1   # a window is a prompt, and one token is sampled
    result = perplexity(llm, ids, context).as_dict()
    print(f"perplexity: {result['tokens']} tokens in {result['windows']} windows of {context}, chunk {args.chunk}, "
          f"cache {llm.engine.cache_config.cache_mode}")
    print(f"nll {result['nll']:.4f} nats/token, perplexity {result['perplexity']:.3f}, "
          f"peak KV {result['peak_kv_bytes'] / 2**20:.2f} MiB")
    if args.transformers:
        from kvserve.eval.perplexity import transformers_nll

        nll = transformers_nll(llm.engine.model_path, ids, context, llm.engine.dtype)
        result["transformers_perplexity"] = math.exp(nll)
        print(f"transformers: nll {nll:.4f}, perplexity {math.exp(nll):.3f}; kvserve / transformers "
              f"{result['perplexity'] / math.exp(nll):.4f}")
    write_json(args.json_path, {**result, "context": context, "chunk": args.chunk})
    return 0


def run_passkey(args: argparse.Namespace, kwargs: dict) -> int:
    from kvserve.eval.retrieval import passkey_accuracy
    from kvserve.llm import LLM

    llm = LLM(**kwargs)
    lengths = [int(x) for x in args.lengths.split(",")]
    depths = [float(x) for x in args.depths.split(",")]
    cells = passkey_accuracy(llm, lengths, depths, args.trials, args.seed)
    print("passkey accuracy (rows: length in tokens, columns: depth)")
    print("length  " + "  ".join(f"{d:>5.2f}" for d in depths))
    for length in lengths:
        row = [c for c in cells if c.length == length]
        print(f"{length:<6}  " + "  ".join(f"{c.accuracy:>5.0%}" for c in row))
    overall = sum(c.correct for c in cells) / sum(c.trials for c in cells)
    print(f"overall {overall:.1%}")
    write_json(args.json_path, {"accuracy": overall, "rows": [
        {"length": c.length, "depth": c.depth, "accuracy": c.accuracy, "trials": c.trials} for c in cells]})
    return 0
