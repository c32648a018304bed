"""Sparse decode attention in the engine (kvserve.kv.sparse): dense exactly where the budget covers the context,
the same choice by every path that decodes (the C step, one and several steps a call, the eager native and Triton
backends), with quantized pages, hybrid models, tensor parallelism; page summaries exact across copy-on-write,
prefix hits, preemption and the second tier (a property test); and the option's errors."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve import LLM, SamplingParams
from kvserve.kv.blocks import cdiv
from kvserve.kv.summaries import round_down, round_up
from kvserve.server.errors import APIError
from kvserve.server.protocol import CompletionRequest

PROMPTS = [torch.randint(3, 384, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (150, 90, 41)]
QUEST = "quest:budget=32,recent=8,sinks=4,dense_layers=1"


@pytest.fixture(scope="module")
def llama(checkpoint):
    return checkpoint("llama", num_hidden_layers=3,
                      max_position_embeddings=256)


def generate(path, params: SamplingParams, prompts=PROMPTS, **kw):
    """Outputs and stats of an engine over `prompts`."""
    llm = LLM(str(path), block_size=kw.pop("block_size", 4), num_kv_blocks=240, dtype=kw.pop("dtype", "float32"), **kw)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return outs, llm.stats()


def tokens(outs) -> list[list[int]]:
    return [c.token_ids for o in outs for c in o.outputs]


def test_a_budget_past_the_context_is_dense_attention_exactly(llama):
    """A budget at least every context: the tokens and logprobs of dense attention, bit for bit, by the C step
    (one step and several a call) and the eager native backend; every block of every counted task read."""
    params = SamplingParams(max_tokens=10, temperature=0, logprobs=3)
    dense, _ = generate(llama, params)
    for kw in ({}, {"num_scheduler_steps": 1}, {"enforce_eager": True}):
        outs, stats = generate(llama, params, sparse_attention="quest:budget=4096,recent=8,sinks=4", **kw)
        assert tokens(outs) == tokens(dense), kw
        assert [c.logprobs for o in outs for c in o.outputs] == [c.logprobs for o in dense for c in o.outputs], kw
        assert stats["sparse_blocks_read"] == stats["sparse_blocks_total"] > 0
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    outs, stats = generate(llama, greedy, sparse_attention="quest:budget=4096,recent=8,sinks=4")
    assert tokens(outs) == tokens(generate(llama, greedy)[0]) and stats["steps"]["native_multi_step"] > 0


def test_a_budget_that_skips_too_little_to_pay_is_dense_attention_exactly(llama):
    """A budget below the longest context that would skip no more bytes of K and V than choosing reads of summaries
    (kv/sparse.py's selection_pays: float32 pages in blocks of 4 tokens, 512 bytes a block and KV head against a
    summary's 128; 2 to 5 of 34 to 37 middle blocks skipped): every task reads every block, and the tokens and
    logprobs are dense attention's, bit for bit, by the C step (one step a call, and several) and the eager native
    backend. A budget of a few blocks less chooses."""
    quest = "quest:budget=144,recent=8,sinks=4"
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=3, ignore_eos=True)
    assert len(PROMPTS[0]) + params.max_tokens > 144 > max(map(len, PROMPTS[1:])) + params.max_tokens
    dense, _ = generate(llama, params)
    for path, kw in [("native", {"num_scheduler_steps": 1}), ("eager", {"enforce_eager": True})]:
        outs, stats = generate(llama, params, sparse_attention=quest, **kw)
        assert tokens(outs) == tokens(dense), path
        assert [c.logprobs for o in outs for c in o.outputs] == [c.logprobs for o in dense for c in o.outputs], path
        assert stats["sparse_blocks_read"] == stats["sparse_blocks_total"] > 0 and stats["steps"][path] > 0
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs, stats = generate(llama, greedy, sparse_attention=quest)
    assert tokens(outs) == tokens(generate(llama, greedy)[0]) and stats["steps"]["native_multi_step"] > 0
    assert stats["sparse_blocks_read"] == stats["sparse_blocks_total"] > 0
    _, stats = generate(llama, greedy, sparse_attention="quest:budget=96,recent=8,sinks=4")
    assert stats["sparse_blocks_read"] < stats["sparse_blocks_total"]


# int4 pages in blocks of 16: in blocks of 4, a block's packed K and V hold fewer bytes than its float32 summary,
# and choosing never pays (kv/sparse.py's selection_pays)
@pytest.mark.parametrize("kw", [{}, {"dtype": "bfloat16"}, {"kv_cache_dtype": "int8"},
                                {"kv_cache_dtype": "int4", "block_size": 16}],
                         ids=["float32", "bfloat16", "int8-pages", "int4-pages"])
def test_every_path_chooses_the_same_blocks(llama, kw):
    """Under a budget smaller than the contexts: the C step (several steps a call, and one), and the eager native
    backend (its C kernels, the same choice within each task), give the same tokens and count the same reads; the
    reads are fewer than the blocks; and the tokens differ from dense attention's (the budget binds)."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    runs = {name: generate(llama, params, sparse_attention=QUEST, **run, **kw) for name, run in
            [("native_multi_step", {}), ("native", {"num_scheduler_steps": 1}), ("eager", {"enforce_eager": True})]}
    (ref, ref_stats), *others = runs.values()
    for name, (outs, stats) in runs.items():
        assert stats["steps"][name] > 0
        assert tokens(outs) == tokens(ref), name
    counts = [(s["sparse_blocks_read"], s["sparse_blocks_total"]) for _, s in list(runs.values())[1:]]
    assert counts[0] == counts[1] and counts[0][0] < counts[0][1]
    assert tokens(ref) != tokens(generate(llama, params, **kw)[0])


def test_triton_chooses_as_the_c_kernels(llama):
    """The Triton backend (under the interpreter: attention/sparse.py's select_blocks, then its decode kernel over
    each KV head's blocks): the native backend's tokens and counts."""
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    prompts = [p[:70] for p in PROMPTS[:2]]
    native, triton = (generate(llama, params, prompts, sparse_attention=QUEST, enforce_eager=True,
                               attention_backend=backend) for backend in ("native", "triton"))
    assert tokens(native[0]) == tokens(triton[0])
    assert native[1]["sparse_blocks_read"] == triton[1]["sparse_blocks_read"] < triton[1]["sparse_blocks_total"]


def test_a_hybrid_model_selects_in_its_full_attention_layers(gemma2):  # noqa: F811
    """Gemma 2 (a sliding layer, window 8, and a global one, soft-capped scores): the C step and the eager backend
    give the same tokens, and only the global layer's tasks are counted (a sliding layer attends within its
    window)."""
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = [p[:60] for p in PROMPTS]
    runs = [generate(gemma2, params, prompts, sparse_attention="quest:budget=16,recent=4,sinks=4,dense_layers=0",
                     **kw) for kw in ({"num_scheduler_steps": 1}, {"enforce_eager": True})]
    assert tokens(runs[0][0]) == tokens(runs[1][0])
    read, total = runs[0][1]["sparse_blocks_read"], runs[0][1]["sparse_blocks_total"]
    kv_heads, decodes = 2, 3 * 7          # one global layer: its KV heads' tasks in each decode step
    assert read < total and total == kv_heads * sum(cdiv(len(p) + i, 4) for p in prompts for i in range(1, 8))
    assert runs[0][1]["steps"]["native"] == decodes // 3


def test_requests_choose_their_own(llama):
    """A request's sparse_attention overrides the engine's ("none": dense attention), and the record of the last
    step shows, per layer, which blocks a sequence read: all of them in its dense layers."""
    llm = LLM(str(llama), block_size=4, num_kv_blocks=240, dtype="float32", sparse_attention=QUEST,
              num_scheduler_steps=1)
    dense = LLM(str(llama), block_size=4, num_kv_blocks=240, dtype="float32")
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    mine = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, sparse_attention="none")
    assert tokens(llm.generate(PROMPTS[:1], mine, use_tqdm=False)) == tokens(dense.generate(PROMPTS[:1], greedy,
                                                                                            use_tqdm=False))
    engine = llm.engine
    engine.add_request("a", PROMPTS[0], greedy)
    while not engine.runner.sparse.rows:
        engine.step()
    seq = engine.requests["a"][0]
    strip = engine.runner.sparse.blocks_read(seq.seq_id)
    blocks = cdiv(seq.num_computed_tokens, 4)
    assert strip[0][:blocks] == [2] * blocks                       # dense_layers=1: both KV heads read every block
    assert 0 < sum(x > 0 for x in strip[1]) < blocks and max(strip[1]) <= 2
    assert engine.runner.sparse.blocks_read(10**6) is None


def test_a_prompts_last_token_attends_densely_after_a_prefix_hit(llama):
    """A prefix hit that leaves one prompt token to compute (a decode to the scheduler): that token attends densely,
    as in a prefill, so that the tokens are those of the engine without prefix caching, by the C step a token a
    call and several; the generated tokens' decodes stay sparse."""
    prefix = PROMPTS[0][:120]                        # 30 blocks, past the budget
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for kw in ({}, {"num_scheduler_steps": 1}):
        runs = []
        for caching in (False, True):
            llm = LLM(str(llama), block_size=4, num_kv_blocks=240, dtype="float32", sparse_attention=QUEST,
                      enable_prefix_caching=caching, **kw)
            runs.append([tokens(llm.generate([prefix + [last]], greedy, use_tqdm=False)) for last in (7, 9)])
            stats = llm.stats()
        assert runs[1] == runs[0], kw
        assert stats["prefix_cache_hits"] == len(prefix) and 0 < stats["sparse_blocks_read"] < stats[
            "sparse_blocks_total"]


def test_metrics_count_the_blocks_read(llama):
    """/metrics' counters of sparse attention's reads are stats()'s."""
    from kvserve.server.metrics import EngineCollector

    outs, stats = generate(llama, SamplingParams(max_tokens=4, temperature=0), sparse_attention=QUEST)
    values = {s.name: s.value for f in EngineCollector(lambda: stats, "m").collect() for s in f.samples}
    assert values["kvserve:sparse_blocks_read_total"] == stats["sparse_blocks_read"] > 0
    assert values["kvserve:sparse_blocks_context_total"] == stats["sparse_blocks_total"] > stats["sparse_blocks_read"]


def test_tensor_parallel_ranks_choose_as_one_rank(checkpoint):
    """Two ranks, each choosing for its own KV heads (the C step on every rank): one rank's tokens."""
    path = checkpoint("llama", max_position_embeddings=256)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outs = []
    for tp in (1, 2):
        llm = LLM(str(path), tensor_parallel_size=tp, block_size=4, num_kv_blocks=200, dtype="float32",
                  sparse_attention=QUEST)
        try:
            outs.append((tokens(llm.generate(PROMPTS[:2], params, use_tqdm=False)), llm.stats()))
        finally:
            llm.shutdown()
    assert outs[0][0] == outs[1][0] and outs[1][1]["steps"]["native_tp"] > 0


def test_the_option_refuses_what_it_cannot_serve(llama):
    kw = dict(block_size=4, num_kv_blocks=64, dtype="float32")
    with pytest.raises(ValueError, match="the sdpa attention backend reads every block"):
        LLM(str(llama), sparse_attention=QUEST, attention_backend="sdpa", **kw)
    with pytest.raises(ValueError, match="needs a KV cache"):
        LLM(str(llama), sparse_attention=QUEST, cache_mode="none")
    with pytest.raises(ValueError, match="sparse_attention: malformed"):
        SamplingParams(sparse_attention="quest:budget=x")
    dense = LLM(str(llama), **kw)
    with pytest.raises(ValueError, match="needs an engine started with sparse_attention"):
        dense.generate(PROMPTS[:1], SamplingParams(sparse_attention=QUEST), use_tqdm=False)
    with pytest.raises(APIError) as e:
        CompletionRequest(model="m", prompt="x", sparse_attention="quest:budget=2").sampling_params(4, 384)
    assert e.value.status == 400 and e.value.param == "sparse_attention"


@pytest.mark.parametrize("eviction", ["sink:sinks=4,window=40", "h2o:budget=44,recent=8", "snapkv:budget=44,window=8"])
def test_eviction_keeps_the_tokens_sparse_attention_reads_some_of(llama, eviction):
    """Beside an eviction policy: a budget past every cache is the policy alone, bit for bit; a smaller one reads
    fewer blocks of the cache the policy keeps, whose summaries stay exact after every step (compactions, rotated
    sinks)."""
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone, _ = generate(llama, greedy, eviction=eviction)
    outs, stats = generate(llama, greedy, eviction=eviction, sparse_attention="quest:budget=4096,recent=8,sinks=4")
    assert tokens(outs) == tokens(alone) and stats["num_evicted_tokens"] > 0
    llm = LLM(str(llama), block_size=4, num_kv_blocks=240, dtype="float32", eviction=eviction,
              sparse_attention="quest:budget=16,recent=4,sinks=4,dense_layers=1")
    engine, checked = llm.engine, 0
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, greedy)
    while engine.has_unfinished_requests():
        engine.step()
        checked += check_summaries(llm)
    stats = llm.stats()
    assert checked > 0 and stats["num_evicted_tokens"] > 0
    assert 0 < stats["sparse_blocks_read"] < stats["sparse_blocks_total"]


# ---- summaries stay exact: a property ------------------------------------------------------------------------------

def check_summaries(llm: LLM) -> int:
    """Every block a running sequence holds (of its cached tokens: an eviction policy's): its summary in every
    layer is the min and max of its cached keys (as attention reads them), rounded outward to the model's dtype.
    Returns the blocks checked."""
    engine = llm.engine
    storage, bs, checked = engine.storage, engine.kv.block_size, 0
    for seq in engine.scheduler.running:
        n = seq.num_tokens_in_cache
        table = engine.kv.group_tables(seq.seq_id)[0][:cdiv(n, bs)]
        ids = torch.tensor(table)
        for i in range(engine.model_config.num_layers):
            layer = storage.layer(i)
            keys, summary = layer.decoded_keys(ids), layer.summaries.data[:, ids]
            for j in range(len(table)):
                filled = keys[:, j, :min(bs, n - j * bs)]
                assert torch.equal(summary[:, j, 0], round_down(filled.amin(1), layer.dtype)), (seq.seq_id, i, j)
                assert torch.equal(summary[:, j, 1], round_up(filled.amax(1), layer.dtype)), (seq.seq_id, i, j)
        checked += len(table)
    return checked


PREFIXES = [torch.randint(3, 384, (32,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(2)]
# (prefix, its tokens kept, tokens after it, n, max_tokens)
request = st.tuples(st.integers(0, 1), st.integers(0, 32), st.integers(0, 9), st.integers(1, 3), st.integers(1, 20))
WORKLOAD = [[(0, 32, 3, 2, 20), (1, 28, 5, 3, 16), (0, 20, 9, 1, 20)], [(1, 32, 0, 1, 8), (0, 32, 4, 2, 12)],
            [(0, 32, 7, 1, 6), (1, 24, 2, 2, 10)]]


def run_workload(path, tier, batches, pool: int, kv_cache_dtype: str, dtype: str, preemption_mode: str,
                 steps: int) -> dict:
    """Batches of requests, one after the other, over a small pool and a second tier; the summaries checked after
    every step (check_summaries). Returns the stats, with the blocks checked."""
    llm = LLM(str(path), block_size=4, num_kv_blocks=pool, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
              sparse_attention="quest:budget=12,recent=4,sinks=4,dense_layers=1", kv_offload=f"disk:{tier}",
              preemption_mode=preemption_mode, num_scheduler_steps=steps, max_num_seqs=6)
    engine, checked, r = llm.engine, 0, 0
    for batch in batches:
        for prefix, keep, suffix, n, max_tokens in batch:
            tail = torch.randint(3, 384, (suffix,), generator=torch.Generator().manual_seed(suffix)).tolist()
            engine.add_request(str(r), PREFIXES[prefix][:keep] + tail or [5],
                               SamplingParams(n=n, max_tokens=max_tokens, temperature=1.0, seed=r, ignore_eos=True),
                               final_only=True)
            r += 1
        while engine.has_unfinished_requests():
            engine.step()
            checked += check_summaries(llm)
        engine.kv.check_invariants()
    stats = llm.stats()
    engine.close()
    return {**stats, "checked": checked}


@pytest.mark.parametrize("preemption_mode", ["swap", "recompute"])
def test_summaries_stay_exact_through_preemption_prefix_hits_forks_and_the_tier(llama, tmp_path, preemption_mode):
    """A workload that preempts (by swap through the second tier, or recompute), hits cached prefixes (in the pool
    and in the tier), and forks n samples from one prompt (the shared last block copied on write): after every
    step, every block a running sequence holds is summarised exactly."""
    stats = run_workload(llama, tmp_path, WORKLOAD, 22, "auto", "float32", preemption_mode, 1)
    assert stats["checked"] > 0 and stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert stats["kv_offload_loads"] > 0 and stats["steps"]["native"] > 0
    assert (stats["kv_offload_swap_ins"] > 0) == (preemption_mode == "swap")


# int8 pages in blocks of 16 (in blocks of 4, choosing never pays: kv/sparse.py's selection_pays)
@pytest.mark.parametrize("kw", [{}, {"enforce_eager": True}, {"kv_cache_dtype": "int8", "block_size": 16}],
                         ids=["c-step", "eager", "int8-pages"])
def test_summaries_forget_the_drafts_a_verification_rejects(llama, kw):
    """N-gram speculation beside sparse attention: a verification writes its drafts' keys into the summaries and
    rejects most of them; after every step every block is summarised exactly (from the tokens it keeps), and the
    tokens are those of sparse attention without speculation."""
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9, 10] * 8, PROMPTS[1]]
    expected, _ = generate(llama, params, prompts, sparse_attention=QUEST, num_scheduler_steps=1, **kw)
    llm = LLM(str(llama), num_kv_blocks=240, dtype="float32", sparse_attention=QUEST, speculative_config=ngram,
              num_scheduler_steps=1, **{"block_size": 4, **kw})
    for i, p in enumerate(prompts):
        llm.engine.add_request(str(i), {"prompt_token_ids": p}, params)
    got = {}
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            got[out.request_id] = out.outputs[0].token_ids
        check_summaries(llm)
    stats = llm.stats()
    assert [got[str(i)] for i in range(len(prompts))] == tokens(expected)
    assert stats["spec_decode_num_draft_tokens"] > stats["spec_decode_num_accepted_tokens"]
    assert 0 < stats["sparse_blocks_read"] < stats["sparse_blocks_total"]


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                HealthCheck.too_slow])
@given(batches=st.lists(st.lists(request, min_size=1, max_size=4), min_size=1, max_size=3),
       pool=st.integers(20, 30), kv_cache_dtype=st.sampled_from(["auto", "int8", "int4"]),
       dtype=st.sampled_from(["float32", "bfloat16"]), preemption_mode=st.sampled_from(["swap", "recompute"]),
       steps=st.sampled_from([1, 4]))
def test_summaries_stay_exact(llama, tmp_path_factory, batches, pool, kv_cache_dtype, dtype, preemption_mode, steps):
    """The same over random workloads, quantized pages, bfloat16 and several C steps a call."""
    stats = run_workload(llama, tmp_path_factory.mktemp("tier"), batches, pool, kv_cache_dtype, dtype,
                         preemption_mode, steps)
    assert stats["sparse_blocks_read"] <= stats["sparse_blocks_total"]
