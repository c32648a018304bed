"""Sequence: one request's tokens, progress through the cache, and output text."""
from __future__ import annotations

import copy
import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from kvserve.kv.blocks import BlockKey, block_key
from kvserve.kv.eviction import EvictionPolicy
from kvserve.kv.sparse import SparseAttention
from kvserve.sampling import Logprob, SamplingParams
from kvserve.structured.grammar import NO_GRAMMAR, Grammar


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    # admitted over blocks of the second KV tier: holds fresh blocks for them while they are read (vLLM's)
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    arrival_time: float
    generator: torch.Generator | None = None
    token_ids: list[int] = field(default_factory=list)
    # Leading tokens whose K/V have been computed (evicted ones included); the rest of token_ids is
    # computed by the next steps.
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # incremental detokenization
    output_text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0
    detokenize_stream: Any = None            # a tokenizers DecodeStream, made at the first output token
    first_token_time: float | None = None
    # prefix caching
    cache_salt: str | None = None
    block_keys: list[BlockKey] = field(default_factory=list)   # of the full blocks seen so far
    num_indexed_blocks: int = 0       # leading blocks of the table already in the prefix index
    num_cached_tokens: int = 0        # prompt tokens found in the prefix cache at first admission (vLLM's)
    prefix_queried: bool = False
    # full blocks written to the second tier when it was last preempted (swap), to be read back on resumption
    num_swapped_blocks: int = 0
    # eviction: tokens dropped from the cache still count in positions (RoPE), not in cache slots
    eviction: EvictionPolicy | None = None
    num_evicted_tokens: int = 0
    # [layers * KVH, tokens] mass the cached tokens received (h2o, snapkv), of the layers that gather it
    kv_scores: torch.Tensor | None = None
    prompt_compacted: bool = False           # snapkv has made its choice
    # structured outputs: where the output tokens have brought the request's grammar. A preempted sequence keeps
    # its tokens, and so its grammar's state
    grammar: Grammar = NO_GRAMMAR
    # sparse decode attention: which cached blocks its decode steps read (kv/sparse.py); None: all of them
    sparse: SparseAttention | None = None
    # speculative decoding (engine/speculative.py): the draft tokens proposed after token_ids, which the next
    # step verifies (the scheduler may take fewer), and this sequence's drafts and accepted drafts so far
    spec_token_ids: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def __post_init__(self):
        self.token_ids = list(self.prompt_token_ids)
        self.read_offset = len(self.prompt_token_ids)
        self.prefix_offset = max(self.read_offset - 5, 0)
        if self.params.logprobs is not None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]     # the first token has no context to be scored in

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens_in_cache(self) -> int:
        """Tokens whose K/V the cache holds now: those computed less those evicted."""
        return self.num_computed_tokens - self.num_evicted_tokens

    def fork(self, seq_id: int, generator: torch.Generator | None) -> Sequence:
        """Another sample of the same request from this point: a copy of this sequence with its own token list,
        block keys and logprobs (copies of these), drawing from `generator`; the detokenizer makes it its own
        stream; its grammar is a fork of this one's, in the same state. Its blocks are the cache manager's to share
        (Scheduler.fork)."""
        child = copy.copy(self)
        child.seq_id, child.generator, child.grammar = seq_id, generator, self.grammar.fork()
        child.token_ids, child.block_keys = list(self.token_ids), list(self.block_keys)
        child.logprobs = None if self.logprobs is None else list(self.logprobs)
        child.spec_token_ids = []
        child.detokenize_stream = None
        return child

    def reset_cache_state(self) -> None:
        """Forget everything about the cache (a preempted sequence is recomputed from scratch, or over the
        blocks it finds in the prefix cache and the second tier)."""
        self.num_computed_tokens = self.num_indexed_blocks = self.num_evicted_tokens = 0
        self.kv_scores, self.prompt_compacted = None, False
        self.spec_token_ids = []

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    def full_block_keys(self, block_size: int, num_tokens: int) -> list[BlockKey]:
        """Keys of the full blocks among the first num_tokens tokens (computed once, then reused)."""
        for i in range(len(self.block_keys), num_tokens // block_size):
            parent = self.block_keys[-1].hash if self.block_keys else None
            tokens = tuple(self.token_ids[i * block_size:(i + 1) * block_size])
            self.block_keys.append(block_key(parent, tokens, self.cache_salt))
        return self.block_keys[:num_tokens // block_size]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
