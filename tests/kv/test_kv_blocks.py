"""BlockPool, KVCacheManager and KVSpec: unit tests and a stateful property test of block ownership."""
from __future__ import annotations

import copy
import itertools
from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvserve.kv.blocks import BlockPool, NoFreeBlocksError, block_key
from kvserve.kv.groups import LayerGroup
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.spec import KVSpec


def free_list(pool: BlockPool) -> list[int]:
    return list(pool._free)


def snapshot(kv: KVCacheManager) -> tuple:
    return list(kv.pool.ref_counts), free_list(kv.pool), copy.deepcopy(kv.block_tables)


# ---------------------------------------------------------------- BlockPool


def test_pool_allocate_and_decref_round_trip() -> None:
    pool = BlockPool(4)
    ids = pool.allocate(3)
    assert len(set(ids)) == 3 and all(0 <= b < 4 for b in ids)
    assert pool.num_free == 1
    assert [pool.ref_counts[b] for b in ids] == [1, 1, 1]
    for b in ids:
        pool.decref(b)
    assert pool.num_free == 4
    assert pool.ref_counts == [0, 0, 0, 0]
    assert sorted(free_list(pool)) == [0, 1, 2, 3]


def test_pool_allocate_zero() -> None:
    pool = BlockPool(2)
    assert pool.allocate(0) == []
    assert pool.num_free == 2


def test_pool_rejects_empty_pool() -> None:
    with pytest.raises(ValueError):
        BlockPool(0)


def test_pool_shared_block_is_freed_by_last_owner() -> None:
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.incref(b)
    assert pool.ref_counts[b] == 2
    pool.decref(b)
    assert pool.num_free == 1 and b not in free_list(pool)
    pool.decref(b)
    assert pool.num_free == 2 and b in free_list(pool)


def test_pool_double_free_raises() -> None:
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.decref(b)
    with pytest.raises(RuntimeError, match="double free"):
        pool.decref(b)
    assert pool.num_free == 2 and pool.ref_counts[b] == 0
    assert sorted(free_list(pool)) == [0, 1]


def test_pool_decref_of_never_allocated_block_raises() -> None:
    pool = BlockPool(2)
    with pytest.raises(RuntimeError):
        pool.decref(1)
    assert sorted(free_list(pool)) == [0, 1]


def test_pool_incref_of_free_block_raises() -> None:
    pool = BlockPool(2)
    with pytest.raises(RuntimeError):
        pool.incref(0)
    assert pool.ref_counts == [0, 0] and pool.num_free == 2


def test_pool_exhaustion_raises_and_changes_nothing() -> None:
    pool = BlockPool(3)
    held = pool.allocate(2)
    before = list(pool.ref_counts), free_list(pool)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(2)
    assert (list(pool.ref_counts), free_list(pool)) == before
    (last,) = pool.allocate(1)
    assert last not in held and pool.num_free == 0


def test_no_free_blocks_error_is_a_runtime_error() -> None:
    assert issubclass(NoFreeBlocksError, RuntimeError)


# ---------------------------------------------------------------- KVCacheManager


def test_blocks_for() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    assert [kv.blocks_for(n) for n in (0, 1, 3, 4, 5, 8, 9)] == [0, 1, 1, 1, 2, 2, 3]


def test_num_new_blocks_for_a_fresh_sequence() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    assert kv.num_new_blocks(0, 0, 0) == 0
    assert kv.num_new_blocks(0, 0, 1) == 1
    assert kv.num_new_blocks(0, 0, 4) == 1
    assert kv.num_new_blocks(0, 0, 5) == 2
    assert kv.num_free_blocks == 8


def test_num_new_blocks_growth_only_at_boundaries() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    kv.allocate(0, 0, 6)
    assert kv.num_new_blocks(0, 6, 2) == 0
    assert kv.num_new_blocks(0, 6, 3) == 1
    assert kv.num_new_blocks(0, 6, 7) == 2


def test_num_new_blocks_counts_copy_on_write() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    kv.allocate(0, 0, 6)
    kv.fork(0, 1)
    assert kv.num_new_blocks(1, 6, 1) == 1
    assert kv.num_new_blocks(1, 6, 3) == 2
    assert kv.num_new_blocks(1, 8, 1) == 1
    assert kv.num_new_blocks(1, 0, 6) == 2


def test_allocate_grows_across_block_boundaries() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    assert kv.allocate(0, 0, 3) == []
    assert len(kv.block_tables[0]) == 1
    assert kv.allocate(0, 3, 1) == []
    assert len(kv.block_tables[0]) == 1
    assert kv.allocate(0, 4, 1) == []
    assert len(kv.block_tables[0]) == 2
    first_two = list(kv.block_tables[0])
    assert kv.allocate(0, 5, 6) == []
    table = kv.block_tables[0]
    assert len(table) == 3 and table[:2] == first_two
    assert kv.num_free_blocks == 5
    kv.check_invariants()


def test_fork_shares_blocks() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    kv.allocate(0, 0, 6)
    kv.fork(0, 1)
    assert kv.block_tables[1] == kv.block_tables[0]
    assert kv.block_tables[1] is not kv.block_tables[0]
    assert all(kv.pool.ref_counts[b] == 2 for b in kv.block_tables[0])
    assert kv.num_free_blocks == 6
    kv.check_invariants()


def test_unshare_gives_fresh_blocks_where_a_fork_shares_them() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    kv.allocate(0, 0, 10)
    kv.replace(0, range(1), pin=True)       # a sink's working copy, its original pinned
    kv.fork(0, 1)
    parent = list(kv.block_tables[0])
    kv.unshare(1, range(2))
    child = kv.block_tables[1]
    assert child[2] == parent[2] and not {*child[:2]} & {*parent}
    assert [kv.pool.ref_counts[b] for b in parent] == [1, 1, 2]
    kv.unshare(1, range(2))                 # its own already: nothing changes
    assert kv.block_tables[1] == child
    kv.check_invariants()
    kv.fork(0, 2)
    assert kv.num_free_blocks == 2
    before = snapshot(kv)
    with pytest.raises(NoFreeBlocksError):  # three shared blocks, two free: none is replaced
        kv.unshare(2, range(3))
    assert snapshot(kv) == before


def test_fork_into_existing_sequence_raises() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    kv.allocate(0, 0, 2)
    kv.allocate(1, 0, 2)
    before = snapshot(kv)
    with pytest.raises(ValueError):
        kv.fork(0, 1)
    assert snapshot(kv) == before


def test_copy_on_write_of_a_shared_partial_block() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    kv.allocate(0, 0, 6)
    kv.fork(0, 1)
    full, partial = kv.block_tables[0]
    copies = kv.allocate(1, 6, 1)
    assert len(copies) == 1
    src, dst = copies[0]
    assert src == partial and dst not in (full, partial)
    assert kv.block_tables[1] == [full, dst]
    assert kv.block_tables[0] == [full, partial]
    assert kv.pool.ref_counts[full] == 2
    assert kv.pool.ref_counts[partial] == 1
    assert kv.pool.ref_counts[dst] == 1
    kv.check_invariants()


def test_other_owner_writes_in_place_after_the_copy() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    kv.allocate(0, 0, 6)
    kv.fork(0, 1)
    kv.allocate(1, 6, 1)
    table = list(kv.block_tables[0])
    assert kv.allocate(0, 6, 1) == []
    assert kv.block_tables[0] == table


def test_write_after_a_full_shared_block_needs_no_copy() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    kv.allocate(0, 0, 8)
    kv.fork(0, 1)
    assert kv.allocate(1, 8, 1) == []
    assert kv.block_tables[1][:2] == kv.block_tables[0]
    assert len(kv.block_tables[1]) == 3
    kv.check_invariants()


def test_free_of_one_owner_keeps_shared_blocks() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    kv.allocate(0, 0, 6)
    kv.fork(0, 1)
    table = list(kv.block_tables[0])
    kv.free(0)
    assert 0 not in kv.block_tables
    assert kv.block_tables[1] == table
    assert all(kv.pool.ref_counts[b] == 1 for b in table)
    assert kv.num_free_blocks == 6
    assert kv.allocate(1, 6, 1) == [], "a sole owner must not copy"
    kv.free(1)
    assert kv.num_free_blocks == 8
    kv.check_invariants()


def test_free_of_unknown_sequence_is_a_no_op() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    kv.allocate(0, 0, 5)
    before = snapshot(kv)
    kv.free(7)
    assert snapshot(kv) == before


def test_allocate_failure_leaves_state_unchanged() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4)
    kv.allocate(0, 0, 6)
    before = snapshot(kv)
    with pytest.raises(NoFreeBlocksError):
        kv.allocate(1, 0, 8)
    assert snapshot(kv) == before
    assert 1 not in kv.block_tables


def test_copy_on_write_failure_leaves_state_unchanged() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4)
    kv.allocate(0, 0, 6)
    kv.fork(0, 1)
    assert kv.num_free_blocks == 1
    before = snapshot(kv)
    with pytest.raises(NoFreeBlocksError):
        kv.allocate(1, 6, 3)
    assert snapshot(kv) == before


def test_copy_on_write_uses_the_last_free_block() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4)
    kv.allocate(0, 0, 6)
    kv.fork(0, 1)
    assert len(kv.allocate(1, 6, 2)) == 1
    assert kv.num_free_blocks == 0
    kv.check_invariants()


# ---------------------------------------------------------------- KVSpec


def test_spec_seed_example() -> None:
    spec = KVSpec(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.float16)
    assert spec.bytes_per_number == 2
    assert spec.bytes_per_token == 131072
    assert spec.bytes_for(4096) == 536870912 == 2**29


def test_spec_blocks() -> None:
    spec = KVSpec(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.float16)
    assert spec.bytes_per_block == 16 * 131072
    assert spec.num_blocks_for(2**29) == 256
    assert spec.num_blocks_for(2**29 - 1) == 255
    assert spec.num_blocks_for(16 * 131072 - 1) == 0


def test_spec_dtype_width() -> None:
    assert KVSpec(2, 1, 4, torch.float32).bytes_per_token == 2 * 2 * 1 * 4 * 4
    assert KVSpec(2, 1, 4, torch.bfloat16).bytes_per_token == 2 * 2 * 1 * 4 * 2


# ---------------------------------------------------------------- stateful property test


@dataclass
class ModelSeq:
    """What the test knows about a sequence: its tokens, how many are cached, its logical pages."""

    tokens: list[int]
    num_computed: int = 0
    pages: list[int] = field(default_factory=list)


class KVMachine(RuleBasedStateMachine):
    """Random adds, appends, chunked recomputes, forks, frees and preemptions against a model.

    The model gives every page a logical id: a fork copies the ids, a copy-on-write or a new block
    gets a fresh one. Two tables may hold the same physical block exactly when they hold the same
    logical page. A fake page store checks that every sequence reads back its own tokens.
    """

    def __init__(self) -> None:
        super().__init__()
        self.seqs: dict[int, ModelSeq] = {}
        self.seq_ids = itertools.count()
        self.token_ids = itertools.count()
        self.page_ids = itertools.count()

    @initialize(num_blocks=st.integers(6, 24), block_size=st.integers(1, 5))
    def setup(self, num_blocks: int, block_size: int) -> None:
        self.kv = KVCacheManager(num_blocks, block_size)
        self.store: dict[int, list[int | None]] = {b: [None] * block_size for b in range(num_blocks)}

    def _page_owners(self) -> Counter:
        return Counter(p for s in self.seqs.values() for p in s.pages)

    def _write(self, seq_id: int, n: int) -> bool:
        """Cache the next n tokens of a sequence; False when the pool is short."""
        seq = self.seqs[seq_id]
        bs = self.kv.block_size
        start, end = seq.num_computed, seq.num_computed + n
        owners = self._page_owners()
        first, last = start // bs, min(len(seq.pages), self.kv.blocks_for(end))
        to_copy = [i for i in range(first, last) if owners[seq.pages[i]] > 1]
        grow = self.kv.blocks_for(end) - len(seq.pages)
        expected = len(to_copy) + max(0, grow)
        assert self.kv.num_new_blocks(seq_id, start, n) == expected

        before = snapshot(self.kv)
        old_table = list(self.kv.block_tables.get(seq_id, []))
        if expected > self.kv.num_free_blocks:
            with pytest.raises(NoFreeBlocksError):
                self.kv.allocate(seq_id, start, n)
            assert snapshot(self.kv) == before
            event("allocation refused")
            return False
        copies = self.kv.allocate(seq_id, start, n)
        table = self.kv.block_tables[seq_id]
        assert self.kv.num_free_blocks == len(before[1]) - expected
        assert copies == [(old_table[i], table[i]) for i in to_copy]
        assert [table[i] for i in range(len(old_table)) if i not in to_copy] == \
               [old_table[i] for i in range(len(old_table)) if i not in to_copy]
        assert len(table) == self.kv.blocks_for(end)
        if copies:
            event("copy-on-write")

        for i in to_copy:
            seq.pages[i] = next(self.page_ids)
        seq.pages += [next(self.page_ids) for _ in range(max(0, grow))]
        for src, dst in copies:
            self.store[dst] = list(self.store[src])
        for pos in range(start, end):
            self.store[table[pos // bs]][pos % bs] = seq.tokens[pos]
        seq.num_computed = end
        return True

    def _fresh_tokens(self, n: int) -> list[int]:
        return [next(self.token_ids) for _ in range(n)]

    @rule(prompt_len=st.integers(1, 12))
    def add(self, prompt_len: int) -> None:
        seq_id = next(self.seq_ids)
        self.seqs[seq_id] = ModelSeq(self._fresh_tokens(prompt_len))
        if not self._write(seq_id, prompt_len):
            assert seq_id not in self.kv.block_tables

    def _pick(self, data: st.DataObject, ids: list[int]) -> int | None:
        return data.draw(st.sampled_from(sorted(ids))) if ids else None

    def _step(self, seq_id: int, n: int) -> None:
        seq = self.seqs[seq_id]
        pending = len(seq.tokens) - seq.num_computed
        if pending:
            self._write(seq_id, min(n, pending))
            return
        seq.tokens += self._fresh_tokens(n)
        if not self._write(seq_id, n):
            del seq.tokens[-n:]

    def _fork(self, parent_id: int) -> int:
        parent = self.seqs[parent_id]
        child_id = next(self.seq_ids)
        self.kv.fork(parent_id, child_id)
        self.seqs[child_id] = ModelSeq(list(parent.tokens), parent.num_computed, list(parent.pages))
        assert self.kv.block_tables[child_id] == self.kv.block_tables.get(parent_id, [])
        return child_id

    @rule(data=st.data(), n=st.integers(1, 7))
    def step(self, data: st.DataObject, n: int) -> None:
        """Decode or append n new tokens; a preempted sequence recomputes a chunk of its tokens instead."""
        seq_id = self._pick(data, list(self.seqs))
        if seq_id is not None:
            self._step(seq_id, n)

    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent_id = self._pick(data, list(self.seqs))
        if parent_id is not None:
            self._fork(parent_id)

    @rule(data=st.data(), n=st.integers(1, 3), child_first=st.booleans())
    def fork_and_decode(self, data: st.DataObject, n: int, child_first: bool) -> None:
        """Parallel sampling: both branches of a fresh fork write their next tokens."""
        parent_id = self._pick(data, [i for i, s in self.seqs.items() if s.num_computed])
        if parent_id is None:
            return
        child_id = self._fork(parent_id)
        for seq_id in (child_id, parent_id) if child_first else (parent_id, child_id):
            self._step(seq_id, n)

    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq_id = self._pick(data, list(self.seqs))
        if seq_id is None:
            return
        self.kv.free(seq_id)
        del self.seqs[seq_id]
        assert seq_id not in self.kv.block_tables

    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        seq_id = self._pick(data, [i for i, s in self.seqs.items() if s.num_computed])
        if seq_id is None:
            return
        self.kv.free(seq_id)
        self.seqs[seq_id].num_computed = 0
        self.seqs[seq_id].pages = []

    @invariant()
    def ownership(self) -> None:
        self.kv.check_invariants()

    @invariant()
    def sharing_only_through_fork(self) -> None:
        """Physical block and logical page determine each other."""
        page_of: dict[int, int] = {}
        block_of: dict[int, int] = {}
        for seq_id, seq in self.seqs.items():
            table = self.kv.block_tables.get(seq_id, [])
            assert len(table) == len(seq.pages) == self.kv.blocks_for(seq.num_computed)
            for block, page in zip(table, seq.pages):
                assert page_of.setdefault(block, page) == page, f"block {block} shared without a fork"
                assert block_of.setdefault(page, block) == block, f"page {page} split without a copy"

    @invariant()
    def tables_only_for_known_sequences(self) -> None:
        assert set(self.kv.block_tables) <= set(self.seqs)

    @invariant()
    def every_sequence_reads_its_own_tokens(self) -> None:
        bs = self.kv.block_size
        for seq_id, seq in self.seqs.items():
            table = self.kv.block_tables.get(seq_id, [])
            cached = [self.store[table[p // bs]][p % bs] for p in range(seq.num_computed)]
            assert cached == seq.tokens[:seq.num_computed], f"sequence {seq_id} reads foreign tokens"

    def teardown(self) -> None:
        if not hasattr(self, "kv"):
            return
        for seq_id in list(self.seqs):
            self.kv.free(seq_id)
        assert self.kv.block_tables == {}
        assert self.kv.num_free_blocks == self.kv.num_blocks
        assert self.kv.pool.ref_counts == [0] * self.kv.num_blocks
        assert sorted(free_list(self.kv.pool)) == list(range(self.kv.num_blocks))


KVMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestKVMachine = KVMachine.TestCase


# ---------------------------------------------------------------- the checker can fail


def test_checker_catches_a_leak() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2)
    kv.allocate(0, 0, 3)
    kv.block_tables[0].pop()
    with pytest.raises(RuntimeError):
        kv.check_invariants()


def test_checker_catches_a_missed_incref() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2)
    kv.allocate(0, 0, 3)
    kv.block_tables[1] = list(kv.block_tables[0])
    with pytest.raises(RuntimeError):
        kv.check_invariants()


def test_checker_catches_an_owned_block_on_the_free_list() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2)
    kv.allocate(0, 0, 3)
    kv.pool._free[kv.block_tables[0][0]] = None
    with pytest.raises(RuntimeError):
        kv.check_invariants()


def test_checker_catches_a_block_held_twice() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=2, groups=[LayerGroup(None, (0,)), LayerGroup(2, (1,))])
    kv.allocate(0, 0, 4)
    kv.check_invariants()
    sliding = kv.group_tables(0)[1]
    kv.pool.decref(sliding[1])
    kv.pool.incref(sliding[0])
    sliding[1] = sliding[0]
    with pytest.raises(RuntimeError, match="twice"):
        kv.check_invariants()


def test_checker_catches_a_wrong_count_of_a_groups_blocks() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=2, groups=[LayerGroup(None, (0,)), LayerGroup(2, (1,))])
    kv.allocate(0, 0, 4)
    kv.groups[1].pool.held[1] += 1
    with pytest.raises(RuntimeError, match="layer group 1"):
        kv.check_invariants()


def test_checker_catches_a_stale_prefix_index() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2)
    kv.allocate(0, 0, 2)
    key = block_key(None, (1, 2), None)
    kv.cache_blocks(0, 0, [key])
    kv.check_invariants()
    kv.pool.keys[kv.block_tables[0][0]] = None
    with pytest.raises(RuntimeError, match="prefix index"):
        kv.check_invariants()
