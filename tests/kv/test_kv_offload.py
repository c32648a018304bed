"""The second KV tier (kv_offload): blocks the pool's prefix cache evicts are served again from disk, in
this engine and after a restart, and nothing it holds ever changes an output."""
from __future__ import annotations

import dataclasses
import gc
import json
import os
import stat
import threading
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from kvserve import LLM, SamplingParams
from kvserve.cli import build_parser, engine_kwargs
from kvserve.engine import kv_state
from kvserve.kv import KVCacheManager, KVSpec, KVStorage
from kvserve.kv.blocks import BlockKey, block_key
from kvserve.kv.tiers import (SUFFIX, DiskTier, HostTier, OffloadingConnector, SwapCosts, measure_prefill,
                              swap_is_cheaper)
from kvserve.kv.tiers import disk as disk_module
from kvserve.kv.tiers import offloading as offloading_module
from kvserve.server.metrics import EngineCollector
from servers import wait_for
from timings import measured

BS = 4
GREEDY = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def ckpt(checkpoint):
    return checkpoint("llama", max_position_embeddings=256)


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


A, B, C = ids(21, 1), ids(21, 2), ids(21, 3)     # 5 full blocks each (20 tokens a hit may cover)


def prompts(*token_lists) -> list[dict]:
    return [{"prompt_token_ids": t} for t in token_lists]


def tiered(ckpt, tier: Path, size="1MiB", **kw) -> LLM:
    # a preemption recomputes unless a test asks for swap: the measured choice differs from one machine to another
    kw = {"block_size": BS, "num_kv_blocks": 8, "preemption_mode": "recompute", **kw}
    return LLM(str(ckpt), kv_offload=f"disk:{tier}", kv_offload_size=size, **kw)


def reference(ckpt, token_lists, params=GREEDY, **kw):
    llm = LLM(str(ckpt), block_size=BS, num_kv_blocks=64, enable_prefix_caching=False, **kw)
    return llm.generate(prompts(*token_lists), params, use_tqdm=False)


def assert_same(outs, refs, tol=1e-5) -> None:
    """Greedy tokens equal, and every logprob within tol."""
    for out, ref in zip(outs, refs, strict=True):
        for o, r in zip(out.outputs, ref.outputs, strict=True):
            assert o.token_ids == r.token_ids
            for a, b in zip(o.logprobs, r.logprobs, strict=True):
                assert a.keys() == b.keys()
                assert all(abs(a[t].logprob - b[t].logprob) <= tol for t in a)


def computed_tokens(llm: LLM) -> list[int]:
    """Tokens each step of the engine computes, from now on."""
    steps, run = [], llm.engine.runner.run

    def counted(sched):
        steps.append(sum(sched.num_new_tokens))
        return run(sched)

    llm.engine.runner.run = counted
    return steps


def check_pool(llm: LLM) -> None:
    """No block leaked: every block with an owner is in a table, and once idle all are free."""
    kv = llm.engine.kv
    kv.check_invariants()
    assert kv.num_free_blocks == kv.num_blocks


def files(tier: Path) -> list[Path]:
    return sorted(tier.glob(f"*/*{SUFFIX}"))


def test_a_prefix_evicted_from_the_pool_is_served_from_the_tier(ckpt, tmp_path):
    llm = tiered(ckpt, tmp_path / "tier")
    llm.generate(prompts(A, B, C), GREEDY, use_tqdm=False)     # one at a time in the pool: A's blocks leave it
    llm.engine.connector.tier.flush()                             # the writer stores them in the background
    stats = llm.stats()
    assert stats["kv_offload_blocks_stored"] > 0
    steps = computed_tokens(llm)
    again = llm.generate(prompts(A), GREEDY, use_tqdm=False)[0]
    stats = llm.stats()
    assert again.num_cached_tokens == 20
    assert stats["kv_offload_hit_tokens"] == 20 and stats["kv_offload_loads"] == 5
    assert stats["prefix_cache_hits"] == 0          # none of it came from the pool ...
    assert steps[0] == 1                            # ... and only the last prompt token was computed
    assert_same([again], reference(ckpt, [A]))
    check_pool(llm)


def test_a_restarted_engine_finds_what_the_last_one_kept(ckpt, tmp_path):
    first = tiered(ckpt, tmp_path / "tier", num_kv_blocks=32)
    first.generate(prompts(A, B), GREEDY, use_tqdm=False)
    assert first.stats()["kv_offload_blocks_stored"] == 0       # all still in the pool ...
    first.engine.close()                                          # ... and written to the tier on close
    assert len(files(tmp_path / "tier")) == 12        # 6 full blocks of each 25 computed tokens
    second = tiered(ckpt, tmp_path / "tier", num_kv_blocks=32)
    assert second.stats()["kv_offload_blocks"] == 12
    steps = computed_tokens(second)
    outs = second.generate(prompts(B, A), GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [20, 20]
    assert sum(steps) == 2 * 5          # each computes its last prompt token, then decodes 4 more
    assert second.stats()["kv_offload_hit_tokens"] == 40
    assert_same(outs, reference(ckpt, [B, A]))


def test_a_block_evicted_while_it_is_read_is_not_counted_again(ckpt, tmp_path, monkeypatch):
    """The writer may evict a block (its file removed) between a read of that file and the read's
    bookkeeping: the tier's bytes must stay those of the files it has."""
    written(tiered, ckpt, tmp_path / "tier", [A], num_kv_blocks=32)
    second = tiered(ckpt, tmp_path / "tier", num_kv_blocks=32)
    tier = second.engine.connector.tier
    check = type(tier)._check_header

    def evicted_meanwhile(self, *args):
        with self._lock:            # as the writer does, making room for a block
            self._make_room(self.capacity)
        return check(self, *args)

    monkeypatch.setattr(type(tier), "_check_header", evicted_meanwhile)
    second.generate(prompts(A), GREEDY, use_tqdm=False)
    on_disk = sum(p.stat().st_size for p in files(tmp_path / "tier"))
    assert tier.used_bytes == on_disk and tier.num_blocks == len(files(tmp_path / "tier"))


def test_an_engine_collected_without_close_keeps_its_blocks(ckpt, tmp_path):
    llm = tiered(ckpt, tmp_path / "tier", num_kv_blocks=32)
    llm.generate(prompts(A), GREEDY, use_tqdm=False)
    del llm
    gc.collect()
    again = tiered(ckpt, tmp_path / "tier").generate(prompts(A), GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == 20


class HeldReads:
    """The tier's reads of an engine, held until `release` is set; each sets `started` first. A read on
    the engine's own thread fails at once instead (it would hold every sequence, and this test)."""

    def __init__(self, offload: OffloadingConnector):
        self.started, self.release = threading.Event(), threading.Event()
        read = offload.read

        def held(keys):
            if threading.current_thread() is threading.main_thread():
                raise AssertionError("the tier was read on the engine's thread: every sequence waits for it")
            self.started.set()
            self.release.wait()
            return read(keys)

        offload.read = held


def written(make, ckpt, tier, texts: list, **kw) -> LLM:
    """An engine made by `make` over `tier` once it served `texts` and closed: the tier holds their blocks."""
    first = make(ckpt, tier, **kw)
    first.generate(prompts(*texts), GREEDY, use_tqdm=False)
    first.engine.close()
    return first


def reopened(make, ckpt, tier, texts: list, **kw) -> LLM:
    """A fresh engine made by `make` over `tier` once another served `texts` there: the tier holds their
    blocks, its pool none."""
    written(make, ckpt, tier, texts, **kw)
    return make(ckpt, tier, **kw)


def tier_holding_a(ckpt, tmp_path) -> LLM:
    """An engine whose tier holds A's blocks and whose pool holds none."""
    return reopened(tiered, ckpt, tmp_path / "tier", [A], num_kv_blocks=32)


def decoding_x(llm: LLM):
    """`llm`'s engine with its tier reads held (HeldReads) and X's prompt computed (X reads nothing from
    the tier): the engine, the held reads, and X's request."""
    engine, held = llm.engine, HeldReads(llm.engine.connector)
    x = engine.add_request("x", {"prompt_token_ids": X}, DECODES)
    engine.step()
    return engine, held, x


def step_to_end(engine) -> dict:
    """Each request's last output, stepping the engine until nothing is left."""
    outs = {}
    while engine.has_unfinished_requests():
        outs.update((o.request_id, o) for o in engine.step())
    return outs


X = ids(6, 9)
DECODES = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)


def test_a_load_from_the_tier_overlaps_the_other_sequences_steps(ckpt, tmp_path):
    """A request whose prefix is in the tier waits for its reads while another sequence decodes, and
    joins a later step over the blocks read: the same tokens as without the tier, counted as tier hits."""
    llm = tier_holding_a(ckpt, tmp_path)
    engine, held, _ = decoding_x(llm)
    try:
        engine.add_request("a", {"prompt_token_ids": A}, GREEDY)
        gained = [[o.request_id for o in engine.step()] for _ in range(4)]
        assert held.started.is_set() and gained == [["x"]] * 4       # a waits for its blocks, x goes on
        stats = engine.stats()
        assert stats["kv_offload_loads_in_flight"] == 5 and stats["num_waiting"] == 1
        assert stats["kv_offload_hit_tokens"] == 0                    # nothing is counted before it is read
        assert [s.request_id for s in kv_state.snapshot(engine).sequences] == ["x", "a"]    # a holds blocks
    finally:
        held.release.set()
    outs = step_to_end(engine)
    assert outs["a"].num_cached_tokens == 20
    stats = llm.stats()
    assert stats["kv_offload_hit_tokens"] == 20 and stats["kv_offload_loads"] == 5
    assert stats["kv_offload_loads_in_flight"] == 0
    assert_same([outs["a"]], reference(ckpt, [A]))
    assert_same([outs["x"]], reference(ckpt, [X], DECODES))
    check_pool(llm)


def test_a_step_with_nothing_else_to_run_waits_for_the_load(ckpt, tmp_path):
    """Alone, a request with blocks in the tier is not stepped over empty: the step waits for its reads and
    computes its first token."""
    llm = tier_holding_a(ckpt, tmp_path)
    engine, held = llm.engine, HeldReads(llm.engine.connector)
    releaser = threading.Thread(target=lambda: held.started.wait() and held.release.set(), daemon=True)
    releaser.start()
    try:
        engine.add_request("a", {"prompt_token_ids": A}, GREEDY)
        first = engine.step()
    finally:
        held.release.set()
    assert [o.request_id for o in first] == ["a"] and len(first[0].outputs[0].token_ids) == 1
    assert first[0].num_cached_tokens == 20


def test_a_request_aborted_while_it_loads_leaks_nothing(ckpt, tmp_path):
    """The fresh blocks of a request aborted while its reads are under way return to the pool at once; what
    is read after is dropped; the prefix is served again from the tier after."""
    llm = tier_holding_a(ckpt, tmp_path)
    engine, held, x = decoding_x(llm)
    try:
        engine.add_request("a", {"prompt_token_ids": A}, GREEDY)
        engine.step()
        kv = engine.kv
        assert held.started.is_set() and kv.num_free_blocks == kv.num_blocks - len(kv.block_tables[x.seq_id]) - 5
        engine.abort_request("a")
        assert not engine.scheduler.loading and "a" not in engine.requests
        assert kv.num_free_blocks == kv.num_blocks - len(kv.block_tables[x.seq_id])
        assert engine.stats()["kv_offload_loads_in_flight"] == 0
    finally:
        held.release.set()
    outs = step_to_end(engine)
    assert list(outs) == ["x"]
    check_pool(llm)
    assert llm.stats()["kv_offload_loads"] == 0
    again = llm.generate(prompts(A), GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == 20
    assert_same([again], reference(ckpt, [A]))
    check_pool(llm)


def test_closing_the_engine_with_loads_in_flight(ckpt, tmp_path):
    """close() lets the read under way finish and cancels the queued ones: the request of the first is
    served its blocks, the other computes its prefix; both as without the tier, nothing leaked."""
    llm = reopened(tiered, ckpt, tmp_path / "tier", [A, B], num_kv_blocks=32)
    engine, held, _ = decoding_x(llm)
    try:
        engine.add_request("a", {"prompt_token_ids": A}, GREEDY)
        engine.add_request("b", {"prompt_token_ids": B}, GREEDY)
        engine.step()
        assert held.started.is_set() and len(engine.scheduler.loading) == 2
        closing = threading.Thread(target=engine.close)
        closing.start()
    finally:
        held.release.set()
    closing.join()
    outs = step_to_end(engine)
    assert outs["a"].num_cached_tokens == 20 and outs["b"].num_cached_tokens == 0
    assert llm.stats()["kv_offload_hit_tokens"] == 20
    assert_same([outs["a"], outs["b"]], reference(ckpt, [A, B]))
    check_pool(llm)


def test_a_block_gone_while_its_read_waits_is_computed(ckpt, tmp_path):
    """A file removed while its read waits (another engine's eviction, say) ends the blocks read there; the
    request computes the rest, as without the tier."""
    llm = tier_holding_a(ckpt, tmp_path)
    engine, held, _ = decoding_x(llm)
    try:
        engine.add_request("a", {"prompt_token_ids": A}, GREEDY)
        engine.step()
        assert held.started.is_set()
        engine.connector.tier._path(_keys(A)[3].hash).unlink()
    finally:
        held.release.set()
    outs = step_to_end(engine)
    assert outs["a"].num_cached_tokens == 12 and llm.stats()["kv_offload_loads"] == 3
    assert llm.stats()["kv_offload_miss_tokens"] == BS + 2 * BS       # x's full block, and a's last two
    assert_same([outs["a"]], reference(ckpt, [A]))
    check_pool(llm)


SYSTEM = ids(12, 7)
SHARED = [SYSTEM + ids(k, k) for k in (5, 9, 3, 6)] + [ids(18, 8)]
SAMPLES = [SamplingParams(n=2, max_tokens=6, temperature=0.8, seed=s, ignore_eos=True, logprobs=2)
           for s in range(len(SHARED))]
ORDERS = (SHARED, SHARED[::-1], SHARED[1::2] + SHARED[::2])


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "int4"])
def test_outputs_equal_with_and_without_the_tier(ckpt, tmp_path, kv_cache_dtype):
    """Parallel samples (forks) over prefixes that leave a small pool and come back from the tier, one
    request at a time: each computes what it does not find in the same steps with the tier or without."""
    kw = {"kv_cache_dtype": kv_cache_dtype}
    llm = tiered(ckpt, tmp_path / "tier", num_kv_blocks=20, **kw)
    ref = LLM(str(ckpt), block_size=BS, num_kv_blocks=64, enable_prefix_caching=False, **kw)
    for order in ORDERS:
        for tokens in order:
            params = SAMPLES[SHARED.index(tokens)]
            assert_same(llm.generate(prompts(tokens), params, use_tqdm=False),
                        ref.generate(prompts(tokens), params, use_tqdm=False))
            check_pool(llm)
    assert llm.stats()["kv_offload_hit_tokens"] > 0


def test_a_batch_with_preemptions_equals_one_without_the_tier(ckpt, tmp_path):
    """All at once in a pool too small for them: preempted sequences come back over blocks from the tier."""
    llm = tiered(ckpt, tmp_path / "tier", num_kv_blocks=20)
    ref = LLM(str(ckpt), block_size=BS, num_kv_blocks=64, enable_prefix_caching=False)
    for order in ORDERS:
        params = [SAMPLES[SHARED.index(t)] for t in order]
        assert_same(llm.generate(prompts(*order), params, use_tqdm=False),
                    ref.generate(prompts(*order), params, use_tqdm=False))
        check_pool(llm)
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["kv_offload_hit_tokens"] > 0


LONG = [ids(13, s) for s in range(4)]
FORKS = SamplingParams(n=2, max_tokens=20, temperature=0, ignore_eos=True, logprobs=2)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "int4"])
def test_preemption_by_swap_changes_no_output(ckpt, tmp_path, kv_cache_dtype):
    """Forks that grow past a small pool: preempted ones go to the tier and resume over the blocks read
    back from it (the pool has given theirs to others). The outputs are those of a pool that never
    preempts, and (full precision, where recomputing changes nothing) of the same engine without a tier,
    which recomputes them."""
    kw = {"block_size": BS, "num_kv_blocks": 24, "kv_cache_dtype": kv_cache_dtype}
    llm = tiered(ckpt, tmp_path / "tier", preemption_mode="swap", **kw)
    outs = llm.generate(prompts(*LONG), FORKS, use_tqdm=False)
    if kv_cache_dtype == "auto":
        assert_same(outs, LLM(str(ckpt), **kw).generate(prompts(*LONG), FORKS, use_tqdm=False))
    # each token is quantized as it is written, and swapped blocks come back byte for byte: the outputs of a
    # pool that never preempts
    never = LLM(str(ckpt), **{**kw, "num_kv_blocks": 128})
    assert_same(outs, never.generate(prompts(*LONG), FORKS, use_tqdm=False))
    assert never.stats()["num_preemptions"] == 0
    check_pool(llm)
    stats = llm.stats()
    assert stats["kv_offload_swap_outs"] == stats["kv_offload_swap_ins"] == stats["num_preemptions"] > 0
    assert stats["kv_offload_swap_in_blocks"] > 0 and stats["kv_offload_recomputes"] == 0


def test_swap_reads_back_what_recompute_computes_again(ckpt, tmp_path, monkeypatch):
    """With a writer that takes one block at a time, most blocks the pool evicts are skipped: a sequence
    left to recompute finds few of its blocks again. One swapped out has its blocks written whole (the
    swap waits for the writer) and computes again only the tokens of its last block, if part full (the
    tier keeps full blocks): at most BS - 1 tokens a preemption more than a pool that never preempts,
    for the same outputs."""
    monkeypatch.setattr(disk_module, "WRITE_QUEUE_BYTES", 1)
    computed, outs, stats = {}, {}, {}
    for name, mode, blocks in (("swap", "swap", 24), ("recompute", "recompute", 24), ("never", "recompute", 64)):
        llm = tiered(ckpt, tmp_path / name, num_kv_blocks=blocks, preemption_mode=mode)
        steps = computed_tokens(llm)
        outs[name] = llm.generate(prompts(*LONG), FORKS, use_tqdm=False)
        computed[name], stats[name] = sum(steps), llm.stats()
    assert stats["never"]["num_preemptions"] == 0
    assert computed["never"] <= computed["swap"] <= computed["never"] + (BS - 1) * stats["swap"]["num_preemptions"]
    assert computed["swap"] < computed["recompute"]
    assert_same(outs["swap"], outs["never"])
    assert_same(outs["recompute"], outs["never"])
    assert stats["swap"]["kv_offload_swap_outs"] > 0 and stats["swap"]["kv_offload_recomputes"] == 0
    assert stats["recompute"]["kv_offload_recomputes"] > 0 and stats["recompute"]["kv_offload_swap_outs"] == 0


def test_swap_or_recompute_by_the_measured_costs():
    """Swapping moves bytes, linear in the blocks; recomputing grows with the square of the tokens: short
    sequences recompute, long ones swap, and a block the tier holds already costs only its read."""
    costs = SwapCosts(prefill_s_per_token=1.0, prefill_s_per_token2=0.01, write_s_per_block=6.0,
                      read_s_per_block=2.0)
    assert not swap_is_cheaper(costs, 2, 0, BS)       # 8 + 0.64 s to recompute, 12 + 4 s to swap
    assert swap_is_cheaper(costs, 100, 0, BS)         # 400 + 1600 s to recompute, 600 + 200 s to swap
    assert swap_is_cheaper(costs, 2, 2, BS)           # both stored already: 4 s to read back
    linear = SwapCosts(1.0, 0.0, 6.0, 2.0)
    assert not swap_is_cheaper(linear, 100, 0, BS)    # 400 s to recompute


def test_an_engine_measures_the_costs_at_start_up_and_counts_each_preemption(ckpt, tmp_path):
    llm = LLM(str(ckpt), block_size=BS, num_kv_blocks=24, kv_offload=f"disk:{tmp_path / 'tier'}")
    costs = llm.engine.connector.swap_costs
    assert isinstance(costs, SwapCosts) and all(measured(c) for c in dataclasses.astuple(costs))
    llm.generate(prompts(*LONG), FORKS, use_tqdm=False)
    stats = llm.stats()
    assert stats["kv_offload_swap_outs"] + stats["kv_offload_recomputes"] == stats["num_preemptions"] > 0


class _Clock:
    """time.perf_counter of a machine on which a prefill takes the seconds it is given, and nothing else any."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def test_the_prefill_cost_is_fitted_to_the_fastest_runs(monkeypatch):
    """A prefill of T tokens that takes a T + b T^2 seconds gives back a and b, whatever a run another job slowed
    adds; where the longer prefill is not even twice the shorter (noise on a prefill too short for attention
    to show), the quadratic term is 0 and the cost a token the shorter's."""
    clock = _Clock()
    monkeypatch.setattr(offloading_module, "time", clock)
    calls = []

    def prefill(tokens: int) -> None:
        calls.append(tokens)
        slowed = 1.0 if len(calls) in (1, 4) else 0.0        # one run of each length shares its cores
        clock.now += 2e-3 * tokens + 1e-5 * tokens ** 2 + slowed

    a, b = measure_prefill(prefill, 64, repeats=2)
    assert calls == [64, 64, 128, 128]
    assert a == pytest.approx(2e-3) and b == pytest.approx(1e-5)
    a, b = measure_prefill(lambda tokens: setattr(clock, "now", clock.now + (0.5 if tokens == 64 else 0.9)), 64)
    assert b == 0.0 and a == pytest.approx(0.5 / 64)


def test_no_swap_past_the_tier_or_once_it_is_closed(ckpt, tmp_path):
    llm = tiered(ckpt, tmp_path / "tier", size="1MiB", preemption_mode="swap")
    offload, tier = llm.engine.connector, llm.engine.connector.tier
    keys = [block_key(None, (i,) * BS, None) for i in range(3)]
    assert offload.should_swap(keys) and not offload.should_swap([])
    assert not offload.should_swap(keys * (2**20 // (3 * tier.file_bytes(keys[0])) + 1))   # more than 1 MiB
    llm.engine.close()
    assert not offload.should_swap(keys)


def test_a_corrupt_file_is_removed_and_never_served(ckpt, tmp_path):
    written(tiered, ckpt, tmp_path / "tier", [A, B], num_kv_blocks=32)
    hashes_a = [k.hash for k in _keys(A)]
    hashes_b = [k.hash for k in _keys(B)]
    tier_dir = files(tmp_path / "tier")[0].parent
    third_of_a = tier_dir / (hashes_a[3].hex() + SUFFIX)
    raw = bytearray(third_of_a.read_bytes())
    raw[-100] ^= 0xFF                                           # a flipped bit in the pages
    third_of_a.write_bytes(bytes(raw))
    first_of_b = tier_dir / (hashes_b[0].hex() + SUFFIX)
    first_of_b.write_bytes(first_of_b.read_bytes()[:-50])       # truncated
    (tier_dir / (b"\x01" * 16).hex()).with_suffix(SUFFIX).write_bytes(b"garbage")
    second = tiered(ckpt, tmp_path / "tier")
    assert not first_of_b.exists() and second.stats()["kv_offload_errors"] == 2     # found at start-up
    outs = second.generate(prompts(A), GREEDY, use_tqdm=False)
    assert outs[0].num_cached_tokens == 12                      # up to its corrupt block
    assert not third_of_a.exists() and second.stats()["kv_offload_errors"] == 3
    outs += second.generate(prompts(B), GREEDY, use_tqdm=False)
    assert outs[1].num_cached_tokens == 0
    assert_same(outs, reference(ckpt, [A, B]))


def test_every_corrupt_block_is_written_again_after_one_request(ckpt, tmp_path):
    """A read stops at its first bad file; the files after it are checked too, so that the pool's copies of all the
    bad blocks replace them when the pool evicts them: the next request finds them all, not one more."""
    written(tiered, ckpt, tmp_path / "tier", [A], num_kv_blocks=32)
    tier_dir = files(tmp_path / "tier")[0].parent
    bad = [tier_dir / (key.hash.hex() + SUFFIX) for key in _keys(A)[3:5]]
    for path in bad:
        raw = bytearray(path.read_bytes())
        raw[-100] ^= 0xFF
        path.write_bytes(bytes(raw))
    llm = tiered(ckpt, tmp_path / "tier")
    outs = llm.generate(prompts(A), GREEDY, use_tqdm=False)
    assert outs[0].num_cached_tokens == 12                      # up to the first bad block
    wait_for(lambda: not any(path.exists() for path in bad), "the bad block files are removed")
    llm.generate(prompts(B, C), GREEDY, use_tqdm=False)         # A's blocks leave the pool for the tier
    llm.engine.connector.tier.flush()
    outs += llm.generate(prompts(A), GREEDY, use_tqdm=False)
    assert outs[1].num_cached_tokens == 20 and all(path.exists() for path in bad)
    assert_same(outs, reference(ckpt, [A, A]))


def test_the_tier_is_readable_by_its_owner_alone(ckpt, tmp_path):
    """Its files hold prompts' token ids: directories 0700, files 0600."""
    written(tiered, ckpt, tmp_path / "tier", [A], num_kv_blocks=32)
    tier_dir = files(tmp_path / "tier")[0].parent
    assert [stat.S_IMODE(d.stat().st_mode) for d in (tmp_path / "tier", tier_dir)] == [0o700, 0o700]
    assert {stat.S_IMODE(f.stat().st_mode) for f in tier_dir.iterdir()} == {0o600}
    assert len(list(tier_dir.iterdir())) > 5                    # the blocks, and compat.json


def _keys(tokens: list[int], salt=None) -> list[BlockKey]:
    keys, parent = [], None
    for i in range(len(tokens) // BS):
        keys.append(block_key(parent, tuple(tokens[i * BS:(i + 1) * BS]), salt))
        parent = keys[-1].hash
    return keys


def test_blocks_of_another_block_size_or_model_are_never_served(ckpt, checkpoint, tmp_path):
    written(tiered, ckpt, tmp_path / "tier", [A], num_kv_blocks=32)
    other_bs = tiered(ckpt, tmp_path / "tier", block_size=2, num_kv_blocks=32)
    out = other_bs.generate(prompts(A), GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0 and other_bs.stats()["kv_offload_blocks"] == 0
    assert_same([out], reference(ckpt, [A]))
    # the same shape, other weights: another model
    other = checkpoint("llama", seed=1, max_position_embeddings=256)
    other_model = tiered(other, tmp_path / "tier")
    out = other_model.generate(prompts(A), GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    assert_same([out], reference(other, [A]))
    # a file moved into another model's directory is not served there: its header says whose it is
    mine, theirs = (files(tmp_path / "tier")[0].parent,
                    other_model.engine.connector.tier.dir)
    for path in mine.glob(f"*{SUFFIX}"):
        os.link(path, theirs / path.name)
    moved = tiered(other, tmp_path / "tier")
    assert moved.stats()["kv_offload_blocks"] == 0 and moved.stats()["kv_offload_errors"] == 6
    assert moved.generate(prompts(A), GREEDY, use_tqdm=False)[0].num_cached_tokens == 0


def test_a_full_tier_evicts_its_least_recently_used_blocks(ckpt, tmp_path):
    probe = tiered(ckpt, tmp_path / "probe", num_kv_blocks=32)
    probe.generate(prompts(A), GREEDY, use_tqdm=False)
    probe.engine.close()
    one = max(p.stat().st_size for p in files(tmp_path / "probe"))
    capacity = 6 * one
    llm = tiered(ckpt, tmp_path / "tier", size=capacity)
    for token_list in (A, B, C, A, B):
        llm.generate(prompts(token_list), GREEDY, use_tqdm=False)
        llm.engine.connector.tier.flush()
        on_disk = sum(p.stat().st_size for p in files(tmp_path / "tier"))
        assert on_disk == llm.stats()["kv_offload_bytes"] <= capacity
    stats = llm.stats()
    assert stats["kv_offload_evictions"] > 0 and stats["kv_offload_blocks"] <= 6
    assert_same(llm.generate(prompts(C, A), GREEDY, use_tqdm=False), reference(ckpt, [C, A]))


def test_a_tier_too_small_for_one_block_is_refused(ckpt, tmp_path):
    with pytest.raises(ValueError, match="kv_offload_size"):
        tiered(ckpt, tmp_path / "tier", size=100)


def test_an_unwritable_directory_is_refused_at_start_up(ckpt, tmp_path, monkeypatch):
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(ValueError, match="not writable"):
        tiered(ckpt, tmp_path / "file")
    # a read-only directory (permissions do not hold for root: the refusal the OS would give, given)
    read_only = tmp_path / "ro"
    read_only.mkdir()

    def refuse(self, path, parts):
        raise PermissionError(13, "Read-only file system", str(path))

    monkeypatch.setattr(DiskTier, "_write_atomic", refuse)
    with pytest.raises(ValueError, match=f"kv_offload directory {read_only} is not writable"):
        tiered(ckpt, read_only)


def test_failed_writes_are_counted_and_change_nothing(ckpt, tmp_path, monkeypatch):
    llm = tiered(ckpt, tmp_path / "tier")

    def refuse(self, path, parts):
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(DiskTier, "_write_atomic", refuse)
    outs = llm.generate(prompts(A, B, C, A), GREEDY, use_tqdm=False)
    llm.engine.connector.tier.flush()
    stats = llm.stats()
    assert stats["kv_offload_errors"] > 0 and stats["kv_offload_blocks"] == 0 and not files(tmp_path / "tier")
    assert_same(outs, reference(ckpt, [A, B, C, A]))


def test_a_full_write_queue_skips_blocks_and_never_blocks_a_step(ckpt, tmp_path, monkeypatch):
    release = threading.Event()
    store = DiskTier._store_file

    def stalled(self, key, data):
        release.wait(60)
        store(self, key, data)

    monkeypatch.setattr(DiskTier, "_store_file", stalled)
    monkeypatch.setattr(disk_module, "WRITE_QUEUE_BYTES", 1)      # a queue of one block
    llm = tiered(ckpt, tmp_path / "tier")
    outs = llm.generate(prompts(A, B, C), GREEDY, use_tqdm=False)
    stats = llm.stats()
    assert stats["kv_offload_skipped"] > 0
    release.set()
    llm.engine.connector.tier.flush()
    assert_same(outs, reference(ckpt, [A, B, C]))


def test_a_writer_that_fails_counts_its_blocks_and_goes_on(ckpt, tmp_path, monkeypatch):
    """A write that raises costs its blocks (counted as errors), never the writer: later blocks are stored and a
    flush returns."""
    store, failed = DiskTier._store_file, []

    def first_fails(self, key, data):
        if not failed:
            failed.append(key)
            raise RuntimeError("a write that fails")
        store(self, key, data)

    monkeypatch.setattr(DiskTier, "_store_file", first_fails)
    llm = tiered(ckpt, tmp_path / "tier")
    outs = llm.generate(prompts(A, B, C), GREEDY, use_tqdm=False)
    llm.engine.connector.tier.flush()
    stats = llm.stats()
    assert failed and stats["kv_offload_errors"] == 1 and stats["kv_offload_blocks_stored"] > 0
    assert_same(outs, reference(ckpt, [A, B, C]))


def test_two_engines_share_one_directory(ckpt, tmp_path):
    one, two = tiered(ckpt, tmp_path / "tier"), tiered(ckpt, tmp_path / "tier")
    one.generate(prompts(A, B, C), GREEDY, use_tqdm=False)       # A's blocks leave one's pool for the tier
    one.engine.connector.tier.flush()
    out = two.generate(prompts(A), GREEDY, use_tqdm=False)[0]     # two started before they were written
    assert out.num_cached_tokens == 20
    assert_same([out], reference(ckpt, [A]))


def test_colliding_hashes_are_never_served(ckpt, tmp_path, monkeypatch):
    from kvserve.engine import sequence

    monkeypatch.setattr(sequence, "block_key", lambda parent, toks, salt: BlockKey(b"same-hash-16byte", parent,
                                                                                   toks, salt))
    llm = tiered(ckpt, tmp_path / "tier")
    outs = llm.generate(prompts(A, B, C, A, B), GREEDY, use_tqdm=False)
    assert_same(outs, reference(ckpt, [A, B, C, A, B]))


def test_salted_prefixes_stay_apart_in_the_tier(ckpt, tmp_path):
    llm = tiered(ckpt, tmp_path / "tier", num_kv_blocks=32)
    llm.generate([{"prompt_token_ids": A, "cache_salt": "tenant-a"}], GREEDY, use_tqdm=False)
    llm.engine.close()
    again = tiered(ckpt, tmp_path / "tier")
    other = again.generate([{"prompt_token_ids": A, "cache_salt": "tenant-b"}], GREEDY, use_tqdm=False)[0]
    same = again.generate([{"prompt_token_ids": A, "cache_salt": "tenant-a"}], GREEDY, use_tqdm=False)[0]
    assert other.num_cached_tokens == 0 and same.num_cached_tokens == 20
    assert not any(b"tenant-a" in p.read_bytes() for p in files(tmp_path / "tier"))    # a digest, not the salt


def test_the_cpu_tier_is_refused_on_a_cpu_engine(ckpt):
    with pytest.raises(ValueError, match="disk:PATH"):
        LLM(str(ckpt), device="cpu", block_size=BS, num_kv_blocks=8, kv_offload="cpu")


@pytest.mark.parametrize("kwargs, field", [({"kv_offload": "ram"}, "kv_offload"),
                                           ({"kv_offload": "disk:"}, "kv_offload"),
                                           ({"kv_offload_size": "lots"}, "kv_offload_size"),
                                           ({"kv_offload": "disk:/tmp/x", "enable_prefix_caching": False},
                                            "enable_prefix_caching"),
                                           ({"kv_offload": "disk:/tmp/x", "preemption_mode": "swapp"},
                                            "preemption_mode"),
                                           ({"preemption_mode": "swap"}, "kv_offload")])
def test_bad_settings_name_their_field(ckpt, kwargs, field):
    with pytest.raises(ValueError, match=field):
        LLM(str(ckpt), **kwargs)


def test_the_host_memory_tier(ckpt, tmp_path):
    """The pinned tier of CUDA engines, on an ordinary tensor: put, get, least recently used out, and an
    engine's whole path through it."""
    spec = KVSpec(2, 2, 16, torch.float32, BS)
    tier = HostTier(3 * spec.bytes_per_block, spec.bytes_per_block)
    keys = _keys(A)
    rows = torch.randint(0, 255, (5, spec.bytes_per_block), dtype=torch.uint8)
    for key, row in zip(keys[:3], rows):
        tier.put(key, row)
    assert tier.get(keys[0]) is not None          # now the most recent
    tier.put(keys[3], rows[3])                    # evicts keys[1]
    assert tier.get(keys[1]) is None and tier.counters.evictions == 1
    assert torch.equal(tier.get(keys[3]), rows[3]) and torch.equal(tier.get(keys[0]), rows[0])
    assert tier.get(BlockKey(keys[0].hash, None, (9, 9, 9, 9), None)) is None     # a colliding hash
    assert tier.used_bytes == 3 * spec.bytes_per_block
    # an engine whose tier is in host memory
    llm = tiered(ckpt, tmp_path / "unused")
    engine = llm.engine
    engine.connector.tier.close()
    engine.connector.tier = HostTier(64 * engine.kv_spec.bytes_per_block, engine.kv_spec.bytes_per_block)
    llm.generate(prompts(A, B, C), GREEDY, use_tqdm=False)
    again = llm.generate(prompts(A), GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == 20 and llm.stats()["kv_offload_loads"] == 5
    assert_same([again], reference(ckpt, [A]))


def test_offloader_round_trips_quantized_pages():
    """Blocks saved at eviction and loaded back into other blocks hold the same bytes, scales included."""
    spec = KVSpec(2, 2, 16, torch.float32, BS, "int4")
    kv = KVCacheManager(6, BS)
    storage = KVStorage(spec, 6, torch.device("cpu"))
    for layer in storage.quantized:
        layer.pages.copy_(torch.randint(0, 255, layer.pages.shape, dtype=torch.uint8))
        for meta in layer.meta:
            meta.copy_(torch.rand(meta.shape))
    tier = HostTier(6 * spec.bytes_per_block, spec.bytes_per_block)
    offloader = OffloadingConnector(tier, kv.pool, storage.read_blocks, storage.write_blocks, torch.device("cpu"))
    kv.pool.on_evict = offloader.save
    keys = _keys(A)
    blocks = kv.pool.allocate(3)
    before = storage.read_blocks(blocks)
    for b, key in zip(blocks, keys):
        kv.pool.cache(b, key)
        kv.pool.decref(b)
    kv.pool.allocate(6)                           # every block: the three cached ones are evicted
    assert all(offloader.holds(key) for key in keys[:3])
    data = offloader.read(keys)
    offloader.load([5, 4, 3], data)
    assert torch.equal(storage.read_blocks([5, 4, 3]), before)


def test_timing_a_transfer_changes_no_page_and_keeps_nothing(ckpt, tmp_path):
    """The start-up measurement moves real pool blocks through each tier and back: the pages, the tier's
    index and its directory are as they were."""
    llm = tiered(ckpt, tmp_path / "tier")
    engine = llm.engine
    storage, blocks = engine.storage, list(range(engine.kv.num_blocks))
    storage.write_blocks(blocks, torch.randint(0, 255, (len(blocks), engine.kv_spec.bytes_per_block),
                                               dtype=torch.uint8))
    before = storage.read_blocks(blocks)
    disk = engine.connector.tier
    entries = sorted(p.name for p in disk.dir.iterdir())
    for tier in (disk, HostTier(4 * engine.kv_spec.bytes_per_block, engine.kv_spec.bytes_per_block)):
        engine.connector.tier = tier
        write, read = engine.connector.measure_transfer()
        assert write > 0 and read > 0 and tier.num_blocks == 0 and tier.used_bytes == 0
        assert torch.equal(storage.read_blocks(blocks), before)
    assert sorted(p.name for p in disk.dir.iterdir()) == entries


def test_stats_reach_the_metrics(ckpt, tmp_path):
    llm = tiered(ckpt, tmp_path / "tier")
    llm.generate(prompts(A, B, C, A), GREEDY, use_tqdm=False)
    llm.engine.connector.tier.flush()       # its writer stores blocks in the background: none moves now
    registry = CollectorRegistry()
    registry.register(EngineCollector(llm.stats, "tiny"))
    text = generate_latest(registry).decode()
    assert 'kvserve:kv_offload_hit_tokens_total{model_name="tiny"} 20.0' in text
    assert 'kvserve:kv_offload_loads_total{model_name="tiny"} 5.0' in text
    assert 'kvserve:kv_offload_loads_in_flight{model_name="tiny"} 0.0' in text
    assert 'kvserve:kv_offload_swap_outs_total{model_name="tiny"} 0.0' in text
    assert f'kvserve:kv_offload_recomputes_total{{model_name="tiny"}} {float(llm.stats()["num_preemptions"])}' in text
    assert f'kvserve:kv_offload_bytes{{model_name="tiny"}} {float(llm.stats()["kv_offload_bytes"])}' in text
    plain = CollectorRegistry()
    plain.register(EngineCollector(LLM(str(ckpt), block_size=BS, num_kv_blocks=8).stats, "tiny"))
    assert "kv_offload" not in generate_latest(plain).decode()


def test_engine_flags(tmp_path):
    args = build_parser().parse_args(["generate", "hi", "--kv-offload", f"disk:{tmp_path}",
                                      "--kv-offload-size", "2GiB"])
    kwargs = engine_kwargs(args)
    assert kwargs["kv_offload"] == f"disk:{tmp_path}" and kwargs["kv_offload_size"] == "2GiB"
    assert kwargs["preemption_mode"] is None
    args = build_parser().parse_args(["generate", "hi", "--kv-offload", f"disk:{tmp_path}",
                                      "--preemption-mode", "swap"])
    assert engine_kwargs(args)["preemption_mode"] == "swap"


def test_plan_counts_the_prefix_tokens_a_tier_keeps(capsys):
    from kvserve.cli import main
    from kvserve.planner import load_model_config, plan

    _, cfg = load_model_config("llama-3.1-8b")
    int8 = KVSpec.from_model(cfg, torch.bfloat16, 16, "int8")
    result = plan("llama-3.1-8b", 80 * 2**30, 4096, kv_dtype="int8", offload_size=64 * 2**30)
    assert result.offload_tokens == 64 * 2**30 // int8.bytes_per_block * 16       # quantized, with its scales
    assert plan("llama-3.1-8b", 80 * 2**30, 4096).offload_tokens is None
    assert main(["plan", "--model", "llama-3.1-8b", "--gpu", "h100", "--kv-dtype", "int8",
                 "--kv-offload-size", "64GiB"]) == 0
    assert f"offload tier of 64.00 GiB: keeps {result.offload_tokens:,} more prefix tokens" in capsys.readouterr().out
    assert main(["plan", "--model", "llama-3.1-8b", "--gpu", "h100", "--kv-offload-size", "lots"]) == 2
    assert "--kv-offload-size" in capsys.readouterr().err


# ---------------------------------------------------------------- a hybrid KV cache: the tier per layer group

WINDOW = 8


@pytest.fixture(scope="module")
def gemma3(checkpoint):
    """Three layers: two sliding (window 8), one global: three layer groups of one layer."""
    return checkpoint("gemma3", sliding_window=WINDOW, head_dim=16,
                      num_hidden_layers=3, sliding_window_pattern=3, max_position_embeddings=256)


def hybrid_tiered(gemma3, tier: Path, **kw) -> LLM:
    return tiered(gemma3, tier, dtype="float32", **kw)


def hybrid_reference(gemma3, token_lists):
    return reference(gemma3, token_lists, dtype="float32", disable_hybrid_kv_cache_manager=True)


def group_files(llm: LLM, tokens: list[int], group: int) -> list[Path]:
    """The tier's files of a prefix's blocks in one layer group."""
    tier = llm.engine.connector.tier
    return [tier._path(key.in_group(group).hash) for key in _keys(tokens)]


def check_hybrid_pool(llm: LLM) -> None:
    """Every block back but the null block."""
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"] - 1


def test_a_hybrid_cache_keeps_each_layer_group_in_the_tier(gemma3, tmp_path):
    """Evicted blocks go to the tier under their group's key; a prefix comes back with every block of the
    full-attention group and only the last window's of each sliding group: the same tokens as the one-table
    cache."""
    llm = hybrid_tiered(gemma3, tmp_path / "tier", num_kv_blocks=24)
    assert [g.sliding_window for g in llm.engine.kv.layer_groups] == [None, WINDOW, WINDOW]
    llm.generate(prompts(A, B, C), GREEDY, use_tqdm=False)       # A's blocks leave the pool for the tier
    llm.engine.connector.tier.flush()
    assert all(path.exists() for path in group_files(llm, A, 0))
    steps = computed_tokens(llm)
    again = llm.generate(prompts(A), GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == 20 and steps[0] == 1
    # the token after 20 attends to positions 13..20: blocks 3 and 4 of each sliding group
    assert llm.stats()["kv_offload_loads"] == 5 + 2 * 2 and llm.stats()["kv_offload_hit_tokens"] == 20
    assert_same([again], hybrid_reference(gemma3, [A]))
    check_hybrid_pool(llm)


def test_a_hybrid_prefix_needs_the_sliding_groups_window_only(gemma3, tmp_path):
    """After a restart: with a sliding group's blocks before the window gone, the whole prefix still hits; with
    a block of the full-attention group gone, the hit ends before it. The engine of the other layout (one
    table) shares none of these blocks."""
    first = written(hybrid_tiered, gemma3, tmp_path / "tier", [A, B], num_kv_blocks=64)
    for path in group_files(first, A, 1)[:3] + group_files(first, A, 2)[:3] + group_files(first, B, 0)[2:3]:
        path.unlink()
    second = hybrid_tiered(gemma3, tmp_path / "tier", num_kv_blocks=64)
    outs = second.generate(prompts(A, B), GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [20, 8]
    assert_same(outs, hybrid_reference(gemma3, [A, B]))
    check_hybrid_pool(second)
    one_table = hybrid_tiered(gemma3, tmp_path / "tier", num_kv_blocks=64, disable_hybrid_kv_cache_manager=True)
    assert one_table.generate(prompts(A), GREEDY, use_tqdm=False)[0].num_cached_tokens == 0


def test_a_hybrid_load_that_fails_in_a_window_computes_the_prefix(gemma3, tmp_path):
    """A sliding group's block in the window gone while the reads wait: no shorter prefix has its window in
    the pool (the blocks before were never loaded), so the request computes it all, as without the tier, and
    every fresh block returns."""
    llm = reopened(hybrid_tiered, gemma3, tmp_path / "tier", [A], num_kv_blocks=64)
    engine, held, _ = decoding_x(llm)
    try:
        engine.add_request("a", {"prompt_token_ids": A}, GREEDY)
        engine.step()
        assert held.started.is_set() and engine.stats()["kv_offload_loads_in_flight"] == 5 + 2 * 2
        group_files(llm, A, 2)[4].unlink()
    finally:
        held.release.set()
    outs = step_to_end(engine)
    assert outs["a"].num_cached_tokens == 0 and llm.stats()["kv_offload_hit_tokens"] == 0
    assert_same([outs["a"], outs["x"]], [*hybrid_reference(gemma3, [A]),
                                         *reference(gemma3, [X], DECODES, dtype="float32",
                                                    disable_hybrid_kv_cache_manager=True)])
    check_hybrid_pool(llm)


def test_a_hybrid_cache_swaps_each_group(gemma3, tmp_path):
    """Preemption by swap writes each group's blocks (a sliding group's window), and the resumption reads
    them back: the tokens of the one-table cache, every block back."""
    llm = hybrid_tiered(gemma3, tmp_path / "tier", num_kv_blocks=40, preemption_mode="swap")
    outs = llm.generate(prompts(*LONG), FORKS, use_tqdm=False)
    ref = LLM(str(gemma3), block_size=BS, num_kv_blocks=256, dtype="float32", disable_hybrid_kv_cache_manager=True)
    assert_same(outs, ref.generate(prompts(*LONG), FORKS, use_tqdm=False))
    stats = llm.stats()
    assert stats["kv_offload_swap_outs"] == stats["kv_offload_swap_ins"] == stats["num_preemptions"] > 0
    assert stats["kv_offload_swap_in_blocks"] > 0
    check_hybrid_pool(llm)


# ---- under tensor parallelism: each rank keeps a tier of its own pages ---------------------------------------------

TP_TOL = 1e-4       # two ranks sum a layer's partial products in another order than one rank


@contextmanager
def two_ranks(ckpt, tier: Path, **kw):
    """A tiered engine of two ranks, closed and its workers stopped after."""
    llm = tiered(ckpt, tier, tensor_parallel_size=2, dtype="float32", **kw)
    try:
        yield llm
    finally:
        llm.engine.close()
        llm.shutdown()


def rank_dirs(tier: Path) -> dict[tuple[int, int], Path]:
    """The tier's directory of each (tp_size, tp_rank), as its compat.json says."""
    abouts = {path.parent: json.loads(path.read_text()) for path in tier.glob("*/compat.json")}
    return {(about["tp_size"], about["tp_rank"]): path for path, about in abouts.items()}


def test_two_ranks_keep_their_pages_in_tiers_found_again_after_a_restart(ckpt, tmp_path):
    """Blocks the pool evicts are saved by both ranks before a step writes over them, and served again from both
    ranks' tiers; another engine of two ranks finds them after a restart. A block that one rank cannot read (its
    file corrupt) ends the prefix on both: the tokens from it on are computed again. One rank's tokens throughout."""
    tier = tmp_path / "tier"
    with two_ranks(ckpt, tier) as first:
        outs = first.generate(prompts(A, B, C), GREEDY, use_tqdm=False)     # one at a time in the pool
        outs += first.generate(prompts(A), GREEDY, use_tqdm=False)
        assert outs[-1].num_cached_tokens == 20 and first.stats()["kv_offload_hit_tokens"] == 20
    dirs = rank_dirs(tier)
    assert sorted(dirs) == [(2, 0), (2, 1)]
    names = [sorted(p.name for p in dirs[2, rank].glob(f"*{SUFFIX}")) for rank in (0, 1)]
    assert names[0] == names[1] and len(names[0]) == 18          # 6 full blocks of each 25 computed tokens
    corrupt = dirs[2, 1] / (_keys(A)[3].hash.hex() + SUFFIX)
    raw = bytearray(corrupt.read_bytes())
    raw[-100] ^= 0xFF
    corrupt.write_bytes(bytes(raw))
    with two_ranks(ckpt, tier) as second:
        again = second.generate(prompts(B, A), GREEDY, use_tqdm=False)
        stats = second.stats()
    assert [o.num_cached_tokens for o in again] == [20, 12]       # A's up to the block rank 1 cannot read
    assert stats["kv_offload_hit_tokens"] == 32 and stats["kv_offload_loads"] == 8
    assert corrupt.read_bytes() != raw          # removed, and written again (computed) as the engine closed
    ref = reference(ckpt, [A, B, C, A], dtype="float32")
    assert_same(outs, ref, TP_TOL)
    assert_same(again, [ref[1], ref[0]], TP_TOL)


def test_an_engine_never_reads_a_tier_of_another_rank_layout(checkpoint, tmp_path):
    """One KV head, on both ranks of two: each rank's pages are one rank's byte for byte, and only the tier's key
    (its rank layout) keeps the engines of one and of two ranks from each other's blocks."""
    one_kv_head = checkpoint("llama", num_key_value_heads=1, max_position_embeddings=256)
    tier = tmp_path / "tier"
    written(tiered, one_kv_head, tier, [A], num_kv_blocks=32)
    with two_ranks(one_kv_head, tier, num_kv_blocks=32) as two:
        outs = two.generate(prompts(A, B), GREEDY, use_tqdm=False)
        assert [o.num_cached_tokens for o in outs] == [0, 0] and two.stats()["kv_offload_blocks"] == 0
    one = tiered(one_kv_head, tier, num_kv_blocks=32)
    outs = one.generate(prompts(A, B), GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [20, 0]          # its own A; B only in the two ranks' tiers
    assert sorted(rank_dirs(tier)) == [(1, 0), (2, 0), (2, 1)]


def test_two_ranks_swap_preempted_sequences_out_and_back(ckpt, tmp_path):
    """Preemption by swap under tensor parallelism: every rank writes the sequence's blocks and reads them back,
    so that it computes again at most its last block's tokens; one rank's outputs of a pool that never preempts."""
    with two_ranks(ckpt, tmp_path / "tier", num_kv_blocks=24, preemption_mode="swap") as llm:
        steps = computed_tokens(llm)
        outs = llm.generate(prompts(*LONG), FORKS, use_tqdm=False)
        stats = llm.stats()
    never = LLM(str(ckpt), block_size=BS, num_kv_blocks=128, dtype="float32")
    never_steps = computed_tokens(never)
    assert_same(outs, never.generate(prompts(*LONG), FORKS, use_tqdm=False), TP_TOL)
    assert never.stats()["num_preemptions"] == 0
    assert stats["kv_offload_swap_outs"] == stats["kv_offload_swap_ins"] == stats["num_preemptions"] > 0
    assert sum(steps) <= sum(never_steps) + (BS - 1) * stats["num_preemptions"]
