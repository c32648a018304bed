"""Continuous batching: pack decodes and prefills into one token budget, admit by free blocks, preempt."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvserve.config import SchedulerConfig
from kvserve.engine.sequence import Sequence, SequenceStatus
from kvserve.kv.manager import KVCacheManager


@dataclass
class SchedulerOutput:
    """The sequences of one step, decodes first, and how many new tokens each computes."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    num_decodes: int = 0

    @property
    def empty(self) -> bool:
        return not self.seqs


class Scheduler:
    """Holds the waiting queue and the running list; `kv` is None when the engine keeps no cache."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager | None, watermark: float = 0.01):
        self.config = config
        self.kv = kv
        self.watermark_blocks = int(watermark * kv.num_blocks) if kv else 0
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        preempted = False
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:    # preempted earlier in this loop
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if self.kv is None and n < seq.num_tokens:       # no cache: a sequence runs whole or waits
                continue
            if not self._reserve(seq, n, out):
                preempted = True
                continue
            out.seqs.append(seq)
            out.num_new_tokens.append(n)
            budget -= n
        if not preempted:
            budget = self._admit(out, budget)
        # Decodes (one new token on top of a cache) first: the attention backends expect that order.
        order = sorted(range(len(out.seqs)), key=lambda i: not self._is_decode(out.seqs[i], out.num_new_tokens[i]))
        out.seqs = [out.seqs[i] for i in order]
        out.num_new_tokens = [out.num_new_tokens[i] for i in order]
        out.num_decodes = sum(self._is_decode(s, n) for s, n in zip(out.seqs, out.num_new_tokens))
        return out

    def _is_decode(self, seq: Sequence, n: int) -> bool:
        return self.kv is not None and n == 1 and seq.num_computed_tokens > 0

    def _reserve(self, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        """Blocks for n more tokens of a running sequence, preempting the newest ones if needed."""
        if self.kv is None:
            return True
        while self.kv.num_new_blocks(seq.seq_id, seq.num_computed_tokens, n) > self.kv.num_free_blocks:
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        out.block_copies += self.kv.allocate(seq.seq_id, seq.num_computed_tokens, n)
        return True

    def _admit(self, out: SchedulerOutput, budget: int) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if self.kv is None:
                if n < seq.num_tokens:
                    break
            else:
                needed = self.kv.num_new_blocks(seq.seq_id, seq.num_computed_tokens, n)
                reserve = self.watermark_blocks if self.running else 0
                if needed + reserve > self.kv.num_free_blocks:
                    break
                out.block_copies += self.kv.allocate(seq.seq_id, seq.num_computed_tokens, n)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.seqs.append(seq)
            out.num_new_tokens.append(n)
            budget -= n
        return budget

    def preempt(self, seq: Sequence) -> None:
        """Free a running sequence's blocks and requeue it at the front, to be recomputed."""
        self.running.remove(seq)
        if self.kv is not None:
            self.kv.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark a sequence finished and return its blocks at once (also used for aborts)."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        if self.kv is not None:
            self.kv.free(seq.seq_id)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
