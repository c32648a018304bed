"""The hybrid KV cache (kv/groups.py): layer groups, a sliding group's blocks bounded by its window, prefix hits
that need only a sliding group's last window, no leak under prefix hits, forks and preemption, and eviction (sink,
h2o, snapkv) in the full-attention groups while each sliding group keeps its window."""
from __future__ import annotations


import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_prefix_caching import run_checked

from kvserve import LLM, SamplingParams
from kvserve.kv.blocks import block_key
from kvserve.kv.eviction import Sink
from kvserve.kv import KVCacheManager, LayerGroup, layer_groups
from kvserve.kv.storage import block_spec, layer_slots
from kvserve.kv.spec import KVSpec

WINDOW = 8


def test_gemma3_1b_groups():
    """26 layers, every sixth global (window 512): 4 full layers and 22 sliding ones, cut into groups of 4, the
    last holding 2 (vLLM's rule): one block holds 4 layers' pages."""
    windows = tuple(None if (i + 1) % 6 == 0 else 512 for i in range(26))
    groups = layer_groups(windows, 32768)
    assert groups[0] == LayerGroup(None, (5, 11, 17, 23))
    assert [g.sliding_window for g in groups[1:]] == [512] * 6
    assert [len(g.layers) for g in groups] == [4, 4, 4, 4, 4, 4, 2]
    assert block_spec(KVSpec(26, 1, 256, torch.float32), groups).num_layers == 4
    slots, owner = layer_slots(groups, 26)
    assert (slots[5], owner[5], slots[24], owner[24], slots[25], owner[25]) == (0, 0, 0, 6, 1, 6)
    # int8 pages but layers 0 (sliding) and 5 (global) in float32: a block holds one float32 tensor, then enough
    # int8 ones for a group of four quantized layers; each layer takes one of its own dtype
    spec = block_spec(KVSpec(26, 1, 256, torch.float32, 16, "int8", (0, 5)), groups)
    assert (spec.num_layers, spec.skip_layers) == (5, (0,))
    slots, _ = layer_slots(groups, 26, set(range(26)) - {0, 5})
    assert [slots[i] for i in (0, 1, 2, 3, 5, 11, 17, 23, 4, 8)] == [0, 1, 2, 3, 0, 1, 2, 3, 1, 4]


@pytest.mark.parametrize("windows, max_model_len, expected", [
    ((4096, None, 4096, None), 8192, [LayerGroup(None, (1, 3)), LayerGroup(4096, (0, 2))]),    # Gemma 2
    ((4096,) * 3, 8192, [LayerGroup(4096, (0, 1, 2))]),                                       # Mistral
    ((4096, None, 4096, None), 4096, [LayerGroup(None, (0, 1, 2, 3))]),   # a window that never binds
    ((None, 16, 16, 16, 16), 64, [LayerGroup(None, (0,)), *(LayerGroup(16, (i,)) for i in range(1, 5))]),
    ((16,) * 9 + (None,) * 8, 64,      # 9 and 8 layers: within a quarter, padded to 9 rather than cut
     [LayerGroup(None, tuple(range(9, 17))), LayerGroup(16, tuple(range(9)))]),
    ((16,) * 5 + (None,) * 4, 64,      # 5 and 4 layers: cut into groups of 4
     [LayerGroup(None, (5, 6, 7, 8)), LayerGroup(16, (0, 1, 2, 3)), LayerGroup(16, (4,))]),
])
def test_layer_groups(windows, max_model_len, expected):
    assert layer_groups(windows, max_model_len) == expected


def keys(tokens: list[int], block_size: int):
    out, parent = [], None
    for i in range(len(tokens) // block_size):
        out.append(block_key(parent, tuple(tokens[i * block_size:(i + 1) * block_size]), None))
        parent = out[-1].hash
    return out


def live(table: list[int], kv: KVCacheManager) -> int:
    return sum(b != kv.null_block for b in table)


def hybrid(num_blocks: int = 64, block_size: int = 4) -> KVCacheManager:
    return KVCacheManager(num_blocks, block_size, [LayerGroup(None, (0,)), LayerGroup(WINDOW, (1,))])


@pytest.mark.parametrize("block_size", [2, 3, 4])
def test_a_sliding_group_holds_its_window_only(block_size):
    """A sequence of 4x the window, a prompt chunk then one token a step: the sliding group's table never holds
    more than window/block_size + 1 blocks once decoding; the full group holds every token's; all return."""
    kv = hybrid(128, block_size)
    kv.allocate(0, 0, 5)
    kv.release_past_window(0, 5)
    for pos in range(5, 4 * WINDOW):
        kv.allocate(0, pos, 1)
        kv.release_past_window(0, pos + 1)
        full, sliding = kv.group_tables(0)
        assert len(full) == len(sliding) == -(-(pos + 1) // block_size)
        assert live(sliding, kv) <= -(-WINDOW // block_size) + 1
        # the blocks a query at pos + 1 attends to are all there
        assert all(b != kv.null_block for b in sliding[max(0, pos + 2 - WINDOW) // block_size:])
    assert kv.blocks_per_group() == [-(-4 * WINDOW // block_size), live(sliding, kv)]
    kv.free(0)
    assert kv.num_free_blocks == kv.num_blocks - 1 and kv.pool.ref_counts[kv.null_block] == 1


def test_prefix_hit_needs_only_the_sliding_window():
    """A finished sequence of 8 blocks: the full group's blocks are all cached, the sliding group's first ones
    went back to the pool early but stay indexed until reused. A hit takes the full group's 8 blocks and only
    the sliding group's last window (the null block before it); once a block of that window is reused by
    another sequence, the hit ends where the sliding group's cached run covers a window again."""
    kv, bs = hybrid(64, 4), 4
    tokens = list(range(100, 132))
    ks = keys(tokens, bs)
    kv.allocate(0, 0, 32)
    kv.cache_blocks(0, 0, ks)
    kv.release_past_window(0, 32)
    assert live(kv.group_tables(0)[1], kv) == 2      # positions 25..31 for the query at 32: blocks 6, 7
    kv.free(0)
    hit = kv.lookup(ks)
    hits = [list(h) for h in hit.blocks]
    assert len(hits[0]) == len(hits[1]) == 8 and kv.null_block not in hits[0]
    # the token after 8 blocks (position 32) attends to 25..31: blocks 6 and 7
    assert hits[1][:6] == [kv.null_block] * 6 and kv.null_block not in hits[1][6:]
    assert hit.num_blocks == 8
    # the sliding group's cached blocks 6 and 7 are reclaimed by their index; block 5 too, more recently freed
    kv.share_prefix(1, hit)
    kv.allocate(1, 32, 1)
    kv.free(1)
    sliding_block_5 = kv.pool.lookup(ks[5].in_group(1))
    assert sliding_block_5 is not None
    kv.pool.allocate(kv.num_free_blocks)     # every free block reused: the whole index is gone
    assert kv.lookup(ks).blocks == ((), ())


def test_a_missing_window_block_shortens_the_hit():
    """With the sliding group's block 7 no longer cached, a hit of 8 blocks is impossible; one of 7 needs
    blocks 5 and 6 of the sliding group (positions 21..27 for the query at 28), which it has."""
    kv, bs = hybrid(64, 4), 4
    ks = keys(list(range(32)), bs)
    kv.allocate(0, 0, 32)
    kv.cache_blocks(0, 0, ks)
    kv.release_past_window(0, 32)
    kv.free(0)
    kv.pool.uncache(kv.pool.lookup(ks[7].in_group(1)), ks[7].in_group(1))
    hits = [list(h) for h in kv.lookup(ks).blocks]
    assert len(hits[0]) == len(hits[1]) == 7
    assert hits[1][:5] == [kv.null_block] * 5 and kv.null_block not in hits[1][5:]


# ---------------------------------------------------------------- end to end, against the one-table cache

SYSTEM = torch.randint(3, 384, (40,), generator=torch.Generator().manual_seed(7)).tolist()


def test_gemma3_is_hybrid_and_bounded(gemma3):
    """A request of 4x the window: the sliding groups hold at most window/block_size + 1 blocks while it decodes
    (llm.stats()'s kv_groups), the global group all of its tokens' blocks; all of them return at the end."""
    llm = LLM(str(gemma3), block_size=4, num_kv_blocks=64, dtype="float32")
    engine = llm.engine
    assert [g.sliding_window for g in engine.kv.layer_groups] == [None, WINDOW, WINDOW]
    engine.add_request("r", {"prompt_token_ids": SYSTEM[:12]},
                       SamplingParams(max_tokens=4 * WINDOW - 12, temperature=0, ignore_eos=True))
    decoding = 0
    while engine.has_unfinished_requests():
        engine.step()
        seq = engine.requests.get("r", [None])[0]
        if seq is not None and seq.num_output_tokens > 1:
            groups = engine.stats()["kv_groups"]
            assert all(g["blocks_in_use"] <= WINDOW // 4 + 1 for g in groups[1:])
            assert groups[0]["blocks_in_use"] == -(-seq.num_computed_tokens // 4)
            decoding += 1
    assert decoding > 0
    assert engine.stats()["kv_blocks_free"] == engine.stats()["kv_blocks_total"] - 1   # the null block
    engine.kv.check_invariants()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(suffixes=st.lists(st.integers(0, 12), min_size=1, max_size=5), ns=st.lists(st.integers(1, 3), min_size=5,
       max_size=5), block_size=st.integers(2, 5), spare=st.integers(0, 8), budget=st.integers(4, 40),
       max_tokens=st.integers(1, 12), prefix_caching=st.booleans(),
       evictions=st.lists(st.sampled_from([None, "sink:sinks=2,window=8", "sink:sinks=0,window=9",
                                           "sink:sinks=5,window=9", "h2o:budget=12,recent=8",
                                           "h2o:budget=14,recent=9,score=sum", "snapkv:budget=12,window=8"]),
                          min_size=5, max_size=5))
def test_hybrid_never_leaks_and_never_changes_tokens(gemma3, suffixes, ns, block_size, spare, budget, max_tokens,
                                                     prefix_caching, evictions):
    """Prefix hits past the window, forks with copy-on-write, eviction of cached blocks, preemption and requests
    under `sink` (evicting from the global group, pinning its sink blocks), h2o and snapkv (compacting the global
    group, the sliding groups dropping their null entries) beside others, mixed at random over three layer groups
    (with prefix caching on or off): the tokens of the one-table cache, and every block back in the end. An
    evicting request's tokens depend on where its prompt chunks ended (each step evicts what is due), which a small
    pool moves (preemption, admission): of those, the lengths are compared here, the tokens by
    test_sink_with_a_hybrid_cache_gives_the_one_table_tokens and
    test_scored_policies_with_a_hybrid_cache_give_the_one_table_tokens."""
    prompts = [{"prompt_token_ids": SYSTEM[:20] + SYSTEM[-k:]} if k else {"prompt_token_ids": SYSTEM[:23]}
               for k in suffixes]
    params = [SamplingParams(n=n, max_tokens=max_tokens, temperature=1.0, seed=3, ignore_eos=True, eviction=e)
              for n, e in zip(ns[:len(prompts)], evictions)]
    ref = LLM(str(gemma3), block_size=block_size, num_kv_blocks=512, enable_prefix_caching=False,
              disable_hybrid_kv_cache_manager=True, dtype="float32")
    expected = [[o.token_ids for o in out.outputs] for out in ref.generate(prompts, params, use_tqdm=False)]
    need = max(-(-(len(p["prompt_token_ids"]) + max_tokens) // block_size) for p in prompts)
    llm = LLM(str(gemma3), block_size=block_size, num_kv_blocks=3 * need + 4 + spare, max_num_batched_tokens=budget,
              dtype="float32", enable_prefix_caching=prefix_caching)
    got = run_checked(llm.engine, prompts, params, llm.engine.kv.check_invariants)
    for eviction, ours, theirs in zip(evictions, got, expected):
        assert (ours if eviction is None else [len(t) for t in ours]) == \
            (theirs if eviction is None else [len(t) for t in theirs])
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"] - 1
    # every prompt (20 tokens or more) outgrows every policy here at every block size: an evicting request
    # evicts once its prompt is computed (sink's window of 9 drops a block past 9 + its sink blocks + a block)
    assert (llm.stats()["num_evicted_tokens"] > 0) == any(evictions[:len(prompts)])
    assert not llm.engine.kv.pinned


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "int4"])
def test_quantized_pages_per_group(gemma3, kv_cache_dtype):
    """Quantized pages in every group: the same tokens and logits as the one-table cache quantized alike, in
    chunks across the window, with a prefix hit."""
    prompts = [{"prompt_token_ids": SYSTEM[:30]}, {"prompt_token_ids": SYSTEM[:26] + [5, 6, 7]}]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=3)
    kw = dict(block_size=4, num_kv_blocks=96, dtype="float32", kv_cache_dtype=kv_cache_dtype,
              long_prefill_token_threshold=12)
    outs = []
    for disable in (True, False):
        llm = LLM(str(gemma3), disable_hybrid_kv_cache_manager=disable, **kw)
        outs.append([llm.generate(p, params, use_tqdm=False)[0].outputs[0] for p in prompts])
    assert len(llm.engine.kv.layer_groups) == 3 and llm.stats()["prefix_cache_hits"] > 0
    for ref, ours in zip(*outs):
        assert ours.token_ids == ref.token_ids
        for a, b in zip(ours.logprobs, ref.logprobs):
            assert a.keys() == b.keys()
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
    llm.engine.kv.check_invariants()


def test_one_table_executors_need_one_group():
    """CUDA graphs read one block table for every layer: a hybrid cache of several layer groups decodes eagerly on
    CUDA (one group of sliding layers, Mistral's, keeps them; the CPU's C step reads a table per group)."""
    from kvserve.attention.triton import TritonBackend
    from kvserve.config import EngineConfig
    from kvserve.engine.executor import cuda_graphs_wanted

    config, spec = EngineConfig(), KVSpec(2, 1, 16, torch.float32)
    wanted = [cuda_graphs_wanted(config, torch.device("cuda"), spec, TritonBackend(), n) for n in (0, 1, 3)]
    assert wanted == [True, True, False]


def test_a_request_that_cannot_fit_names_the_chunk(gemma3):
    """A 40-token prompt and a token written in one chunk hold all their blocks in each of the three groups (3 x 11
    blocks of 4 tokens): refused in a pool of 21 with the way out; in chunks of 8, its sliding groups hold their
    window and a chunk (5 blocks each at most) and it fits, with the one-table cache's tokens."""
    with pytest.raises(ValueError, match="needs 33 KV blocks of 4 tokens; the whole pool has 21; a smaller "
                                         "long_prefill_token_threshold"):
        LLM(str(gemma3), block_size=4, num_kv_blocks=21, dtype="float32").generate(
            {"prompt_token_ids": SYSTEM}, SamplingParams(max_tokens=1), use_tqdm=False)
    params = SamplingParams(max_tokens=1, temperature=0)
    chunked = LLM(str(gemma3), block_size=4, num_kv_blocks=21, dtype="float32", long_prefill_token_threshold=8)
    whole = LLM(str(gemma3), block_size=4, num_kv_blocks=64, dtype="float32", disable_hybrid_kv_cache_manager=True)
    assert [o.outputs[0].token_ids for o in chunked.generate({"prompt_token_ids": SYSTEM}, params, use_tqdm=False)] \
        == [o.outputs[0].token_ids for o in whole.generate({"prompt_token_ids": SYSTEM}, params, use_tqdm=False)]


def test_a_window_of_one_token_never_indexes_the_null_block():
    """With a window of 1, a block leaves the window as soon as it fills: indexing it afterwards (as a multi-step
    decode does) must not put the null block in the prefix index, where a hit would read it as tokens."""
    kv = KVCacheManager(16, 2, [LayerGroup(None, (0,)), LayerGroup(1, (1,))])
    ks = keys([5, 6, 7, 8], 2)
    kv.allocate(0, 0, 4)
    kv.release_past_window(0, 4)
    assert kv.group_tables(0)[1] == [kv.null_block, kv.null_block]
    kv.cache_blocks(0, 0, ks)
    assert kv.pool.keys[kv.null_block] is None
    hits = [list(h) for h in kv.lookup(ks).blocks]
    assert len(hits[0]) == 2 and hits[1] == [kv.null_block] * 2     # the next query needs no cached token


# ---------------------------------------------------------------- sink eviction per layer group

SINK = "sink:sinks=4,window=12"


def _with_and_without_hybrid_cache(path, eviction: str, backend: str, prompts: list, params: list):
    """The greedy tokens and evicted counts of the one-table cache, then the hybrid one, under the same policies,
    and the hybrid engine; the tokens are the same. Neither preempts: the same chunks in both, as what a policy
    evicts depends on them."""
    outs, evicted = [], []
    for disable in (True, False):
        llm = LLM(str(path), eviction=eviction, disable_hybrid_kv_cache_manager=disable, attention_backend=backend,
                  block_size=4, num_kv_blocks=96, dtype="float32", long_prefill_token_threshold=12)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        evicted.append(llm.stats()["num_evicted_tokens"])
        assert llm.stats()["num_preemptions"] == 0
    assert any(g.sliding_window for g in llm.engine.kv.layer_groups) and outs[0] == outs[1]
    return outs, evicted, llm


@pytest.mark.parametrize("backend", ["native", "sdpa", "flash", "textbook"])
@pytest.mark.parametrize("model", ["gemma3", "gemma2", "mistral"])
def test_sink_with_a_hybrid_cache_gives_the_one_table_tokens(request, model, backend):
    """`sink` for the engine and per request, with the hybrid cache: the global layers keep the sinks and the sink
    window, each sliding group its own window, and the greedy tokens equal the one-table cache's under the same
    policies (a sliding layer sees its last 8 positions either way). Prompts and generations well past both, in
    chunks that cut across windows and blocks, batched with a shorter request and one that evicts nothing."""
    path = request.getfixturevalue(model)
    prompts = [{"prompt_token_ids": SYSTEM[:n]} for n in (40, 17, 33)]
    params = [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, eviction=e)
              for e in (None, "sink:sinks=2,window=9", "none")]
    outs, evicted, llm = _with_and_without_hybrid_cache(path, SINK, backend, prompts, params)
    assert evicted[0] == evicted[1] > 0
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"] - 1
    llm.engine.kv.check_invariants()


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "int4"])
@pytest.mark.parametrize("backend", ["native", "sdpa", "flash", "textbook"])
@pytest.mark.parametrize("model, skip", [("gemma3", (1, 2)), ("gemma2", (0,))])
def test_skip_layers_per_group(request, model, skip, backend, kv_cache_dtype):
    """kv_cache_dtype_skip_layers with the hybrid cache (Gemma 3: a sliding and the global layer kept; Gemma 2: its
    sliding one): each layer reads and writes its pages in its own dtype whatever group holds the block, so that the
    greedy tokens equal the one-table cache's with the same layers kept, batched, past the window. The pool's
    tensors are its blocks' bytes, within kv_cache_memory, and every block returns."""
    path = request.getfixturevalue(model)
    prompts = [{"prompt_token_ids": SYSTEM[:n]} for n in (40, 17, 33)]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    budget = 2**20 + 123
    outs = []
    for disable in (True, False):
        llm = LLM(str(path), disable_hybrid_kv_cache_manager=disable, attention_backend=backend, block_size=4,
                  kv_cache_memory=budget, dtype="float32", kv_cache_dtype=kv_cache_dtype,
                  kv_cache_dtype_skip_layers=skip, long_prefill_token_threshold=12)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    engine, stats = llm.engine, llm.stats()
    assert len(engine.kv.layer_groups) > 1 and outs[0] == outs[1]
    assert [engine.storage.layer(i).format.quantized for i in range(engine.model_config.num_layers)] \
        == [i not in skip for i in range(engine.model_config.num_layers)]
    assert stats["kv_cache_bytes"] == stats["kv_blocks_total"] * engine.kv_spec.bytes_per_block <= budget
    assert stats["kv_blocks_total"] == budget // engine.kv_spec.bytes_per_block
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] - 1
    engine.kv.check_invariants()


@pytest.mark.parametrize("sinks", [4, 0])
def test_sink_bounds_each_group(gemma3, sinks):
    """A request of 80 tokens under sink with the hybrid cache, a prompt chunk then one token a step: the global
    group's table holds at most the sink budget's blocks (and the pinned originals of its sink blocks beside it),
    each sliding group's at most window/block_size + 1 live blocks, as llm.stats() reports per group; all of them
    return at the end."""
    policy = Sink(sinks, 12)
    llm = LLM(str(gemma3), block_size=4, num_kv_blocks=64, dtype="float32", eviction=policy.spec())
    engine, kv = llm.engine, llm.engine.kv
    engine.add_request("r", {"prompt_token_ids": SYSTEM[:20]},
                       SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))
    seq, budget, decoding = engine.requests["r"][0], policy.max_cache_tokens(4) // 4, 0
    while engine.has_unfinished_requests():
        engine.step()
        if seq.is_finished or seq.num_output_tokens < 2:
            continue
        full, *sliding = kv.group_tables(seq.seq_id)
        assert len(full) <= budget and all(len(t) == len(full) for t in sliding)
        assert all(live(t, kv) <= WINDOW // 4 + 1 for t in sliding)
        groups = engine.stats()["kv_groups"]
        assert groups[0]["blocks_in_use"] == len(full) + len(kv.pinned.get(seq.seq_id, []))
        assert [g["blocks_in_use"] for g in groups[1:]] == [live(t, kv) for t in sliding]
        kv.check_invariants()
        decoding += 1
    assert decoding > 40 and seq.num_evicted_tokens > 40
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"] - 1 and not kv.pinned


@pytest.mark.parametrize("flag, message", [
    ({"eviction": "h2o:budget=32,recent=7"}, "eviction 'h2o:budget=32,recent=7,score=max' .*h2o's recent \\(7\\) "
                                             "must be at least 8 tokens"),
    ({"eviction": "snapkv:budget=32,window=4"}, "eviction 'snapkv:budget=32,window=4,pool=7' .*snapkv's window "
                                                "\\(4\\) must be at least 8 tokens"),
    ({"eviction": "sink:sinks=4,window=4"}, "sink's window \\(4\\) must be at least 8 tokens"),
])
def test_eviction_that_would_cut_a_window_is_refused_as_the_engine_starts(gemma3, flag, message):
    """Recent tokens that do not cover a sliding layer's window (h2o's recent, snapkv's window, sink's window) would
    cut that window: the engine-wide policy is refused before any block is allocated, naming the policy and what is
    wrong."""
    with pytest.raises(ValueError, match=message):
        LLM(str(gemma3), block_size=4, num_kv_blocks=64, dtype="float32", **flag)


# ---------------------------------------------------------------- h2o and snapkv per layer group

SCORED = "snapkv:budget=18,window=9"


@pytest.fixture(scope="module")
def qwen2(checkpoint):
    """Two layers: a global one, then a sliding one (window 8; use_sliding_window from max_window_layers)."""
    return checkpoint("qwen2", use_sliding_window=True, sliding_window=WINDOW,
                      max_window_layers=1)


@pytest.mark.parametrize("backend", ["native", "sdpa", "flash", "textbook"])
@pytest.mark.parametrize("model", ["gemma3", "gemma2", "mistral", "qwen2"])
def test_scored_policies_with_a_hybrid_cache_give_the_one_table_tokens(request, model, backend):
    """snapkv for the engine and h2o per request, with the hybrid cache: they compact the full-attention groups, each
    sliding group keeps its window's blocks, and the greedy tokens equal the one-table cache's under the same
    policies. Prompts and generations well past the window and the budgets, in chunks that cut across windows and
    blocks, batched with a request that evicts nothing; once h2o's request is done, the native backend decodes the
    compacted caches in the C step. Whole blocks' worth of tokens go, and every block returns."""
    path = request.getfixturevalue(model)
    prompts = [{"prompt_token_ids": SYSTEM[:n]} for n in (40, 33, 17)]
    params = [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, eviction=e)
              for e in (None, "none", "h2o:budget=20,recent=8")]
    outs, evicted, llm = _with_and_without_hybrid_cache(path, SCORED, backend, prompts, params)
    assert all(len(t) == 30 for t in outs[1])
    # snapkv: the 40-token prompt to 20 tokens; h2o: 17 + 30 tokens to at most 23 (whole blocks of 4)
    assert evicted[0] == evicted[1] >= 20 + 24 and evicted[1] % 4 == 0
    assert (llm.stats()["steps"].get("native", 0) > 0) == (backend == "native")
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"] - 1
    llm.engine.kv.check_invariants()


def window_pages(engine, seq, layer: int) -> torch.Tensor:
    """Layer's K/V [2, KVH, WINDOW, D] at the sequence's last WINDOW cache slots, through the table the layer reads."""
    kv, n = engine.kv, seq.num_tokens_in_cache
    table = kv.group_tables(seq.seq_id)[engine.storage.layer_group[layer]]
    pages = engine.storage.layer(layer).gather(torch.tensor(table)).flatten(2, 3)
    return pages[:, :, n - WINDOW:n]


@pytest.mark.parametrize("disable", [False, True], ids=["hybrid", "one-table"])
@pytest.mark.parametrize("policy", ["h2o:budget=12,recent=8", "snapkv:budget=12,window=8"])
def test_sliding_layers_read_their_last_positions(gemma3, policy, disable):
    """Gemma 3's first two layers slide (window 8), before its global one: a policy that evicts between the chunks
    of a long prompt (h2o) or once it is computed (snapkv) leaves, after every step, their pages at the last 8 cache
    slots (through the table each reads) equal to those of the last 8 positions without eviction. The second
    layer's keys are computed from the first layer's attention over its window: it too saw its last positions. The
    tokens are scored by the global layer alone (its two KV heads)."""
    kw = dict(block_size=4, num_kv_blocks=96, dtype="float32", long_prefill_token_threshold=6,
              disable_hybrid_kv_cache_manager=disable)
    evicting, plain = LLM(str(gemma3), eviction=policy, **kw).engine, LLM(str(gemma3), **kw).engine
    for engine in (evicting, plain):
        engine.add_request("r", {"prompt_token_ids": SYSTEM}, SamplingParams(max_tokens=4, temperature=0))
    seq, ref = evicting.requests["r"][0], plain.requests["r"][0]
    scored_rows, after_step = [], evicting.evictor.after_step

    def recording_after_step(seqs, attention_mass):
        scored_rows.extend(mass.shape[0] for mass in attention_mass.values())
        after_step(seqs, attention_mass)

    evicting.evictor.after_step = recording_after_step
    checked = 0
    while not seq.is_finished and seq.token_ids == ref.token_ids:
        evicting.step()
        plain.step()
        if seq.is_finished or seq.num_computed_tokens < WINDOW:
            continue
        assert seq.num_computed_tokens == ref.num_computed_tokens and ref.num_evicted_tokens == 0
        for layer in (0, 1):
            torch.testing.assert_close(window_pages(evicting, seq, layer), window_pages(plain, ref, layer),
                                       rtol=1e-5, atol=1e-5)
        checked += seq.num_evicted_tokens > 0
    assert checked and seq.num_evicted_tokens % 4 == 0
    assert scored_rows and set(scored_rows) == {2}
