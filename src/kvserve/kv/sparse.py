"""Sparse decode attention: which of a sequence's cached blocks each decode step reads, every token kept.

Spelled `"quest:budget=2048,recent=128,sinks=16,dense_layers=2"` (or a dict with a "policy" key; options may
be left out). Quest (Tang et al., ICML 2024) keeps, per block, layer and KV head, the element-wise minimum and
maximum of the block's keys (kv/summaries.py), and ranks a block for a query q by the bound
sum_i max(q_i * min_i, q_i * max_i), which no key of the block can score above. At each decode step, for each
sequence, layer and KV head (the query heads of a GQA group share one selection: their bounds summed), it reads
the blocks holding the first `sinks` tokens, those holding the last `recent` tokens, and the best-bounded others
up to `budget` tokens in all (in whole blocks), and attends exactly over them. Prefill, the first
`dense_layers` layers, sliding-window layers and a sequence whose context is at most `budget` stay dense, and so
does a (sequence, layer, KV head) where choosing would read more than it skips (selection_pays): choosing reads
the summary of each block between the sinks and the recent window, so it pays only where the blocks it leaves out
hold more bytes than those summaries (with bfloat16 pages and summaries and blocks of 16 tokens, where it leaves out
more than 1/16 of those blocks).

Beside an eviction policy (kv/eviction.py), the policy decides which tokens the cache keeps and sparse attention
which of the kept blocks a decode reads: the context is the cache (the sinks its first tokens, the recent window
its last), and the summaries follow every rewrite of the policy's (compaction, rotated sinks).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvserve.kv.policies import parse_policy, policy_spec


@dataclass(frozen=True)
class SparseAttention:
    name: ClassVar[str] = ""

    def spec(self) -> str:
        return policy_spec(self)


@dataclass(frozen=True)
class Quest(SparseAttention):
    """Query-aware block selection within a token budget, sinks and a recent window always read."""

    name: ClassVar[str] = "quest"
    budget: int = 2048
    recent: int = 128
    sinks: int = 16
    dense_layers: int = 2

    def __post_init__(self):
        if not (self.recent >= 1 and self.sinks >= 0 and self.dense_layers >= 0):
            raise ValueError("quest needs recent >= 1, sinks >= 0 and dense_layers >= 0")
        if self.budget < self.sinks + self.recent:
            raise ValueError(f"quest's budget ({self.budget}) must be at least sinks + recent "
                             f"({self.sinks} + {self.recent})")

    def params(self) -> tuple[int, int, int, int]:
        """What the kernels take of it per sequence: budget, sinks and recent (tokens), dense_layers."""
        return self.budget, self.sinks, self.recent, self.dense_layers


def selection_pays(middle, chosen, page_bytes: int, summary_bytes: int):
    """Whether a decode task chooses `chosen` of the `middle` blocks between its sinks and its recent window (ints,
    or tensors of them) rather than reading them all: where the bytes it skips, middle - chosen blocks of
    page_bytes (a block's K and V in one KV head, their scales included), exceed the bytes it reads to choose, a
    summary of summary_bytes for each middle block. The other work of choosing (a bound of 2 x head_dim products a
    block, and picking the highest) is smaller per block than attention's over a block of keys, so that where the
    bytes say choose, choosing costs less than it saves."""
    return (middle - chosen) * page_bytes > middle * summary_bytes


POLICIES = {p.name: p for p in (Quest,)}
_FORM = 'expected "quest:budget=2048,recent=128,sinks=16,dense_layers=2" (options may be left out), "none", ' \
        'or a dict with a "policy" key'


def parse_sparse_attention(spec: str | dict | SparseAttention | None) -> SparseAttention | None:
    """A policy from "quest:key=value,..." or {"policy": "quest", key: value}; None or "none": dense attention.

    Anything else raises ValueError showing the form (kv/policies.py's parse_policy)."""
    return parse_policy(spec, POLICIES, "sparse_attention", _FORM, SparseAttention)


def request_sparse_attention(default: SparseAttention | None, spec: str | dict | None) -> SparseAttention | None:
    """A request's sparse attention: its own `spec` (SamplingParams.sparse_attention; "none": dense), else the
    engine's `default`. ValueError for one the engine cannot serve: sparse attention where the engine keeps no page
    summaries (started without sparse_attention)."""
    policy = default if spec is None else parse_sparse_attention(spec)
    if policy is not None and default is None:
        raise ValueError("sparse_attention needs an engine started with sparse_attention (--sparse-attention): only "
                         "then does its cache keep the page summaries that the selection reads")
    return policy
