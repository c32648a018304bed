"""Synthetic passkey retrieval documents: a 5-digit key hidden in filler text, asked for at the end.

A prompt is HEADER, then filler sentences (FILLER repeated in order) with NEEDLE inserted once
between two of them at the requested depth, then a blank line and QUESTION:

    There is an important piece of information hidden inside a lot of irrelevant text. Find it
    and memorize it. I will quiz you about it.

    The grass is green. The sky is blue. ... The pass key is 48213. Remember it. 48213 is the
    pass key. ... There and back again.

    What is the pass key? The pass key is

The model should continue with " " + answer (the key). The training documents are exactly
prompt + " " + answer, so the same function builds training data and test prompts.
"""
from __future__ import annotations

import random
from collections.abc import Callable

HEADER = ("There is an important piece of information hidden inside a lot of irrelevant text. "
          "Find it and memorize it. I will quiz you about it.\n\n")
FILLER = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.")
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? The pass key is"


def random_key(rng: random.Random) -> str:
    """A 5-digit key, 10000 to 99999."""
    return str(rng.randint(10000, 99999))


def build_prompt(num_filler: int, depth: float, key: str) -> str:
    """The prompt with `num_filler` filler sentences and the needle after round(depth * num_filler) of them."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    filler = [FILLER[i % len(FILLER)] for i in range(num_filler)]
    at = round(depth * num_filler)
    body = " ".join(filler[:at] + [NEEDLE.format(key=key)] + filler[at:])
    return f"{HEADER}{body}\n\n{QUESTION}"


def make_passkey_prompt(length: int, depth: float, key: str | None = None, rng: random.Random | None = None,
                        count: Callable[[str], int] = len) -> tuple[str, str]:
    """(prompt, answer): the longest passkey prompt whose full document fits in `length`.

    length: budget for the whole document, prompt + " " + answer, as measured by `count`
        (characters by default; pass e.g. `lambda s: len(tokenizer.encode(s))` for tokens, so
        that a test at the model's context length leaves room for the answer).
    depth: where the needle sits in the filler, 0.0 (first) to 1.0 (last).
    key: the 5-digit key; drawn from `rng` when None.
    rng: the random source for the key (seeded: random.Random(seed)); a fresh unseeded one if None.
    """
    key = key if key is not None else random_key(rng or random.Random())

    def fits(num_filler: int) -> bool:
        return count(build_prompt(num_filler, depth, key) + " " + key) <= length

    if not fits(0):
        raise ValueError(f"length {length} is too short for a passkey prompt")
    lo, hi = 0, 1
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:   # fits(lo) and not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return build_prompt(lo, depth, key), key
