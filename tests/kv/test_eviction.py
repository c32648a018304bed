"""Eviction policies (sink, h2o, snapkv) in the paged, batched engine: exactness, memory bounds, no leaks."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve import LLM, SamplingParams
from kvserve.attention import mass
from kvserve.kv.eviction import H2O, Sink, SnapKV, parse_eviction
from kvserve.kv.pages import FullPages
from tiny_models import hf_model

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(checkpoint):
    return checkpoint("llama", max_position_embeddings=128)


@pytest.fixture(scope="module")
def one_layer(checkpoint):
    # one layer: a token's K/V depend on its own embedding and position only, so the cache a
    # policy keeps equals a fresh run over the kept tokens at their positions within the cache
    return checkpoint("llama", num_hidden_layers=1,
                      max_position_embeddings=64)


def ids(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_specs_parse_and_bad_ones_show_the_form():
    assert parse_eviction("sink:sinks=4,window=1020") == Sink(4, 1020)
    assert parse_eviction("h2o:budget=512,recent=64") == H2O(512, 64)
    assert parse_eviction("snapkv:budget=512,window=32") == SnapKV(512, 32)
    assert parse_eviction({"policy": "h2o", "budget": 100}) == H2O(100, 64)
    assert parse_eviction("h2o:budget=512,recent=64,score=sum") == H2O(512, 64, "sum")
    assert parse_eviction(H2O(512, 64, "sum").spec()) == H2O(512, 64, "sum")
    assert parse_eviction("sink") == Sink() and parse_eviction("none") is None and parse_eviction(None) is None
    for bad, message in [("lru:budget=3", "unknown eviction policy 'lru'"), ("sink:size=3", "has no option size"),
                         ("h2o:budget=ten", "malformed"), ("h2o:budget=64,recent=64", "recent < budget"),
                         ("h2o:score=mean", "score is max or sum"),
                         ("sink:window", "malformed"), (7, "string or a dict")]:
        with pytest.raises(ValueError, match=message) as err:
            parse_eviction(bad)
        assert "h2o:budget=512,recent=64" in str(err.value)
    with pytest.raises(ValueError, match="unknown eviction policy"):
        SamplingParams(eviction="lru")


@pytest.mark.parametrize("bad, message", [
    ({"policy": []}, "policy must be a name"), ({"policy": {}}, "policy must be a name"),
    ({"budget": 100}, "policy must be a name"), ({"policy": "sink", 3: 4}, "options are named by strings"),
    ({"policy": "sink", "sinks": 1e400}, "sinks must be a whole number"),
    ({"policy": "sink", "sinks": float("nan")}, "sinks must be a whole number"),
    ({"policy": "sink", "window": 4.0}, "window must be a whole number"),
    ({"policy": "sink", "window": True}, "window must be a whole number"),
    ({"policy": "h2o", "budget": 10**40}, "budget must be a whole number"),
    ({"policy": "h2o", "budget": [512]}, "budget must be a whole number"),
    ({"policy": "h2o", "score": 3}, "score must be a string"),
    ("sink:window=4.0", "window must be a whole number"), ("snapkv:budget=1e400", "budget must be a whole number"),
    ("h2o:budget=99999999999999999999", "budget must be a whole number"),
])
def test_bad_option_values_are_value_errors_naming_them(bad, message):
    with pytest.raises(ValueError, match=message) as err:
        parse_eviction(bad)
    assert "h2o:budget=512,recent=64" in str(err.value)
    with pytest.raises(ValueError, match=message):
        SamplingParams(eviction=bad)


def test_option_values_may_be_ints_or_strings_of_digits():
    assert parse_eviction({"policy": "sink", "sinks": "8", "window": 64}) == Sink(8, 64)
    assert parse_eviction("h2o: budget = 100 , score = sum ") == H2O(100, 64, "sum")
    assert parse_eviction({"policy": "none"}) is None


@pytest.mark.parametrize("policy", ["sink:sinks=4,window=200", "h2o:budget=200,recent=8", "snapkv:budget=200,window=8"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_a_budget_past_the_length_changes_nothing(ckpt, policy, kv_cache_dtype):
    prompts = [{"prompt_token_ids": ids(n, n)} for n in (5, 17, 40)]
    full = LLM(str(ckpt), block_size=4, num_kv_blocks=64, kv_cache_dtype=kv_cache_dtype)
    want = [o.outputs[0].token_ids for o in full.generate(prompts, GREEDY, use_tqdm=False)]
    llm = LLM(str(ckpt), block_size=4, num_kv_blocks=64, kv_cache_dtype=kv_cache_dtype, eviction=policy)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == want
    assert llm.stats()["num_evicted_tokens"] == 0


@pytest.mark.parametrize("n", [13, 16, 17, 19, 20, 27])
def test_whole_blocks_evict_a_multiple_of_the_block_size(n):
    """With whole_blocks (a model with sliding windows), h2o and snapkv keep between budget and budget + a block - 1
    tokens, so that whole blocks' worth go, always with their recent tokens; nothing while less than a block's worth
    is over budget."""
    scores = torch.rand(n, generator=torch.Generator().manual_seed(n))
    for policy, recent in [(H2O(12, 8), 8), (SnapKV(12, 8), 8)]:
        keep = policy.keep(scores, 4, whole_blocks=True)
        if n < 16:
            assert keep is None
            continue
        assert (n - len(keep)) % 4 == 0 and 12 <= len(keep) < 16
        assert keep.tolist() == sorted(set(keep.tolist())) and keep[-recent:].tolist() == list(range(n - recent, n))
        assert len(policy.keep(scores, 4)) == 12       # without: the budget exactly


@pytest.mark.parametrize("cap", [None, 0.5])
@pytest.mark.parametrize("reduce", ["sum", "max"])
@pytest.mark.parametrize("kv_heads, group", [(1, 4), (2, 2), (3, 1)])
def test_attention_mass_is_the_textbook_softmax_reduced(monkeypatch, reduce, kv_heads, group, cap):
    """The layer's own probabilities: its scores soft-capped where it caps them (Gemma 2)."""
    monkeypatch.setattr(mass, "Q_CHUNK", 3)        # several query chunks, merged as the reduction says
    bs, d, ctx, count = 4, 8, 11, 7
    g = torch.Generator().manual_seed(0)
    kv_cache = torch.randn(2, kv_heads, 6, bs, d, generator=g)
    table = torch.tensor([[5, 0, 3]])
    q = torch.randn(2 + count, kv_heads * group, d, generator=g)     # two other rows' tokens come first
    batch = SimpleNamespace(mass_requests=[(1, 2, count, reduce)], context_lens_list=[3, ctx],
                            block_tables=torch.tensor([[1, 2, 4], *table.tolist()]), mass={})
    mass.accumulate_attention_mass(q, FullPages(kv_cache), batch, scale=0.3, logits_soft_cap=cap)
    keys = kv_cache[0][:, table[0]].flatten(1, 2)[:, :ctx]                         # [KVH, ctx, D]
    queries = q[2:].view(count, kv_heads, group, d)
    scores = torch.einsum("nhgd,hld->hgnl", queries, keys) * 0.3
    if cap is not None:
        scores = cap * torch.tanh(scores / cap)
    causal = torch.arange(ctx)[None, :] > torch.arange(ctx - count, ctx)[:, None]
    probs = scores.masked_fill(causal, float("-inf")).softmax(-1)                   # [KVH, G, n, ctx]
    want = probs.sum((1, 2)) if reduce == "sum" else probs.amax((1, 2))
    (got,) = batch.mass[1]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunk", [1, 5])
def test_sink_attends_to_the_kept_tokens_at_positions_within_the_cache(one_layer, chunk):
    """Past the window, the next-token distribution equals transformers' on the kept tokens alone
    (sink block + window blocks), numbered 0.. as StreamingLLM does."""
    prompt = ids(50)
    llm = LLM(str(one_layer), block_size=4, num_kv_blocks=32, long_prefill_token_threshold=chunk,
              eviction="sink:sinks=4,window=8", max_model_len=64)
    engine = llm.engine
    engine.add_request("r", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, temperature=0, logprobs=5))
    seq = engine.requests["r"][0]
    while engine.has_unfinished_requests():
        evicted = seq.num_evicted_tokens      # what the cache held when the last step attended
        (result,) = engine.step() or [None]
    out = result.outputs[0]
    assert evicted > 0
    kept = prompt[:4] + prompt[4 + evicted:]
    assert 8 <= len(kept) - 4 <= 8 + 2 * 4 + chunk
    with torch.inference_mode():
        ref = hf_model(one_layer)(torch.tensor([kept])).logits[0, -1].log_softmax(-1)
    assert out.token_ids == [int(ref.argmax())]
    for token, lp in out.logprobs[0].items():
        assert lp.logprob == pytest.approx(float(ref[token]), abs=1e-4)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int4"])
def test_sink_generates_past_max_model_len_at_constant_memory(one_layer, kv_cache_dtype):
    llm = LLM(str(one_layer), block_size=4, num_kv_blocks=12, max_model_len=64,
              kv_cache_dtype=kv_cache_dtype, eviction="sink:sinks=4,window=16")
    engine = llm.engine
    engine.add_request("long", {"prompt_token_ids": ids(10)}, SamplingParams(max_tokens=300, ignore_eos=True))
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, engine.kv.num_blocks - engine.kv.num_free_blocks)
    assert peak <= Sink(4, 16).max_cache_tokens(4) // 4 + 1     # + the pinned original sink block
    assert llm.stats()["num_evicted_tokens"] > 250
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


@pytest.mark.parametrize("policy, bound", [("h2o:budget=24,recent=8", 24 + 4), ("snapkv:budget=24,window=8", None)])
def test_scored_policies_hold_the_budget(ckpt, policy, bound):
    llm = LLM(str(ckpt), block_size=4, num_kv_blocks=64, eviction=policy)
    engine = llm.engine
    engine.add_request("r", {"prompt_token_ids": ids(60)}, SamplingParams(max_tokens=40, ignore_eos=True))
    seq = engine.requests["r"][0]
    sizes = []
    while engine.has_unfinished_requests():
        engine.step()
        if not seq.is_finished:
            sizes.append(seq.num_tokens_in_cache)
            assert len(engine.kv.block_tables[seq.seq_id]) == -(-seq.num_tokens_in_cache // 4)
    if bound is None:                       # snapkv: the prompt is cut to the budget, then decoding grows it
        assert sizes[0] == 24 and sizes[-1] == 24 + len(sizes) - 1
    else:
        assert max(sizes) < bound
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_per_request_policy_overrides_the_default(ckpt):
    llm = LLM(str(ckpt), block_size=4, num_kv_blocks=64, eviction="sink:sinks=4,window=8")
    params = [SamplingParams(max_tokens=4, ignore_eos=True, eviction="none"),
              SamplingParams(max_tokens=4, ignore_eos=True)]
    llm.generate([{"prompt_token_ids": ids(40)}] * 2, params, use_tqdm=False)
    # the second request only: of its last 43 cached tokens, blocks 1..7 (tokens 4..31) left the window
    assert llm.stats()["num_evicted_tokens"] == 28


def test_eviction_needs_a_paged_cache(ckpt):
    with pytest.raises(ValueError, match="eviction needs cache_mode 'paged'"):
        LLM(str(ckpt), cache_mode="contiguous", eviction="sink")


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(policy=st.sampled_from(["sink:sinks=2,window=6", "sink:sinks=0,window=9", "h2o:budget=10,recent=3",
                               "h2o:budget=10,recent=3,score=sum",
                               "snapkv:budget=12,window=4"]),
       lens=st.lists(st.integers(1, 40), min_size=1, max_size=5),
       max_tokens=st.integers(1, 30), block_size=st.integers(2, 6), spare=st.integers(0, 12),
       chunk=st.integers(1, 20), n=st.integers(1, 2), kv_cache_dtype=st.sampled_from(["auto", "int8", "int4"]),
       prefix=st.booleans())
def test_no_block_is_leaked_or_freed_twice(ckpt, policy, lens, max_tokens, block_size, spare, chunk, n,
                                          kv_cache_dtype, prefix):
    """Whatever the policy, pool, chunking, forks and preemptions: every request completes with its
    tokens, and the pool gets every block back (BlockPool raises on a double free)."""
    blocks = -(-(8 + max(lens) + max_tokens) // block_size) + 2 + spare
    llm = LLM(str(ckpt), block_size=block_size, num_kv_blocks=blocks, long_prefill_token_threshold=chunk,
              eviction=policy, kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=prefix, max_num_seqs=4)
    head = ids(8, 99)          # a shared prefix, for prefix hits
    prompts = [{"prompt_token_ids": head + ids(k, k)} for k in lens]
    outs = llm.generate(prompts, SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=True, seed=1), use_tqdm=False)
    assert all(len(c.token_ids) == max_tokens for o in outs for c in o.outputs)
    stats = llm.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and stats["num_running"] == 0
    assert not llm.engine.kv.block_tables and not llm.engine.kv.pinned
