"""Speculative decoding: drafts proposed after a sequence's tokens, verified by the target model in one step.

A proposer guesses the next tokens of each decoding sequence (its drafts, Sequence.spec_token_ids): `ngram` copies
them from earlier text of the same sequence, prompt included (prompt lookup), `draft_model` runs a small model that
shares the tokenizer (engine/draft_model.py). The next step computes each sequence's new token and its drafts at
once, a row of one query each (a multi-token decode: engine/runner.py); the rejection sampler (sampling.py) keeps
the drafts the target model agrees with and draws one token after them, so that the outputs follow the target's
distribution exactly (greedy ones are the tokens of plain greedy decoding). The K/V of the drafts it rejects leave
the cache at once (Scheduler.release_rejected); the accepted ones are taken one at a time as their tokens are
appended (Scheduler.advance), so that the cache, the prefix index and the second tier see only verified tokens.

Configured as vLLM's `speculative_config` (`--speculative-config JSON`):
`{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}` or
`{"model": PATH, "num_speculative_tokens": 4}`, and `disable_by_batch_size`: no drafts while more sequences run.
"""
from __future__ import annotations

import json
import numbers
from dataclasses import dataclass, field, fields
from typing import Any, Callable

import numpy as np

from kvserve.config import QUANTIZATIONS
from kvserve.engine.scheduler import Scheduler
from kvserve.engine.sequence import Sequence, SequenceStatus
from kvserve.kv.eviction import EvictionPolicy
from kvserve.sampling import DraftResult, RejectionSampler, Sampler, TokenMask

METHODS = ("ngram", "draft_model")
# the token masks of the verification rows of some sequences (structured outputs'), or None: what verify samples in
DraftMasks = Callable[[list[Sequence]], TokenMask | None]
# From a few sequences on, a CPU's step of 1 + k tokens a sequence computes more than it reads, and its extra rows
# cost their share: past 4 sequences, 4 drafts a step need more tokens a step than lookup usually gains to pay
# (measured by `kvserve bench spec`: docs/performance.md's spec section)
DEFAULT_DISABLE_BY_BATCH_SIZE = 4


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's speculative_config: the method, the draft model of draft_model (and its weights' quantization, as the
    engine's `quantization` quantizes them at load), how many drafts a step verifies, the n-gram sizes of ngram, and
    the batch size past which no sequence proposes."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    model: str | None = None
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE
    quantization: str | None = None     # the draft model's weights quantized as it loads, as the engine's own

    @classmethod
    def parse(cls, value: str | dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """The config of a dict, its JSON text, or a config (None: none); ValueError naming what is wrong. vLLM's
        defaults: a `model` without `method` is draft_model; ngram's sizes default to each other, else 5."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object (a dict), got {value!r}")
        known = {f.name for f in fields(cls)}
        if unknown := sorted(set(value) - known):
            raise ValueError(f"speculative_config: unknown keys {unknown}; kvserve takes {sorted(known)}")
        spec = dict(value)
        spec.setdefault("method", "draft_model" if spec.get("model") is not None else "ngram")
        if spec["method"] not in METHODS:
            raise ValueError(f"speculative_config: method must be one of {METHODS}, got {spec['method']!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size"):
            if spec.get(name) is not None:
                spec[name] = _positive(name, spec[name])
        lo, hi = spec.get("prompt_lookup_min"), spec.get("prompt_lookup_max")
        spec["prompt_lookup_min"], spec["prompt_lookup_max"] = lo or hi or 5, hi or lo or 5
        if spec["prompt_lookup_min"] > spec["prompt_lookup_max"]:
            raise ValueError(f"speculative_config: prompt_lookup_min ({spec['prompt_lookup_min']}) must be at most "
                             f"prompt_lookup_max ({spec['prompt_lookup_max']})")
        if spec["method"] == "draft_model" and not isinstance(spec.get("model"), str):
            raise ValueError("speculative_config: method draft_model needs 'model', the draft checkpoint's path")
        if spec["method"] == "ngram" and (spec.get("model") is not None or spec.get("quantization") is not None):
            raise ValueError("speculative_config: method ngram takes no 'model' nor 'quantization' (its drafts come "
                             "from the text)")
        if spec.get("quantization") not in (None, *QUANTIZATIONS):
            raise ValueError(f"speculative_config: quantization must be one of {QUANTIZATIONS} (or null), got "
                             f"{spec['quantization']!r}")
        return cls(**{k: v for k, v in spec.items() if v is not None})


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"speculative_config: {name} must be a positive integer, got {value!r}")
    return int(value)


def check_eviction(policy: EvictionPolicy | None) -> None:
    """ValueError for an eviction policy that speculative decoding cannot keep exact: one that scores each cached
    token by the attention of every decode query (h2o), which a verification's rejected drafts would add to."""
    if policy is not None and policy.scores_decodes:
        raise ValueError(f"eviction {policy.spec()!r} with speculative decoding: {policy.name} scores the cache by the "
                         f"attention of every decode query, and a verification's rejected drafts would count; use "
                         f"sink or snapkv, or no speculative_config")


@dataclass
class Verified:
    """A sequence's verification: its accepted drafts and the token after them (DraftResult)."""

    seq: Sequence
    result: DraftResult


@dataclass
class SpecDecodeStats:
    """vLLM's spec_decode counters: verifications (drafts), draft tokens, accepted ones, and accepted by position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_draft_tokens:
            self.accepted_per_pos += [0] * (num_draft_tokens - len(self.accepted_per_pos))
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1

    def as_dict(self) -> dict:
        return {"spec_decode_num_drafts": self.num_drafts, "spec_decode_num_draft_tokens": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
                "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_pos)}


class Proposer:
    """Guesses the next tokens of decoding sequences. `draft(seqs, limits)` is each kind's own: the drafts of each
    sequence, at most its limit (at least 1); the rest is shared."""

    def draft(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        raise NotImplementedError

    def retain(self, running: list[Sequence]) -> None:
        """Forget what it holds of sequences no longer running (a draft model's cache)."""


class NgramProposer(Proposer):
    """Prompt lookup (vLLM's ngram): the longest suffix of prompt_lookup_max down to prompt_lookup_min tokens that
    occurs earlier in the sequence, prompt and outputs alike, and the tokens that followed its latest occurrence."""

    def __init__(self, lookup_min: int, lookup_max: int):
        self.lookup_min, self.lookup_max = lookup_min, lookup_max

    def draft(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        return [ngram_lookup(np.asarray(s.token_ids), self.lookup_min, self.lookup_max, k)
                for s, k in zip(seqs, limits)]


def ngram_lookup(tokens: np.ndarray, lookup_min: int, lookup_max: int, k: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest suffix of tokens of lookup_max
    down to lookup_min tokens; [] where none occurs."""
    for n in range(min(lookup_max, len(tokens) - 1), lookup_min - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
        starts = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if len(starts):
            after = starts[-1] + n
            return tokens[after:after + k].tolist()
    return []


class SpeculativeDecoding:
    """The engine's speculation: `propose` after each step, `verify` the step's drafts; `stats` in vLLM's names.
    Without a speculative_config an engine has NoSpeculation, which proposes nothing."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer, sampler: Sampler, scheduler: Scheduler,
                 storage, max_model_len: int, block_size: int):
        """`storage`: the KV storage (under tensor parallelism, one that makes each change on every rank)."""
        self.config, self.proposer, self.scheduler, self.storage = config, proposer, scheduler, storage
        self.rejection_sampler = RejectionSampler(sampler)
        self.max_model_len, self.block_size = max_model_len, block_size
        self.counters = SpecDecodeStats()

    def check_request(self, policy: EvictionPolicy | None) -> None:
        """ValueError for a request whose eviction policy speculation cannot keep exact (check_eviction)."""
        check_eviction(policy)

    def propose(self, seqs: list[Sequence], running: list[Sequence]) -> None:
        """Drafts for those of `seqs` (sequences that gained tokens) that run and decode next, within each one's
        limit (max_drafts): none while more than disable_by_batch_size sequences run. A sequence held to a grammar
        (structured outputs) keeps the drafts its grammar allows, up to the first it does not: the others could
        never be accepted."""
        self.proposer.retain(running)
        decoding = [s for s in seqs if s.status is SequenceStatus.RUNNING and s.num_computed_tokens + 1 == s.num_tokens]
        if len(running) > self.config.disable_by_batch_size:
            for seq in decoding:
                seq.spec_token_ids = []
            return
        limits = [self.max_drafts(s) for s in decoding]
        wanted = [(s, k) for s, k in zip(decoding, limits) if k > 0]
        for seq in decoding:
            seq.spec_token_ids = []
        if wanted:
            for (seq, _), drafts in zip(wanted, self.proposer.draft(*map(list, zip(*wanted)))):
                seq.spec_token_ids = drafts[:seq.grammar.validate(drafts)]

    def max_drafts(self, seq: Sequence) -> int:
        """The drafts a sequence may verify next: num_speculative_tokens, fewer where its tokens would pass max_tokens
        or max_model_len (a step emits its accepted drafts and one token more), and fewer where its eviction policy
        would evict before the verified tokens' queries (each must see the cache that plain decoding shows it:
        EvictionPolicy.tokens_before_eviction)."""
        k = min(self.config.num_speculative_tokens, seq.max_tokens - seq.num_output_tokens - 1)
        policy = seq.eviction
        if policy is None or not policy.bounds_context:
            k = min(k, self.max_model_len - seq.num_tokens - 1)
        if policy is not None:
            room = policy.tokens_before_eviction(seq.num_tokens_in_cache, self.block_size, seq.prompt_compacted)
            if room is not None:
                k = min(k, room - 1)
        return k

    def verify(self, seqs: list[Sequence], out, masks: DraftMasks) -> tuple[list[Verified], list[Sequence], Any]:
        """The step's verifications (StepOutput `out`'s rows with drafts), in `seqs` (the step's sampling sequences):
        each sequence's accepted drafts and the token after them (drawn within the `masks` of their rows: those of
        structured outputs' grammars), its rejected drafts' blocks released; and the other sequences with their
        logits rows, to sample as usual."""
        if not any(out.num_drafts):
            return [], seqs, out.logits
        checked = [seqs[i] for i, k in enumerate(out.num_drafts) if k]
        rest = [i for i, k in enumerate(out.num_drafts) if not k]
        results = self.rejection_sampler(out.verify_logits, [s.spec_token_ids for s in checked],
                                         [s.params for s in checked], [s.generator for s in checked],
                                         [(s.token_ids, s.num_prompt_tokens) for s in checked], masks(checked))
        for seq, result in zip(checked, results):
            num_drafts = len(seq.spec_token_ids)
            self.counters.observe(num_drafts, result.num_accepted)
            seq.num_draft_tokens += num_drafts
            seq.num_accepted_tokens += result.num_accepted
            seq.spec_token_ids = []
            self.scheduler.release_rejected(seq, result.num_accepted)
            self._forget_rejected(seq, result.num_accepted, num_drafts)
        logits = out.logits[rest] if rest else out.logits[:0]
        return [Verified(s, r) for s, r in zip(checked, results)], [seqs[i] for i in rest], logits

    def _forget_rejected(self, seq: Sequence, num_accepted: int, num_drafts: int) -> None:
        """The block where the sequence's cache now ends, if rejected drafts were written past its last token there:
        its page summaries (sparse attention's) taken again from the tokens it keeps, as plain decoding leaves them."""
        kept = seq.num_tokens_in_cache + num_accepted         # as release_rejected keeps them
        if num_accepted < num_drafts and kept % self.block_size:
            tables = self.scheduler.kv.group_tables(seq.seq_id)
            self.storage.summarize_prefix([t[kept // self.block_size] for t in tables], kept % self.block_size)

    def stats(self) -> dict:
        return self.counters.as_dict()


class NoSpeculation:
    """An engine without speculative decoding: no drafts, hence nothing to verify."""

    def check_request(self, policy: EvictionPolicy | None) -> None:
        """Every policy."""

    def propose(self, seqs: list[Sequence], running: list[Sequence]) -> None:
        """Nothing."""

    def verify(self, seqs: list[Sequence], out, masks: DraftMasks) -> tuple[list[Verified], list[Sequence], Any]:
        return [], seqs, out.logits

    def stats(self) -> dict:
        return {}
