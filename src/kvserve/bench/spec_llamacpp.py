"""`bench spec`'s llama.cpp column: llama.cpp's decoding of part 1's prompts at batch 1, with and without prompt lookup,
beside kvserve's plain and n-gram decoding (the `peers` extra).

The part's checkpoint goes to a BF16 GGUF (bench/llamacpp.py's write_gguf) and runs through llama-cpp-python's `Llama`
class, a sequence at a time, on as many threads as the engines: greedy decode tokens/s of plain decoding, and of
prompt lookup by llama-cpp-python's LlamaPromptLookupDecoding (llamacpp.LOOKUP_ROUTE names what that is) with as
many drafts a step as the engine's n-gram lookup, each timed in every round of part 1, after the engines'.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

import torch

from kvserve.bench import llamacpp
from kvserve.bench.common import print_table


@dataclass
class Peers:
    """llama.cpp's `Llama` without drafts (`plain`) and with prompt lookup (`lookup`, its draft model a
    llamacpp.CountedDrafts), over the same GGUF."""

    plain: object
    lookup: object
    max_ngram: int
    num_drafts: int

    def describe(self) -> dict:
        """What runs: the threads, llamacpp.LOOKUP_ROUTE, the lookup's sizes."""
        return {"threads": self.plain.n_threads, "route": llamacpp.LOOKUP_ROUTE, "max_ngram": self.max_ngram,
                "num_drafts": self.num_drafts}

    def close(self) -> None:
        """Frees both models and contexts."""
        self.plain.close()
        self.lookup.close()


def why_not(checkpoint: Path, batches: list[int]) -> str | None:
    """Why the column cannot run here (None: it can)."""
    if not llamacpp.available():
        return "not installed: pip install 'kvserve[peers]'"
    if 1 not in batches:
        return "llama-cpp-python's Llama decodes a sequence at a time: --batches has no 1"
    if llamacpp.model_type(checkpoint) != "llama":
        return f"it converts Llama checkpoints only, not {llamacpp.model_type(checkpoint)!r}"
    return None


def load(checkpoint: Path, tmp: Path, n_ctx: int, max_ngram: int, num_drafts: int) -> Peers:
    """Both `Llama`s over a BF16 GGUF of `checkpoint` written into `tmp`, contexts of n_ctx tokens, on torch's
    threads; lookup of n-grams of up to max_ngram tokens, num_drafts drafts a step."""
    gguf = llamacpp.write_gguf(checkpoint, tmp / "bf16.gguf")
    threads = torch.get_num_threads()
    return Peers(llamacpp.lookup_llama(gguf, n_ctx, threads, None),
                 llamacpp.lookup_llama(gguf, n_ctx, threads, (max_ngram, num_drafts)), max_ngram, num_drafts)


def run_round(peers: Peers, prompt: list[int], tokens: int) -> dict:
    """Each `Llama`'s greedy decode tokens/s after `prompt`; for lookup, the tokens a llama_decode gained (the
    drafts accepted and the token after them) and whether its tokens are plain decoding's."""
    plain_tokens, plain_s = llamacpp.greedy_decode(peers.plain, prompt, tokens)
    drafts = peers.lookup.draft_model
    calls = drafts.calls
    lookup_tokens, lookup_s = llamacpp.greedy_decode(peers.lookup, prompt, tokens)
    return {"plain_tok_s": tokens / plain_s, "lookup_tok_s": tokens / lookup_s,
            "tokens_per_decode": tokens / (drafts.calls - calls), "same_tokens": lookup_tokens == plain_tokens}


def summarize(rounds: list[dict]) -> dict:
    """Medians over the rounds (the lookup's ratio to plain decoding taken in each round); the tokens equal in
    every round or not."""
    out = {name: statistics.median(r[name] for r in rounds)
           for name in ("plain_tok_s", "lookup_tok_s", "tokens_per_decode")}
    out["vs_plain"] = statistics.median(r["lookup_tok_s"] / r["plain_tok_s"] for r in rounds)
    out["same_tokens"] = all(r["same_tokens"] for r in rounds)
    out["runs"] = rounds
    return out


def report(part: dict, peer: dict) -> None:
    """At batch 1, a row a workload: kvserve's plain and n-gram tokens/s beside llama.cpp's without and with lookup."""
    print(f"\nllama.cpp beside kvserve at batch 1, {peer['threads']} threads, greedy decode tokens/s, medians "
          f"(llama.cpp: BF16 GGUF of the same checkpoint)")
    print(f"llama.cpp's lookup: {peer['route']}; n-grams of {peer['max_ngram']} down to 1 tokens, "
          f"{peer['num_drafts']} drafts a step")
    rows = []
    for workload, r in peer["results"].items():
        ours = part["results"][f"{workload}, batch 1"]
        rows.append([workload, f"{ours['plain']['tok_s']:.1f}", f"{ours['ngram']['tok_s']:.1f}",
                     f"{ours['ngram']['vs_plain']:.2f}x", f"{r['plain_tok_s']:.1f}", f"{r['lookup_tok_s']:.1f}",
                     f"{r['vs_plain']:.2f}x", f"{r['tokens_per_decode']:.2f}", "yes" if r["same_tokens"] else "NO"])
    print_table(["workload", "kvserve plain", "kvserve ngram", "vs plain", "llama.cpp plain", "llama.cpp lookup",
                 "vs plain", "tokens/llama_decode", "lookup = plain tokens"], rows)
