"""Perplexity of a text streamed through the engine's KV cache, a chunk of tokens at a time.

Each window of `context` tokens is one request whose prompt is scored token by token
(prompt_logprobs); with `chunk` = 1 every token is computed against what the cache holds at that
moment, so anything a cache setting keeps or loses (quantization, eviction) shows in the result.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from kvserve.llm import LLM
from kvserve.sampling import SamplingParams


@dataclass
class PerplexityResult:
    tokens: int              # tokens scored (each window's first token has no context and is not)
    nll: float               # mean negative log-likelihood per scored token, in nats
    perplexity: float
    peak_kv_bytes: int       # most KV cache bytes held by the requests at once
    windows: int

    def as_dict(self) -> dict:
        return dict(tokens=self.tokens, nll=self.nll, perplexity=self.perplexity, peak_kv_bytes=self.peak_kv_bytes,
                    windows=self.windows)


def windows(token_ids: list[int], context: int) -> list[list[int]]:
    """Consecutive, non-overlapping windows of `context` tokens (the last may be shorter, >= 2)."""
    out = [token_ids[i:i + context] for i in range(0, len(token_ids), context)]
    return [w for w in out if len(w) >= 2]


def perplexity(llm: LLM, token_ids: list[int], context: int) -> PerplexityResult:
    """Score every window through the engine; the LLM's own options (chunk, cache mode) apply."""
    engine = llm.engine
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0, ignore_eos=True)
    wins = windows(token_ids, context)
    if not wins:
        raise ValueError("the text has fewer than 2 tokens")
    for i, w in enumerate(wins):
        engine.add_request(f"ppl-{i}", {"prompt_token_ids": w}, params)
    results, peak = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out
        peak = max(peak, engine.kv_bytes_in_use())
    nll = [-entry[t].logprob for i, w in enumerate(wins)
           for t, entry in zip(w[1:], results[f"ppl-{i}"].prompt_logprobs[1:])]
    mean = sum(nll) / len(nll)
    return PerplexityResult(len(nll), mean, math.exp(mean), peak, len(wins))


def transformers_nll(model_path, token_ids: list[int], context: int, dtype) -> float:
    """The same windows' mean next-token loss from transformers (each window whole, no cache)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()
    total, count = 0.0, 0
    with torch.inference_mode():
        for w in windows(token_ids, context):
            logp = model(torch.tensor([w])).logits[0, :-1].float().log_softmax(-1)
            total -= logp.gather(1, torch.tensor(w[1:])[:, None]).sum().item()
            count += len(w) - 1
    return total / count
