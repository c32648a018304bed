"""A property of the second KV tier: random workloads over a small pool and a small tier, with restarts and
preemptions (by swap or recompute), never leak a pool block, never serve a block under another key, never
let the tier pass its size, and (full-precision pages) never change an output; also while reads of the
tier are slow, so that sequences wait for their blocks across several steps of the others."""
from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve import LLM, SamplingParams
from kvserve.kv.tiers import SUFFIX, DiskTier, OffloadingConnector

BS = 4
PREFIXES = [torch.randint(3, 384, (16,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(3)]


@pytest.fixture(scope="module")
def ckpt(checkpoint):
    return checkpoint("llama", max_position_embeddings=128)


@pytest.fixture(scope="module")
def file_bytes(ckpt, tmp_path_factory):
    """The size of one block's file (headers differ by a few bytes with their tokens and salt)."""
    tier = tmp_path_factory.mktemp("probe")
    llm = LLM(str(ckpt), block_size=BS, num_kv_blocks=32, kv_offload=f"disk:{tier}")
    llm.generate([{"prompt_token_ids": PREFIXES[0]}], SamplingParams(max_tokens=1), use_tqdm=False)
    llm.engine.close()
    return max(p.stat().st_size for p in tier.glob(f"*/*{SUFFIX}"))


request = st.tuples(st.integers(0, len(PREFIXES) - 1), st.integers(0, 16), st.integers(0, 9),
                    st.sampled_from([None, "salt"]), st.integers(1, 2))
workloads = st.lists(st.lists(request, min_size=1, max_size=5), min_size=2, max_size=6)


def prompt(prefix: int, keep: int, suffix: int, salt: str | None) -> dict:
    tail = torch.randint(3, 384, (suffix,), generator=torch.Generator().manual_seed(1000 + suffix)).tolist()
    return {"prompt_token_ids": PREFIXES[prefix][:keep] + tail or [5], "cache_salt": salt}


def watch(llm: LLM, stored: dict, slow_reads: bool) -> None:
    """Record the bytes the tier takes under each key; check every block it serves against them. With
    `slow_reads`, each read first lets the engine step for a while."""
    offload: OffloadingConnector = llm.engine.connector
    tier: DiskTier = offload.tier
    put, read = tier.put, offload.read

    def recorded_put(key, data, wait=False):
        new = not tier.has(key.hash)
        ok = put(key, data, wait)
        if ok and new:
            stored[key] = data.clone()
        return ok

    def checked_read(keys):
        if slow_reads:
            time.sleep(0.01)
        out = read(keys)
        for key, data in zip(keys, out):
            assert torch.equal(data, stored[key]), "a block served under another key"
        return out

    tier.put, offload.read = recorded_put, checked_read


def check_pool(llm: LLM) -> None:
    kv = llm.engine.kv
    kv.check_invariants()
    assert kv.num_free_blocks == kv.num_blocks
    assert not llm.engine.scheduler.loading and llm.stats()["kv_offload_loads_in_flight"] == 0


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(workload=workloads, tier_blocks=st.integers(1, 10), pool=st.integers(18, 26),
       restart_at=st.integers(0, 5), kv_cache_dtype=st.sampled_from(["auto", "int8", "int4"]),
       preemption_mode=st.sampled_from(["swap", "recompute"]), slow_reads=st.booleans())
def test_random_workloads(ckpt, file_bytes, tmp_path_factory, workload, tier_blocks, pool, restart_at,
                          kv_cache_dtype, preemption_mode, slow_reads):
    tier = tmp_path_factory.mktemp("tier")
    capacity = tier_blocks * file_bytes
    kw = {"block_size": BS, "num_kv_blocks": pool, "kv_cache_dtype": kv_cache_dtype}
    stored: dict = {}

    def engine() -> LLM:
        llm = LLM(str(ckpt), kv_offload=f"disk:{tier}", kv_offload_size=capacity, preemption_mode=preemption_mode,
                  **kw)
        watch(llm, stored, slow_reads)
        return llm

    llm = engine()
    ref = LLM(str(ckpt), enable_prefix_caching=False, **kw) if kv_cache_dtype == "auto" else None
    for i, batch in enumerate(workload):
        if i == restart_at:
            llm.engine.close()
            llm = engine()
        prompts = [prompt(*r[:4]) for r in batch]
        params = [SamplingParams(n=r[4], max_tokens=6, temperature=0.0 if r[4] == 1 else 1.0, seed=j,
                                 ignore_eos=True) for j, r in enumerate(batch)]
        outs = llm.generate(prompts, params, use_tqdm=False)
        if ref is not None:
            expected = ref.generate(prompts, params, use_tqdm=False)
            assert [[c.token_ids for c in o.outputs] for o in outs] == \
                   [[c.token_ids for c in o.outputs] for o in expected]
        check_pool(llm)
        llm.engine.connector.tier.flush()
        on_disk = sum(p.stat().st_size for p in Path(tier).glob(f"*/*{SUFFIX}"))
        assert on_disk == llm.stats()["kv_offload_bytes"] <= capacity
    llm.engine.close()
