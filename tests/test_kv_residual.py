"""Blocks held exact borrow blocks of the same pool as they fill (int4): a stateful property test of the
cache manager's books, and the engine's, through admissions, appends, chunked prompts, forks, finishes,
preemptions, failed steps and evictions. The blocks borrowed are always those that the blocks still
filling need for the tokens they hold, and all of them come back."""
from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvserve import LLM, SamplingParams
from kvserve.kv.blocks import NoFreeBlocksError
from kvserve.kv.manager import KVCacheManager
from tiny_models import make_checkpoint


def check_books(kv: KVCacheManager, cached: dict[int, int]) -> None:
    """Every block is owned by tables or borrowed once, or free; the blocks held exact are exactly the
    part-full last blocks of the sequences (`cached`: cache tokens per sequence), each borrowing
    borrowed[tokens it holds]."""
    pool, bs = kv.pool, kv.block_size
    owners = Counter(b for table in list(kv.block_tables.values()) + list(kv.pinned.values()) for b in table)
    borrowed = [b for blocks in kv.residuals.values() for b in blocks]
    assert len(set(borrowed)) == len(borrowed) and not set(borrowed) & set(owners), "a block borrowed twice"
    for b in range(pool.num_blocks):
        assert pool.ref_counts[b] == owners[b] + (b in borrowed), f"block {b}: ref count {pool.ref_counts[b]}"
    assert pool.num_free + len(owners) + len(borrowed) == pool.num_blocks, "blocks leaked or double counted"
    filling = {kv.block_tables[s][n // bs]: n % bs for s, n in cached.items() if n % bs and kv.borrowed}
    assert set(kv.residuals) == set(filling), f"held exact {set(kv.residuals)}, filling {set(filling)}"
    for block, tokens in filling.items():
        assert len(kv.residuals[block]) == kv.borrowed[tokens]


@dataclass
class Seq:
    tokens: int          # tokens the sequence has (its prompt, then one more per decode)
    cached: int = 0      # of them, in its cache (fewer once it evicted)
    computed: int = 0


class ResidualMachine(RuleBasedStateMachine):
    """The manager's calls in the engine's order: allocate at scheduling, release_filled once the step
    ran; preemptions free; a failed step frees without release_filled; sink drops and compactions."""

    @initialize(num_blocks=st.integers(6, 40), block_size=st.integers(1, 6), row=st.integers(1, 4),
                page=st.integers(1, 4))
    def setup(self, num_blocks: int, block_size: int, row: int, page: int) -> None:
        # a token's exact numbers take row / page of a block's quantized pages (int4 in bf16: 4 / block_size)
        borrowed = tuple(max(0, -(-t * row // page) - 1) for t in range(block_size))
        self.kv = KVCacheManager(num_blocks, block_size, borrowed)
        self.seqs: dict[int, Seq] = {}
        self.ids = itertools.count()

    def _cached(self) -> dict[int, int]:
        return {i: s.cached for i, s in self.seqs.items() if i in self.kv.block_tables}

    def _write(self, seq_id: int, n: int, commit: bool = True) -> bool:
        """Schedule n tokens of a sequence and run the step; False when the pool is short (nothing changes)."""
        seq, kv = self.seqs[seq_id], self.kv
        needed = kv.num_new_blocks(seq_id, seq.cached, n)
        free = kv.num_free_blocks
        if needed > free:
            with pytest.raises(NoFreeBlocksError):
                kv.allocate(seq_id, seq.cached, n)
            assert kv.num_free_blocks == free
            event("write refused")
            return False
        kv.allocate(seq_id, seq.cached, n)
        assert kv.num_free_blocks == free - needed         # what the scheduler counted is what it took
        if not commit:                                     # the step failed: the engine preempts
            kv.free(seq_id)
            seq.cached = seq.computed = 0
            event("failed step")
            return False
        kv.release_filled(seq_id, seq.cached, n)
        seq.cached += n
        seq.computed += n
        return True

    @rule(prompt=st.integers(1, 14))
    def admit(self, prompt: int) -> None:
        seq_id = next(self.ids)
        self.seqs[seq_id] = Seq(prompt)
        if not self._write(seq_id, prompt):
            self.kv.block_tables.pop(seq_id, None)          # nothing was allocated: no table to keep
            del self.seqs[seq_id]

    @rule(data=st.data(), n=st.integers(1, 7), commit=st.sampled_from([True, True, True, False]))
    def step(self, data: st.DataObject, n: int, commit: bool) -> None:
        """A chunk of a prompt being recomputed, else n new tokens (a decode when n is 1)."""
        if not self.seqs:
            return
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)))
        seq = self.seqs[seq_id]
        pending = seq.tokens - seq.computed
        if pending:
            self._write(seq_id, min(n, pending), commit)
        elif self._write(seq_id, n, commit):
            seq.tokens += n

    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        ids = sorted(i for i, s in self.seqs.items() if s.computed)
        if ids:
            parent = data.draw(st.sampled_from(ids))
            child = next(self.ids)
            self.kv.fork(parent, child)
            p = self.seqs[parent]
            self.seqs[child] = Seq(p.tokens, p.cached, p.computed)

    @rule(data=st.data(), preempt=st.booleans())
    def finish(self, data: st.DataObject, preempt: bool) -> None:
        if not self.seqs:
            return
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)))
        self.kv.free(seq_id)
        if preempt:                         # recomputed from scratch later
            seq = self.seqs[seq_id]
            seq.cached = seq.computed = 0
        else:
            del self.seqs[seq_id]

    @rule(data=st.data())
    def drop_leading_blocks(self, data: st.DataObject) -> None:
        """sink: whole blocks that left the window are let go of."""
        bs = self.kv.block_size
        ids = sorted(i for i, s in self.seqs.items() if s.cached >= 2 * bs)
        if ids:
            seq_id = data.draw(st.sampled_from(ids))
            k = data.draw(st.integers(1, self.seqs[seq_id].cached // bs - 1))
            self.kv.drop(seq_id, range(0, k))
            self.seqs[seq_id].cached -= k * bs

    @rule(data=st.data())
    def compact(self, data: st.DataObject) -> None:
        """h2o / snapkv: the kept tokens go to fresh blocks, the old ones are let go of."""
        ids = sorted(i for i, s in self.seqs.items() if s.cached)
        if not ids:
            return
        seq_id = data.draw(st.sampled_from(ids))
        keep = data.draw(st.integers(1, self.seqs[seq_id].cached))
        try:
            old = self.kv.rebuild(seq_id, keep)
        except NoFreeBlocksError:
            event("compaction refused")
            return
        self.kv.release(old)
        self.seqs[seq_id].cached = keep

    @invariant()
    def books(self) -> None:
        if hasattr(self, "kv"):
            check_books(self.kv, self._cached())

    def teardown(self) -> None:
        if not hasattr(self, "kv"):
            return
        for seq_id in list(self.seqs):
            self.kv.free(seq_id)
        assert not self.kv.block_tables and not self.kv.residuals
        assert self.kv.num_free_blocks == self.kv.num_blocks and not any(self.kv.pool.ref_counts)


ResidualMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                             suppress_health_check=[HealthCheck.too_slow])
TestResidualMachine = ResidualMachine.TestCase


def test_the_checker_catches_a_block_left_borrowing():
    kv = KVCacheManager(8, 4, (0, 1, 1, 2))
    kv.allocate(0, 0, 3)
    check_books(kv, {0: 3})
    kv.release_filled(0, 0, 4)              # as if the block had filled: it holds 3 tokens, still part full
    with pytest.raises(AssertionError):
        check_books(kv, {0: 3})


def test_the_checker_catches_a_leaked_borrowed_block():
    kv = KVCacheManager(8, 4, (0, 1, 1, 2))
    kv.allocate(0, 0, 3)
    kv.residuals[kv.block_tables[0][0]] = []
    with pytest.raises(AssertionError):
        check_books(kv, {0: 3})


# ---------------------------------------------------------------- the engine end to end


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("residual"), "llama", max_position_embeddings=128)


def engine_books(engine) -> None:
    """The manager's books against the sequences the scheduler holds, and the storage's copy of them."""
    kv, bs = engine.kv, engine.kv.block_size
    cached = {s.seq_id: s.num_tokens_in_cache for s in engine.scheduler.running if s.seq_id in kv.block_tables}
    check_books(kv, cached)          # int8, fp8: nothing held exact, nothing borrowed
    engine.storage.plan_writes([], [], [])                 # brings residual_of up to the manager's books
    held = set((engine.storage.residual_of[:, 0] >= 0).nonzero().flatten().tolist())
    assert held == set(kv.residuals)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lens=st.lists(st.integers(1, 40), min_size=1, max_size=6), max_tokens=st.integers(1, 12),
       block_size=st.sampled_from([2, 4, 8, 16]), spare=st.integers(0, 6), budget=st.integers(4, 64),
       chunk=st.integers(1, 24), n=st.integers(1, 3), kv_cache_dtype=st.sampled_from(["int4", "int4", "int8", "fp8"]),
       eviction=st.sampled_from([None, "sink:sinks=2,window=6", "h2o:budget=10,recent=3", "snapkv:budget=12,window=4"]),
       prefix=st.booleans())
def test_engine_borrows_only_for_blocks_filling_and_returns_everything(ckpt, lens, max_tokens, block_size, spare,
                                                                      budget, chunk, n, kv_cache_dtype, eviction,
                                                                      prefix):
    """Tight pools (requests wait and preempt for the blocks they would borrow), chunked prompts, forks,
    prefix hits and evictions: after every step the blocks borrowed are those the blocks still filling
    need, and once every request is done every block is back."""
    probe = LLM(str(ckpt), block_size=block_size, num_kv_blocks=1, kv_cache_dtype=kv_cache_dtype)
    most = probe.engine.kv_spec.residual_blocks
    blocks = -(-(8 + max(lens) + max_tokens) // block_size) + 2 + 2 * most + spare
    llm = LLM(str(ckpt), block_size=block_size, num_kv_blocks=blocks, max_num_batched_tokens=max(budget, chunk),
              long_prefill_token_threshold=chunk, kv_cache_dtype=kv_cache_dtype, eviction=eviction,
              enable_prefix_caching=prefix, max_num_seqs=4)
    engine = llm.engine
    head = torch.randint(3, 384, (8,), generator=torch.Generator().manual_seed(0)).tolist()   # prefix hits
    for i, k in enumerate(lens):
        ids = head + torch.randint(3, 384, (k,), generator=torch.Generator().manual_seed(k)).tolist()
        engine.add_request(str(i), {"prompt_token_ids": ids},
                           SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=True, seed=1))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine_books(engine)
    assert all(len(c.token_ids) == max_tokens for out in done.values() for c in out.outputs) and len(done) == len(lens)
    if most and engine.scheduler.num_preemptions:
        event("preempted")
    stats = llm.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and not engine.kv.residuals
