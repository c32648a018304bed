"""Sharing blocks: prefix caching, parallel samples with copy-on-write, chunked prefill."""
from __future__ import annotations


import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve import LLM, SamplingParams
from kvserve.kv.blocks import BlockKey, BlockPool, block_key

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(checkpoint):
    return checkpoint("llama", max_position_embeddings=256)


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


SYSTEM = ids(21, 0)
PROMPTS = [{"prompt_token_ids": SYSTEM + ids(k, k)} for k in (1, 4, 7, 12)]


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def uncached(ckpt):
    llm = LLM(str(ckpt), block_size=4, num_kv_blocks=64, enable_prefix_caching=False)
    return tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))


@pytest.mark.parametrize("block_size", [1, 4, 5, 16])
def test_cached_outputs_equal_uncached(ckpt, block_size):
    ref = LLM(str(ckpt), block_size=block_size, num_kv_blocks=256, enable_prefix_caching=False)
    llm = LLM(str(ckpt), block_size=block_size, num_kv_blocks=256)
    expected = tokens(ref.generate(PROMPTS, GREEDY, use_tqdm=False))
    first = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    assert first[0].num_cached_tokens == 0
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert tokens(first) + tokens(outs)[1:] == expected[:1] + expected[1:]
    assert tokens(outs) == expected
    shared = 21 // block_size * block_size
    assert all(o.num_cached_tokens >= min(shared, (len(p["prompt_token_ids"]) - 1) // block_size * block_size)
               for o, p in zip(outs, PROMPTS))
    stats = llm.stats()
    assert stats["prefix_cache_hits"] > 0
    assert stats["prefix_cache_queries"] == len(PROMPTS[0]["prompt_token_ids"]) + sum(
        len(p["prompt_token_ids"]) for p in PROMPTS)
    llm.engine.kv.check_invariants()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_full_hit_recomputes_the_last_token(ckpt, uncached):
    llm = LLM(str(ckpt), block_size=4, num_kv_blocks=64)
    prompt = {"prompt_token_ids": ids(16, 3)}          # exactly 4 blocks
    first = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    again = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == 12 and again.outputs[0].token_ids == first.outputs[0].token_ids


def test_different_salts_never_share(ckpt):
    llm = LLM(str(ckpt), block_size=4, num_kv_blocks=64)
    prompt = SYSTEM + [5, 6]
    llm.generate({"prompt_token_ids": prompt, "cache_salt": "tenant-a"}, GREEDY, use_tqdm=False)
    other = llm.generate({"prompt_token_ids": prompt, "cache_salt": "tenant-b"}, GREEDY, use_tqdm=False)[0]
    unsalted = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0]
    same = llm.generate({"prompt_token_ids": prompt, "cache_salt": "tenant-a"}, GREEDY, use_tqdm=False)[0]
    assert other.num_cached_tokens == 0 and unsalted.num_cached_tokens == 0
    assert same.num_cached_tokens == 20


def test_recomputation_after_preemption_is_not_a_hit(ckpt, uncached):
    llm = LLM(str(ckpt), block_size=4, num_kv_blocks=12, enable_prefix_caching=True)
    prompts = [{"prompt_token_ids": ids(10, s)} for s in range(3)]   # unrelated prompts: no true hits
    llm.generate(prompts, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True), use_tqdm=False)
    stats = llm.stats()
    assert stats["num_preemptions"] > 0
    assert stats["prefix_cache_hits"] == 0 and stats["prefix_cache_queries"] == 30


def test_pool_evicts_least_recently_freed_tail_first():
    pool = BlockPool(4)
    keys, parent = [], None
    for i in range(3):
        keys.append(block_key(parent, (i, i), None))
        parent = keys[-1].hash
    blocks = pool.allocate(3)
    for b, k in zip(blocks, keys):
        pool.cache(b, k)
    for b in reversed(blocks):                       # as the manager frees: tail first
        pool.decref(b)
    assert pool.num_free == 4 and pool.num_cached == 3
    pool.allocate(2)                                 # the never-used block, then the tail block
    assert [pool.lookup(k) for k in keys] == blocks[:2] + [None]
    pool.incref(blocks[0])                           # a hit takes a cached block out of the free queue
    assert pool.num_free == 1 and pool.ref_counts[blocks[0]] == 1


def test_a_hash_collision_is_no_hit():
    pool = BlockPool(2)
    key = block_key(None, (1, 2), None)
    (b,) = pool.allocate(1)
    pool.cache(b, key)
    assert pool.lookup(key) == b
    assert pool.lookup(BlockKey(key.hash, None, (9, 9), None)) is None
    assert pool.lookup(BlockKey(key.hash, None, (1, 2), "salt")) is None


def test_colliding_hashes_cannot_corrupt_output(ckpt, uncached, monkeypatch):
    import kvserve.engine.sequence as sequence

    monkeypatch.setattr(sequence, "block_key",
                        lambda parent, toks, salt: BlockKey(b"same-hash", parent, toks, salt))
    llm = LLM(str(ckpt), block_size=4, num_kv_blocks=64)
    llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == uncached


def test_n_samples_equal_separate_seeded_runs_and_share_blocks(ckpt):
    llm = LLM(str(ckpt), block_size=4, num_kv_blocks=64)
    prompt = {"prompt_token_ids": ids(10, 9)}
    params = SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=11, ignore_eos=True)
    engine = llm.engine
    engine.add_request("r", prompt, params)
    outs = engine.step()                           # prefill, fork, first tokens
    assert [len(o.token_ids) for o in outs[0].outputs] == [1, 1, 1]
    table = engine.kv.block_tables
    group = engine.requests["r"]
    assert [table[s.seq_id][:2] for s in group] == [table[group[0].seq_id][:2]] * 3
    assert all(engine.kv.pool.ref_counts[b] == 3 for b in table[group[0].seq_id][:3])
    final = None
    while engine.has_unfinished_requests():
        llm.engine.kv.check_invariants()
        final = engine.step()[0]
    # the prompt's partial last block was copied on the first write of each sample but one
    alone = [llm.generate(prompt, SamplingParams(max_tokens=8, temperature=1.0, seed=11 + i, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids for i in range(3)]
    assert final.finished and [o.token_ids for o in final.outputs] == alone
    assert [o.index for o in final.outputs] == [0, 1, 2]
    assert llm.stats()["kv_blocks_free"] == 64


def test_n_counts_against_max_num_seqs(ckpt):
    with pytest.raises(ValueError, match="n \\(5\\) exceeds max_num_seqs \\(4\\)"):
        LLM(str(ckpt), num_kv_blocks=16, max_num_seqs=4).generate("x", SamplingParams(n=5), use_tqdm=False)


def test_a_long_prompt_does_not_stall_running_streams(ckpt):
    llm = LLM(str(ckpt), block_size=4, num_kv_blocks=128, max_num_batched_tokens=16)
    engine = llm.engine
    for i in range(2):
        engine.add_request(f"short{i}", {"prompt_token_ids": ids(5, i)}, SamplingParams(max_tokens=30))
    engine.step()
    engine.add_request("long", {"prompt_token_ids": ids(200, 7)}, SamplingParams(max_tokens=2))
    for _ in range(10):
        touched = {o.request_id for o in engine.step()}
        assert {"short0", "short1"} <= touched
    long_seq = engine.requests["long"][0]
    assert 0 < long_seq.num_computed_tokens < 200      # prefilled 14 tokens a step, alongside


def run_checked(engine, prompts: list[dict], params: list[SamplingParams], check) -> list[list[list[int]]]:
    """Each request's samples' tokens, in order, stepping the engine to the end and calling check() after
    every step."""
    results = {}
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), p, sp)
    while engine.has_unfinished_requests():
        for out in engine.step():
            results[out.request_id] = [o.token_ids for o in out.outputs]
        check()
    return [results[str(i)] for i in range(len(prompts))]


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(suffixes=st.lists(st.integers(0, 9), min_size=1, max_size=6), ns=st.lists(st.integers(1, 3), min_size=6,
       max_size=6), block_size=st.integers(2, 6), spare=st.integers(0, 8), budget=st.integers(4, 40),
       max_tokens=st.integers(1, 6))
def test_sharing_never_leaks_and_never_changes_tokens(ckpt, suffixes, ns, block_size, spare, budget, max_tokens):
    """Prefix hits, forks, copy-on-write, eviction of cached blocks and preemption, mixed at random."""
    prompts = [{"prompt_token_ids": SYSTEM[:9] + ids(k, k)} if k else {"prompt_token_ids": SYSTEM[:13]}
               for k in suffixes]
    params = [SamplingParams(n=n, max_tokens=max_tokens, temperature=1.0, seed=3, ignore_eos=True)
              for n in ns[:len(prompts)]]
    need = max(-(-(len(p["prompt_token_ids"]) + max_tokens) // block_size) for p in prompts)
    ref = LLM(str(ckpt), block_size=block_size, num_kv_blocks=256, enable_prefix_caching=False, max_num_seqs=3)
    expected = [[o.token_ids for o in out.outputs] for out in ref.generate(prompts, params, use_tqdm=False)]
    llm = LLM(str(ckpt), block_size=block_size, num_kv_blocks=need + 3 + spare, max_num_batched_tokens=budget)
    assert run_checked(llm.engine, prompts, params, llm.engine.kv.check_invariants) == expected
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


def test_requests_admitted_in_one_step_share_the_prefix_being_computed(ckpt, uncached):
    llm = LLM(str(ckpt), block_size=4, num_kv_blocks=64)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)      # all admitted in the first step
    assert outs[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens == 20 for o in outs[1:])   # the system prompt's 5 full blocks
    assert tokens(outs) == uncached


def test_a_failed_step_leaves_no_uncomputed_block_in_the_index(ckpt, uncached):
    llm = LLM(str(ckpt), block_size=4, num_kv_blocks=64)
    engine = llm.engine
    engine.add_request("doomed", PROMPTS[1], GREEDY)

    def fail(sched):
        raise RuntimeError("device lost")

    engine.runner.run = fail
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()
    del engine.runner.run
    engine.abort_request("doomed")
    out = llm.generate(PROMPTS[1], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0 and out.outputs[0].token_ids == uncached[1]


def test_prompt_logprobs_are_complete_on_a_prefix_hit(ckpt):
    llm = LLM(str(ckpt), block_size=4, num_kv_blocks=64)
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=0)
    first, again = (llm.generate(PROMPTS[2], params, use_tqdm=False)[0] for _ in range(2))
    ids = PROMPTS[2]["prompt_token_ids"]
    assert len(again.prompt_logprobs) == len(ids)
    assert [list(e)[0] for e in again.prompt_logprobs[1:]] == ids[1:]
    assert [e[t].logprob for e, t in zip(again.prompt_logprobs[1:], ids[1:])] == pytest.approx(
        [e[t].logprob for e, t in zip(first.prompt_logprobs[1:], ids[1:])], abs=1e-5)


def test_unforked_samples_count_against_max_num_seqs(ckpt):
    llm = LLM(str(ckpt), block_size=4, num_kv_blocks=64, max_num_seqs=4)
    engine = llm.engine
    engine.add_request("four", PROMPTS[0], SamplingParams(n=4, max_tokens=5))
    engine.add_request("one", PROMPTS[1], SamplingParams(max_tokens=5))
    while engine.has_unfinished_requests():
        engine.step()
        assert len(engine.scheduler.running) <= 4
