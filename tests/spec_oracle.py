"""A proposer for the tests of speculative decoding: drafts whose acceptance the test chooses."""
from __future__ import annotations

import random

from kvserve import LLM, SamplingParams
from kvserve.engine.speculative import Proposer


class OracleProposer(Proposer):
    """Proposes each sequence's continuation in `references` (by its prompt: what plain greedy decoding gave it), each
    token replaced by another with probability `miss`: accept/reject patterns drawn from a seeded generator. A
    sequence without a reference, or whose outputs left it, gets drafts of `fallback` (none by default)."""

    def __init__(self, references: dict[tuple[int, ...], list[int]], miss: float = 0.3, seed: int = 0,
                 vocab: int = 384, fallback: list[int] | None = None):
        self.references, self.miss, self.vocab = references, miss, vocab
        self.rng = random.Random(seed)
        self.fallback = fallback or []
        self.calls = 0

    def draft(self, seqs, limits):
        self.calls += 1
        out = []
        for seq, k in zip(seqs, limits):
            ref = self.references.get(tuple(seq.prompt_token_ids))
            n = seq.num_output_tokens
            tokens = ref[n:n + k] if ref is not None and ref[:n] == seq.output_token_ids else self.fallback[:k]
            out.append([t if self.rng.random() >= self.miss else self._other(t) for t in tokens])
        return out

    def _other(self, token: int) -> int:
        return (token + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab


def generate_ids(llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list:
    """Each prompt's samples' token ids."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs]


def with_oracle(llm: LLM, prompts: list[list[int]], reference: list, miss: float, seed: int = 0) -> OracleProposer:
    """Make `llm`'s speculation propose from the first sample of each prompt's reference outputs."""
    oracle = OracleProposer({tuple(p): r[0] for p, r in zip(prompts, reference)}, miss, seed)
    llm.engine.speculator.proposer = oracle
    return oracle


NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
