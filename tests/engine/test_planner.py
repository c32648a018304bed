"""kvserve plan: the KV cache formula, the engine's own block count and bytes a request holds, the
sink+window row at the same length mix, and clear errors."""
from __future__ import annotations

import json
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve import LLM, SamplingParams
from kvserve.cli import main
from kvserve.kv.spec import KVSpec
from kvserve.planner import MODELS, _paged_bytes_per_user, num_blocks, plan, weight_bytes, load_model_config
from tiny_models import HYBRID

KV_DTYPES = ["auto", "int8", "fp8", "int4"]


@pytest.fixture(scope="module")
def ckpt(checkpoint):
    return checkpoint("llama")


def test_the_formula_on_a_published_model(tmp_path):
    """4096 tokens, 32 layers, 8 KV heads, head_dim 128, fp16: 0.5 GiB per request."""
    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
           "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
           "vocab_size": 128256}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    result = plan(str(tmp_path / "config.json"), 80 * 2**30, 4096, dtype="float16")
    assert result.kv_bytes_per_token == 32 * 2 * 8 * 128 * 2
    assert result.kv_bytes_per_request == 536870912 == 2**29
    assert result.max_users["contiguous"] == result.kv_memory // 2**29


def test_weight_bytes_match_the_published_size():
    _, cfg = load_model_config("llama-3.1-8b")
    assert weight_bytes(cfg, 1) == 8_030_261_248          # Llama 3.1 8B's parameter count


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("budget", ["3MiB", "7.5MiB"])
def test_planner_blocks_equal_the_engines(ckpt, kv_dtype, budget):
    llm = LLM(str(ckpt), kv_cache_memory=budget, block_size=16, dtype="float32", kv_cache_dtype=kv_dtype)
    assert num_blocks(str(ckpt), budget, 16, "float32", kv_dtype) == llm.stats()["kv_blocks_total"]


@pytest.mark.parametrize("kv_dtype, skip", [("auto", ()), ("int8", ()), ("int8", (1, 2)), ("int4", (0,))])
def test_planner_blocks_equal_the_hybrid_engines(checkpoint, kv_dtype, skip):
    """A tiny Gemma 3 (two sliding layers, one global: three layer groups of one layer), some layers kept in the
    model's dtype: the planner's blocks for a budget are the hybrid pool's, and each group's bytes per token are
    a pool block's."""
    path = checkpoint(**HYBRID["gemma3"])
    budget = 3 * 2**20 + 5
    llm = LLM(str(path), kv_cache_memory=budget, block_size=4, dtype="float32", kv_cache_dtype=kv_dtype,
              kv_cache_dtype_skip_layers=skip)
    engine = llm.engine
    assert len(engine.kv.layer_groups) == 3
    assert num_blocks(str(path), budget, 4, "float32", kv_dtype, kv_dtype_skip_layers=skip) \
        == llm.stats()["kv_blocks_total"]
    groups = plan(str(path), 2**30, engine.max_model_len, dtype="float32", block_size=4, kv_dtype=kv_dtype,
                  kv_dtype_skip_layers=skip).kv_groups
    assert [g["bytes_per_token"] * 4 for g in groups] == [engine.kv_spec.bytes_per_block] * 3
    assert [g["full_precision_layers"] for g in groups] == [1 if skip or kv_dtype == "auto" else 0] * 3


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_planner_bytes_per_request_are_what_the_engine_holds(ckpt, kv_dtype):
    """A request holding T tokens holds KVSpec.bytes_held(T) in the engine (its blocks); over a block's fill
    levels, their mean is the planner's figure."""
    llm = LLM(str(ckpt), num_kv_blocks=64, block_size=16, dtype="float32", kv_cache_dtype=kv_dtype)
    engine, spec = llm.engine, llm.engine.kv_spec
    seq = engine.add_request("r", {"prompt_token_ids": list(range(3, 21))},
                             SamplingParams(max_tokens=31, ignore_eos=True))
    held = {}
    while engine.has_unfinished_requests():
        engine.step()
        if not seq.is_finished:
            held[seq.num_computed_tokens] = engine.kv_bytes_in_use()
    assert sorted(held) == list(range(18, 48))
    assert all(held[t] == spec.bytes_held(t) for t in held)
    cycle = range(32, 48)                                  # every fill level of the third block
    mean = statistics.fmean(held[t] for t in cycle)
    assert _paged_bytes_per_user(spec, statistics.fmean(cycle), 1) == pytest.approx(mean, rel=1e-12)


def test_quantized_pages_fit_more_users():
    users = plan("llama-3.1-8b", 80 * 2**30, 8192).max_users
    assert users["paged"] < users["paged_fp8"] < users["paged_int4"]
    assert 1.8 < users["paged_int8"] / users["paged"] < 2 and users["paged_int4"] / users["paged"] > 2.5
    int4 = plan("llama-3.1-8b", 80 * 2**30, 8192, kv_dtype="int4")
    assert int4.max_users["paged"] == users["paged_int4"] and int4.kv_bytes_per_token < 131072 / 3


def test_paging_beats_a_max_length_reservation():
    result = plan("llama-3.1-8b", 80 * 2**30, 8192)
    assert result.max_users["paged"] > 4 * result.max_users["contiguous"] > 0
    assert result.max_users["sink_window"] > result.max_users["contiguous"]


@pytest.mark.parametrize("kwargs, message", [
    (dict(model="gpt-5", memory=80 * 2**30, context=4096), "unknown model 'gpt-5'"),
    (dict(model="llama-3.1-70b", memory=80 * 2**30, context=4096), "try --tensor-parallel 2"),
    (dict(model="llama-3.1-8b", memory=80 * 2**30, context=0), "context must be at least 1"),
])
def test_bad_inputs_say_what_would_fit(kwargs, message):
    with pytest.raises(ValueError, match=message):
        plan(**kwargs)


def test_plan_cli(tmp_path, capsys):
    out, png = tmp_path / "plan.json", tmp_path / "plan.png"
    assert main(["plan", "--model", "qwen2.5-7b", "--gpu", "h100", "--context", "8192", "--json", str(out),
                 "--plot", str(png)]) == 0
    report = json.loads(out.read_text())
    assert {"weight_bytes", "kv_bytes_per_token", "kv_bytes_per_request", "max_users"} <= set(report)
    assert report["kv_bytes_per_token"] == 28 * 2 * 4 * 128 * 2 and png.stat().st_size > 0
    assert "KV bytes per token = 28 layers x 2 (K, V) x 4 kv_heads x 128 head_dim x 2 bytes" in capsys.readouterr().out
    assert set(MODELS) >= {"llama-3.1-8b", "mistral-7b", "qwen3-8b"}


def test_sink_window_counts_requests_at_the_length_mix():
    """Each request holds min(its tokens, the sink+window cache): at the same mix as paged, never fewer
    users than paged; every request at the full context is shown beside it."""
    result = plan("llama-3.1-8b", 80 * 2**30, 8192)
    mix, full = result.max_users, result.max_users_at_full_context
    assert mix["sink_window"] > mix["paged"] > full["paged"] == full["contiguous"] == mix["contiguous"]
    assert full["sink_window"] > 4 * full["paged"]
    spec = KVSpec.from_model(load_model_config("llama-3.1-8b")[1], torch.bfloat16)
    assert full["paged"] == result.kv_memory // spec.bytes_held(8192)
    # a window past every request's length evicts nothing: the same users as paged
    assert plan("llama-3.1-8b", 80 * 2**30, 8192, window=9000).max_users["sink_window"] == mix["paged"]


@settings(max_examples=60, deadline=None)
@given(context=st.integers(1, 200_000), window=st.integers(1, 16_384), sinks=st.integers(0, 64),
       block_size=st.sampled_from([1, 8, 16, 64]), kv_dtype=st.sampled_from(KV_DTYPES),
       avg=st.one_of(st.none(), st.tuples(st.floats(1, 50_000), st.floats(1, 50_000))))
def test_eviction_never_shows_fewer_users_than_no_eviction(context, window, sinks, block_size, kv_dtype, avg):
    if kv_dtype == "int4" and block_size == 1:
        block_size = 8                  # int4 needs a block's pages to hold whole bf16 numbers
    prompt, output = avg or (None, None)
    result = plan("llama-3.1-8b", 80 * 2**30, context, block_size=block_size, sinks=sinks, window=window,
                  kv_dtype=kv_dtype, avg_prompt=prompt, avg_output=output)
    assert result.mean_tokens_held_sink_window <= result.mean_tokens_held
    for users in (result.max_users, result.max_users_at_full_context):
        assert users["sink_window"] >= users["paged"]


@pytest.mark.parametrize("name", ["bfloat16", "bf16", "float16", "fp16"])
def test_kv_dtype_may_name_the_models_dtype(ckpt, name, capsys):
    """As vLLM's --kv-cache-dtype bfloat16: full-precision pages named by their dtype, which must be the
    model's (pages hold the model's numbers); the same users as auto."""
    dtype = "bfloat16" if name.startswith("b") else "float16"
    assert plan("llama-3.1-8b", 80 * 2**30, 8192, dtype=dtype, kv_dtype=name) == \
        plan("llama-3.1-8b", 80 * 2**30, 8192, dtype=dtype)
    assert main(["plan", "--model", "llama-3.1-8b", "--gpu", "h100", "--dtype", dtype, "--kv-dtype", name]) == 0
    assert "paged, auto pages" in capsys.readouterr().out
    other = "float16" if dtype == "bfloat16" else "bfloat16"
    with pytest.raises(ValueError, match=rf"kv_cache_dtype '{name}' asks for {dtype} pages, but .* \({other}\)"):
        plan("llama-3.1-8b", 80 * 2**30, 8192, dtype=other, kv_dtype=name)
    assert LLM(str(ckpt), dtype=dtype, kv_cache_dtype=name, num_kv_blocks=8).stats()["kv_cache_dtype"] == "auto"
    with pytest.raises(ValueError, match=f"kv_cache_dtype '{name}'"):
        LLM(str(ckpt), dtype="float32", kv_cache_dtype=name, num_kv_blocks=8)


def test_hybrid_models_are_planned_per_layer_group(tmp_path, capsys):
    """Gemma 3 1B at 8k: one full-attention group of 4 layers, six sliding groups (window 512) of up to 4; a
    request holds its whole context in the first only, so that several times more requests fit than with one
    table for all layers. The formula is printed per group."""
    result = plan("gemma3-1b", 24 * 2**30, 8192)
    groups = result.kv_groups
    assert [g["sliding_window"] for g in groups] == [None] + [512] * 6
    assert [g["num_layers"] for g in groups] == [4] * 6 + [2] and {g["padded_layers"] for g in groups} == {4}
    assert {g["bytes_per_token"] for g in groups} == {4 * 2 * 1 * 256 * 2}
    assert groups[0]["bytes_at_full_context"] == 8192 * 4096 and groups[1]["bytes_at_full_context"] == 33 * 16 * 4096
    assert result.max_users_at_full_context["hybrid"] == result.kv_memory // (8192 * 4096 + 6 * 33 * 16 * 4096)
    assert result.max_users_at_full_context["hybrid"] > 4 * result.max_users_at_full_context["paged"]
    assert result.max_users["hybrid"] > result.max_users["paged"]
    assert "hybrid" not in plan("llama-3.1-8b", 80 * 2**30, 8192).max_users
    assert main(["plan", "--model", "gemma3-1b", "--gpu", "l4", "--context", "8192"]) == 0
    out = capsys.readouterr().out
    assert "layer group (window 512, 2 layers, pages of 4 per block): 4 x 2 x 1 x 256 x 2 bytes = 4,096 bytes" in out
    assert "paged per layer group" in out
    # layer 0 (sliding) and 5 (global) kept in bfloat16: a block holds one bfloat16 layer's pages and four int8 ones
    assert main(["plan", "--model", "gemma3-1b", "--gpu", "l4", "--context", "8192", "--kv-dtype", "int8",
                 "--kv-dtype-skip-layers", "0,5"]) == 0
    out = capsys.readouterr().out
    assert "layer group (full attention, 4 layers, pages of 5 per block): 1 x 2 x 1 x 256 x 2 bytes + " \
           "4 x 2 x 1 x 256 x 1.008 bytes (int8 with its scales) = 3,088 bytes per token" in out


def test_hybrid_full_context_bytes_are_what_the_engine_holds(checkpoint):
    """A tiny Gemma 3 (window 8, blocks of 4): at its length, a request holds in each sliding group at most the
    planner's bytes at full context, and exactly that at some step; in the full group, all its blocks."""
    path = checkpoint(**HYBRID["gemma3"])
    llm = LLM(str(path), num_kv_blocks=64, block_size=4, dtype="float32")
    engine = llm.engine
    seq = engine.add_request("r", {"prompt_token_ids": list(range(3, 13))},
                             SamplingParams(max_tokens=20, ignore_eos=True))
    peaks, length = [0, 0, 0], 0
    while engine.has_unfinished_requests():
        engine.step()
        if not seq.is_finished:
            peaks = [max(p, g["blocks_in_use"]) for p, g in zip(peaks, engine.stats()["kv_groups"])]
            length = seq.num_computed_tokens
    bytes_per_block = engine.kv_spec.bytes_per_block
    groups = plan(str(path), 2**30, length, dtype="float32", block_size=4).kv_groups
    assert [p * bytes_per_block for p in peaks] == [g["bytes_at_full_context"] for g in groups]


@pytest.mark.parametrize("kv_dtype", ["auto", "int4"])
def test_page_summaries_count_in_the_plan_as_in_the_engine(ckpt, kv_dtype, capsys):
    """With sparse attention a block also holds its keys' summaries: the planner's blocks for a budget are the
    engine's pool, its bytes per token the engine's, and `kvserve plan --sparse-attention` shows their share."""
    budget, spec = "3MiB", "quest:budget=64,recent=16,sinks=16"
    llm = LLM(str(ckpt), kv_cache_memory=budget, block_size=16, dtype="float32", kv_cache_dtype=kv_dtype,
              sparse_attention=spec)
    stats = llm.stats()
    assert num_blocks(str(ckpt), budget, 16, "float32", kv_dtype, summaries=True) == stats["kv_blocks_total"]
    assert num_blocks(str(ckpt), budget, 16, "float32", kv_dtype) > stats["kv_blocks_total"]
    planned = plan(str(ckpt), 2**30, 256, dtype="float32", kv_dtype=kv_dtype, sparse_attention=spec)
    assert planned.kv_bytes_per_token == stats["kv_bytes_per_token"]
    assert stats["kv_cache_bytes"] == stats["kv_blocks_total"] * llm.engine.kv_spec.bytes_per_block
    assert main(["plan", "--model", str(ckpt), "--gpu", "h100", "--sparse-attention", spec]) == 0
    assert "+ page summaries 2 layers x 2 (min, max)" in capsys.readouterr().out
