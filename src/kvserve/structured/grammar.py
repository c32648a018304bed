"""A sequence's grammar: where its output tokens have brought it, and which tokens it allows next."""
from __future__ import annotations

from typing import Protocol

import torch


class Grammar(Protocol):
    """The state of one sequence's constraint, advanced by each token it samples."""

    @property
    def constrains(self) -> bool:
        """Whether the next token is masked (False once the grammar has ended, or where there is none)."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into row `row` of an int32 bitmask [rows, ceil(vocab / 32)] (bit t % 32 of
        word t // 32 set: token t allowed). Only where `constrains`."""

    def accept(self, token: int) -> bool:
        """Advance past a sampled token; False for a token the grammar does not allow (the sequence cannot go on)."""

    def fork(self) -> Grammar:
        """A grammar of its own in this one's state (another sample of the same request)."""


class NoGrammar:
    """The grammar of a sequence without structured outputs: allows every token."""

    constrains = False

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        raise AssertionError("an unconstrained sequence has no mask")

    def accept(self, token: int) -> bool:
        return True

    def fork(self) -> NoGrammar:
        return self


NO_GRAMMAR = NoGrammar()
