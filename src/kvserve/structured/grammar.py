"""A sequence's grammar: where its output tokens have brought it, and which tokens it allows next."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch


class Grammar(Protocol):
    """The state of one sequence's constraint, advanced by each token it samples."""

    @property
    def constrains(self) -> bool:
        """Whether the next token is masked (False once the grammar has ended, or where there is none)."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int, drafts: Sequence[int] = ()) -> None:
        """Write the tokens allowed next into row `row` of an int32 bitmask [rows, ceil(vocab / 32)] (bit t % 32 of
        word t // 32 set: token t allowed), and into the rows after it those allowed after each of `drafts` in turn
        (speculative decoding's, which `validate` allows: the state is the same afterwards). Only where
        `constrains`."""

    def validate(self, tokens: Sequence[int]) -> int:
        """How many of `tokens`, from the first, the grammar allows in turn from its state, up to the one that ends
        it (the state does not change)."""

    def accept(self, token: int) -> bool:
        """Advance past a sampled token; False for a token the grammar does not allow (the sequence cannot go on)."""

    def fork(self) -> Grammar:
        """A grammar of its own in this one's state (another sample of the same request)."""


class NoGrammar:
    """The grammar of a sequence without structured outputs: allows every token."""

    constrains = False

    def fill_bitmask(self, bitmask: torch.Tensor, row: int, drafts: Sequence[int] = ()) -> None:
        raise AssertionError("an unconstrained sequence has no mask")

    def validate(self, tokens: Sequence[int]) -> int:
        return len(tokens)

    def accept(self, token: int) -> bool:
        return True

    def fork(self) -> NoGrammar:
        return self


NO_GRAMMAR = NoGrammar()
