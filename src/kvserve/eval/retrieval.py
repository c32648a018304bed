"""Passkey retrieval accuracy over prompt length x needle depth, through the engine."""
from __future__ import annotations

import random
from dataclasses import dataclass

from kvserve.eval.passkey import make_passkey_prompt
from kvserve.llm import LLM
from kvserve.sampling import SamplingParams


@dataclass
class Cell:
    length: int
    depth: float
    correct: int
    trials: int

    @property
    def accuracy(self) -> float:
        return self.correct / self.trials


def passkey_accuracy(llm: LLM, lengths: list[int], depths: list[float], trials: int, seed: int = 0) -> list[Cell]:
    """Greedy answers to `trials` prompts per (length in tokens, depth); correct if the key comes first."""
    tok = llm.get_tokenizer()
    count = lambda s: len(tok.encode(s))  # noqa: E731
    rng = random.Random(seed)
    cases = [(length, depth, *make_passkey_prompt(length, depth, rng=rng, count=count))
             for length in lengths for depth in depths for _ in range(trials)]
    # as many tokens as the answer takes: the document (prompt and answer) fits `length`
    params = [SamplingParams(max_tokens=max(1, count(p + " " + key) - count(p)), temperature=0)
              for _, _, p, key in cases]
    outs = llm.generate([p for _, _, p, _ in cases], params, use_tqdm=False)
    cells: dict[tuple[int, float], Cell] = {}
    for (length, depth, _, key), out in zip(cases, outs):
        cell = cells.setdefault((length, depth), Cell(length, depth, 0, 0))
        cell.trials += 1
        cell.correct += out.outputs[0].text.strip().startswith(key)
    return list(cells.values())
