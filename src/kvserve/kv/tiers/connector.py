"""KVConnector: the second KV tier as the scheduler sees it (vLLM's KV connector, scheduler side).

A prefix lookup asks the connector whether it holds the blocks the pool lacks (`holds`); admission takes a
fresh pool block for each, and the connector reads them while other sequences step (`start_load`), then
writes them into those blocks (`finish_load`). A preempted sequence may go to the tier instead of being
recomputed (`should_swap`, `swap_out`). The pool's evicted blocks reach the tier through the pool's own
hook, never through the scheduler. NoConnector stands where an engine has no tier: it holds nothing.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from concurrent.futures import Future

from kvserve.kv.blocks import BlockKey
from kvserve.kv.interface import BlockToLoad


class KVConnector(ABC):
    """What the scheduler asks of a second tier."""

    @abstractmethod
    def holds(self, key: BlockKey) -> bool:
        """Whether the tier holds the block of `key` (by hash; a load checks the rest)."""

    @abstractmethod
    def start_load(self, blocks: list[BlockToLoad]) -> Future:
        """Start reading these blocks' bytes (in the order of the prefix) and return at once; finish_load
        takes the result."""

    @abstractmethod
    def finish_load(self, future: Future, blocks: list[BlockToLoad]) -> int:
        """Write the bytes a done load read into their pool blocks: how many of the leading `blocks` it loaded
        (up to the first it could not read or check; none if the load was cancelled)."""

    @abstractmethod
    def cancel_load(self, future: Future) -> None:
        """Drop a load nobody waits for any more: it does not start if it has not; nothing is written."""

    @abstractmethod
    def wait_for_load(self, futures: Iterable[Future]) -> None:
        """Block until one of these loads is done (a step with nothing else to run waits for its blocks)."""

    @abstractmethod
    def should_swap(self, keys: list[BlockKey]) -> bool:
        """Whether a preempted sequence whose full blocks hold `keys` goes to the tier rather than being
        recomputed."""

    @abstractmethod
    def swap_out(self, blocks: list[tuple[int, BlockKey]]) -> None:
        """Write a preempted sequence's full (block, key)s to the tier, all of them: its resumption loads them."""

    @abstractmethod
    def commit(self) -> None:
        """A step ran: the K/V of the blocks indexed before it are written (a write-through tier saves them)."""

    @abstractmethod
    def count_admission(self, swap_in: bool, num_loaded: int, hit_tokens: int, miss_tokens: int) -> None:
        """Count what an admission took from the tier: the blocks a swapped-out sequence's resumption loaded, or
        the prefix tokens the tier served and the full blocks' tokens found in neither pool nor tier."""

    @abstractmethod
    def count_recompute(self) -> None:
        """Count a preemption left to recompute its sequence."""

    @abstractmethod
    def stats(self) -> dict:
        """The tier's counters (LLMEngine.stats()'s kv_offload_* keys); none without a tier."""

    @abstractmethod
    def close(self) -> None:
        """Release the tier: reads not started are cancelled, what it must keep is written. Idempotent."""


class NoConnector(KVConnector):
    """No second tier: it holds no block, so nothing is ever loaded, swapped or counted."""

    def holds(self, key: BlockKey) -> bool:
        return False

    def start_load(self, blocks: list[BlockToLoad]) -> Future:
        raise RuntimeError("there is no second KV tier to load blocks from")

    def finish_load(self, future: Future, blocks: list[BlockToLoad]) -> int:
        raise RuntimeError("there is no second KV tier to load blocks from")

    def cancel_load(self, future: Future) -> None:
        """No load is ever started."""

    def wait_for_load(self, futures: Iterable[Future]) -> None:
        """No load is ever started."""

    def should_swap(self, keys: list[BlockKey]) -> bool:
        return False

    def swap_out(self, blocks: list[tuple[int, BlockKey]]) -> None:
        raise RuntimeError("there is no second KV tier to swap blocks out to")

    def commit(self) -> None:
        """Nothing to save."""

    def count_admission(self, swap_in: bool, num_loaded: int, hit_tokens: int, miss_tokens: int) -> None:
        """Nothing to count."""

    def count_recompute(self) -> None:
        """Nothing to count."""

    def stats(self) -> dict:
        return {}

    def close(self) -> None:
        """Nothing to release."""
