"""Eviction policies: which cached tokens a sequence keeps once its cache outgrows a budget.

Spelled `"sink:sinks=4,window=1020"`, `"h2o:budget=512,recent=64"`, `"snapkv:budget=512,window=32"`
(or a dict with a "policy" key and the same options). Budgets count tokens. The policies only
choose; the engine's Evictor moves the blocks. Each keeps its most recent tokens whole (`recent_option` names
how many): a model's sliding-window layers need that many to cover their window.

The scored policies keep, per layer and KV head, one number for each cached token: the attention
it has received, reduced over the queries (and the heads sharing the KV head) by `mass_reduce`.
A token's score is the sum of those numbers over layers and KV heads: the full-attention layers alone
where a model's sliding windows bind (a sliding layer's attention says nothing of older tokens).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from kvserve.kv.policies import parse_policy, policy_spec


@dataclass(frozen=True)
class EvictionPolicy:
    name: ClassVar[str] = ""
    needs_scores: ClassVar[bool] = False   # the attention mass each cached token receives
    mass_reduce: ClassVar[str] = "sum"      # how a token's mass combines over queries: "sum" or "max"
    recent_option: ClassVar[str] = ""       # the option counting the most recent tokens, always kept
    # its cache holds a bounded window: only max_tokens ends a sequence, which may run past max_model_len
    bounds_context: ClassVar[bool] = False

    def max_cache_tokens(self, block_size: int) -> int | None:
        """The most tokens the cache of one sequence ever holds (None: unbounded)."""
        return None

    def max_tokens_held(self, num_tokens: int, chunk: int, block_size: int) -> int:
        """The most tokens a sequence of num_tokens tokens holds in its cache, its prompt written in chunks of
        at most `chunk` tokens: all of them, unless the policy bounds its cache."""
        return num_tokens

    def pinned_blocks(self, block_size: int) -> int:
        """Blocks it keeps outside a sequence's table, in each layer group that keeps every token."""
        return 0

    def spec(self) -> str:
        return policy_spec(self)

    def check_covers(self, window: int) -> None:
        """Refuse (ValueError naming the policy and the option) a policy that would cut a sliding-window layer's
        `window` (the widest of a model's): such a layer attends to the last W cached tokens, which must be the last W
        positions. Every policy keeps its most recent tokens (sink its `window`, h2o its `recent`, snapkv its
        `window`); with at least W of them, the full-attention layers see what the policy keeps and each sliding
        layer exactly its window, as without a policy. h2o and snapkv then score tokens by the full-attention
        layers' attention alone and evict whole blocks' worth (engine/evictor.py). With the hybrid cache, a policy
        evicts (sink pins, h2o and snapkv compact) in the full-attention layer groups; each sliding group keeps its
        window's blocks as they are."""
        recent = getattr(self, self.recent_option)
        if recent < window:
            raise ValueError(f"eviction {self.spec()!r} with sliding-window layers (window {window}): "
                             f"{self.name}'s {self.recent_option} ({recent}) must be at least {window} tokens, to keep "
                             f"each such layer's window whole")


@dataclass(frozen=True)
class Sink(EvictionPolicy):
    """StreamingLLM: the first `sinks` tokens and the last `window`, counted in whole blocks: the
    blocks holding the sinks stay, and a block is dropped once all its tokens left the window."""

    name: ClassVar[str] = "sink"
    recent_option: ClassVar[str] = "window"
    bounds_context: ClassVar[bool] = True
    sinks: int = 4
    window: int = 1020

    def __post_init__(self):
        _check(self.sinks >= 0 and self.window >= 1, "sink needs sinks >= 0 and window >= 1")

    def sink_blocks(self, block_size: int) -> int:
        return math.ceil(self.sinks / block_size)

    def max_cache_tokens(self, block_size: int) -> int:
        # the sink blocks, the window, and the blocks it straddles (at most one partial at each end)
        return (self.sink_blocks(block_size) + math.ceil(self.window / block_size) + 1) * block_size

    def max_tokens_held(self, num_tokens: int, chunk: int, block_size: int) -> int:
        """The sink blocks and the window, and a prompt chunk on top while it is computed."""
        return min(num_tokens, self.max_cache_tokens(block_size) + chunk)

    def pinned_blocks(self, block_size: int) -> int:
        """The unrotated originals of its sink blocks."""
        return self.sink_blocks(block_size)

    def blocks_to_drop(self, num_cached: int, block_size: int) -> range:
        """Blocks of the table (after the sink blocks) whose tokens are all older than the window."""
        first = self.sink_blocks(block_size)
        last = max(first, (num_cached - self.window) // block_size)   # blocks wholly before the window
        return range(first, last)


@dataclass(frozen=True)
class H2O(EvictionPolicy):
    """Heavy-Hitter Oracle: the last `recent` tokens and the `budget - recent` others that received
    the most attention so far. Holes are compacted once a block's worth of tokens is over budget.

    `score=sum` is the paper's accumulated attention: summed over every query, it favours the early
    tokens that every query sees, and a needle that a single late query looks up loses to them.
    `score=max` (the default) scores a token by the most attention one query gave it (per layer and
    KV head, then summed), so a token that any query needed counts as a heavy hitter."""

    name: ClassVar[str] = "h2o"
    needs_scores: ClassVar[bool] = True
    recent_option: ClassVar[str] = "recent"
    budget: int = 512
    recent: int = 64
    score: str = "max"

    def __post_init__(self):
        _check(0 <= self.recent < self.budget, "h2o needs 0 <= recent < budget")
        _check(self.score in ("max", "sum"), f"h2o's score is max or sum, got {self.score!r}")

    @property
    def mass_reduce(self) -> str:
        return self.score

    def max_cache_tokens(self, block_size: int) -> int:
        return self.budget + block_size

    def keep(self, scores: torch.Tensor, block_size: int, whole_blocks: bool = False) -> torch.Tensor | None:
        """Sorted indices of the tokens to keep, or None while within budget + a block: `budget` of them, or with
        `whole_blocks` as few as leave whole blocks' worth evicted (fewer than budget + block_size)."""
        n = len(scores)
        if n < self.budget + block_size:
            return None
        kept = _num_kept(n, self.budget, block_size, whole_blocks)
        return _top_and_recent(scores, n - self.recent, kept - self.recent)


@dataclass(frozen=True)
class SnapKV(EvictionPolicy):
    """SnapKV: once the prompt is computed, its last `window` tokens' queries vote (attention
    pooled over `pool` neighbours) for the `budget - window` earlier tokens to keep; decoding then
    proceeds with the cache that remains."""

    name: ClassVar[str] = "snapkv"
    needs_scores: ClassVar[bool] = True
    recent_option: ClassVar[str] = "window"
    budget: int = 512
    window: int = 32
    pool: int = 7

    def __post_init__(self):
        _check(0 < self.window < self.budget and self.pool >= 1 and self.pool % 2 == 1,
               "snapkv needs 0 < window < budget and an odd pool >= 1")

    def keep(self, scores: torch.Tensor, block_size: int, whole_blocks: bool = False) -> torch.Tensor | None:
        """Sorted indices of the prompt tokens to keep, or None if the prompt fits the budget: `budget` of them, or
        with `whole_blocks` as few as leave whole blocks' worth evicted (None if that is none)."""
        n = len(scores)
        kept = _num_kept(n, self.budget, block_size, whole_blocks)
        if n <= kept:
            return None
        pooled = F.max_pool1d(scores[None, None], self.pool, stride=1, padding=self.pool // 2)[0, 0]
        return _top_and_recent(pooled, n - self.window, kept - self.window)


POLICIES = {p.name: p for p in (Sink, H2O, SnapKV)}
_FORM = ('expected "sink:sinks=4,window=1020", "h2o:budget=512,recent=64", "snapkv:budget=512,window=32" '
         '(options may be left out) or a dict with a "policy" key')


def _num_kept(n: int, budget: int, block_size: int, whole_blocks: bool) -> int:
    """How many of n cached tokens a policy of `budget` keeps: the budget, or with `whole_blocks` the fewest of at
    least budget that leave a multiple of block_size evicted (n itself when n <= budget)."""
    if not whole_blocks or n <= budget:
        return min(n, budget)
    return n - (n - budget) // block_size * block_size


def _top_and_recent(scores: torch.Tensor, recent_start: int, top: int) -> torch.Tensor:
    """The `top` best-scored tokens before recent_start, and every token from it on, in order."""
    best = scores[:recent_start].topk(top).indices
    recent = torch.arange(recent_start, len(scores), device=scores.device)
    return torch.cat((best.sort().values, recent))


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def parse_eviction(spec: str | dict | EvictionPolicy | None) -> EvictionPolicy | None:
    """A policy from "name:key=value,..." or {"policy": name, key: value}; None or "none": no eviction.

    Anything else raises ValueError showing the form (kv/policies.py's parse_policy)."""
    return parse_policy(spec, POLICIES, "eviction", _FORM, EvictionPolicy)
