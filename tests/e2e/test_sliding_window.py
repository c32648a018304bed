"""Sliding-window and hybrid models end to end: each family against transformers with prompts and generations
longer than the window, batched with other lengths and with prompt chunks that cut across the window, in every
attention backend; their config.json fields; eviction beside windows; max_model_len."""
from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.config import ModelConfig
from tiny_models import hf_model

WINDOW = 8
FAMILIES = {
    "mistral": ("mistral", dict(sliding_window=WINDOW)),
    "qwen2": ("qwen2", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
    # caps low enough to change the scores and logits of these weights
    "gemma2": ("gemma2", dict(sliding_window=WINDOW, head_dim=16, query_pre_attn_scalar=24,
                              attn_logit_softcapping=2.0, final_logit_softcapping=5.0)),
    "gemma3": ("gemma3", dict(sliding_window=WINDOW, head_dim=16, sliding_window_pattern=2)),
    "phi3": ("phi3", dict(sliding_window=WINDOW)),
}
PROMPT_LENS = [40, 17, 5]
MAX_TOKENS = 10
# prompt chunks of 12 tokens: their ends (12, 24, 36) fall inside windows and blocks of 4, not on their edges
CHUNKED = dict(block_size=4, num_kv_blocks=128, dtype="float32", long_prefill_token_threshold=12,
               num_scheduler_steps=1)


def prompt(n: int) -> list[int]:
    return torch.randint(3, 384, (n,), generator=torch.Generator().manual_seed(n)).tolist()


def reference(path, prompts: list[list[int]], max_tokens: int = MAX_TOKENS):
    """transformers' greedy tokens of each prompt and the logits they were chosen from."""
    hf = hf_model(path)
    refs = []
    with torch.inference_mode():
        for ids in prompts:
            tokens = hf.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                                 pad_token_id=2)[0, len(ids):].tolist()
            refs.append((tokens, hf(torch.tensor([ids + tokens])).logits[0, len(ids) - 1:-1]))
    return refs


def generate(llm: LLM, prompts: list[list[int]], max_tokens: int = MAX_TOKENS):
    """Each prompt's greedy tokens and the logits of every step that sampled them, all prompts in one batch."""
    runner, seen = llm.engine.runner, defaultdict(list)
    run = runner.run

    def recording_run(sched):
        out = run(sched)
        for row, logits in zip(out.sample_rows, out.logits):
            seen[sched.seqs[row].request_id].append(logits.clone())
        return out

    runner.run = recording_run
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), use_tqdm=False)
    finally:
        del runner.run
    return [(o.outputs[0].token_ids, torch.stack(seen[o.request_id])) for o in outs]


def assert_matches(ours, refs) -> None:
    for (tokens, logits), (ref_tokens, ref_logits) in zip(ours, refs):
        assert tokens == ref_tokens
        torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, checkpoint):
    arch, overrides = FAMILIES[request.param]
    path = checkpoint(arch, **overrides)
    prompts = [prompt(n) for n in PROMPT_LENS]
    return path, prompts, reference(path, prompts)


@pytest.mark.parametrize("backend", ["native", "sdpa", "flash", "textbook"])
def test_family_matches_transformers_past_its_window(family, backend):
    """Prompts of 40, 17 and 5 tokens and 10 new ones (a window of 8), batched, the long prompt in chunks of 12,
    decodes beside chunks: greedy tokens equal and every logit within 1e-4. Each sliding layer group keeps only
    its window's blocks (kv/groups.py). With the native backend, every family's decode steps run in the C step
    (over each layer's window, and each layer group's block table: Qwen2's mix of full and sliding layers has
    two, Gemma's too), Gemma's soft caps, norms, GeGLU and Gemma 3's RoPE table of the sliding layers included."""
    path, prompts, refs = family
    llm = LLM(str(path), attention_backend=backend, **CHUNKED)
    assert llm.engine.max_model_len == 512           # the model's context, not its window
    assert_matches(generate(llm, prompts), refs)
    assert any(g.sliding_window == WINDOW for g in llm.engine.kv.layer_groups)
    native = llm.engine.runner.native
    if backend == "native":
        assert native.steps > 0 and llm.stats()["steps"]["native"] == native.steps
    else:
        assert native is None


@pytest.mark.parametrize("arch", ["qwen2", "gemma2", "gemma3"])
def test_native_multi_step_decodes_every_layer_group(checkpoint, arch):
    """Greedy decodes of a hybrid cache (a full-attention and a sliding layer group) several steps a C call, each
    layer's K/V at the next slot of its group's table: transformers' tokens for 24 new ones past a window of 8,
    batched with other lengths, and every block back in the pool at the end (the null block aside)."""
    path = checkpoint(FAMILIES[arch][0], **FAMILIES[arch][1])
    prompts = [prompt(n) for n in PROMPT_LENS]
    refs = reference(path, prompts, 24)
    llm = LLM(str(path), block_size=4, num_kv_blocks=128, dtype="float32", num_scheduler_steps=8)
    assert len(llm.engine.kv.layer_groups) > 1
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [tokens for tokens, _ in refs]
    stats = llm.stats()
    assert stats["steps"]["native_multi_step"] >= 16 and stats["steps"]["eager"] <= 3
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] - 1


@pytest.mark.parametrize("arch", ["gemma3", "gemma2", "mistral"])
def test_prefix_hits_and_samples_past_the_window_match_transformers(checkpoint, arch):
    """A 40-token prompt computed once, then prompts that extend it: each a prefix hit that takes the full
    groups' blocks of the whole prefix but only the sliding groups' last window (their earlier blocks went
    back to the pool), and n=2 greedy samples sharing the blocks (copy-on-write of the last one): transformers'
    tokens and logits, with every sliding group's table no longer than its window while decoding."""
    path = checkpoint(FAMILIES[arch][0], **FAMILIES[arch][1])
    base = prompt(40)
    prompts = [base, base + prompt(5), base[:33]]
    refs = reference(path, prompts)
    llm = LLM(str(path), **CHUNKED)
    ours = [generate(llm, [p])[0] for p in prompts]
    assert_matches(ours, refs)
    stats = llm.stats()
    assert stats["prefix_cache_hits"] >= 40 + 32
    out = llm.generate({"prompt_token_ids": prompts[1]}, SamplingParams(n=2, max_tokens=MAX_TOKENS, temperature=0,
                                                                        ignore_eos=True), use_tqdm=False)[0]
    assert [o.token_ids for o in out.outputs] == [refs[1][0]] * 2
    kv = llm.engine.kv
    assert kv.num_free_blocks == kv.num_blocks - 1 and kv.pool.ref_counts[kv.null_block] == 1


def test_triton_backend_runs_a_hybrid_model(checkpoint):
    """Gemma 2 (windowed and full layers, soft-capped scores) through the Triton kernels end to end."""
    import triton_setup  # noqa: F401  (sets TRITON_INTERPRET where there is no GPU)

    arch, overrides = FAMILIES["gemma2"]
    path = checkpoint(arch, **overrides)
    prompts = [prompt(n) for n in (21, 6)]
    llm = LLM(str(path), attention_backend="triton", **CHUNKED)
    assert_matches(generate(llm, prompts, 6), reference(path, prompts, 6))


@pytest.mark.parametrize("max_model_len, lens", [(None, [40, 35]), (32, [20, 9])], ids=["long", "short"])
def test_phi3_longrope_factors(checkpoint, max_model_len, lens):
    """LongRoPE takes its long factors where max_model_len exceeds the original context (32 here), as
    transformers does for sequences past it, and its short ones otherwise."""
    path = checkpoint("phi3", original_max_position_embeddings=32, rope_scaling={
        "rope_type": "longrope", "short_factor": [1.0 + 0.2 * i for i in range(8)],
        "long_factor": [3.0 + 0.5 * i for i in range(8)]})
    prompts = [prompt(n) for n in lens]
    llm = LLM(str(path), max_model_len=max_model_len, **CHUNKED)
    assert_matches(generate(llm, prompts), reference(path, prompts))


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_bfloat16_tracks_transformers(checkpoint, arch):
    """In bfloat16, kvserve's error against the float32 forward is no larger than transformers' own in bfloat16
    (half again at most): the norms in float32, the embedding scale rounded, as transformers computes them."""
    path = checkpoint(arch, dtype=torch.bfloat16, **FAMILIES[arch][1])
    ids = prompt(30)
    seen = generate(LLM(str(path), block_size=4, num_kv_blocks=64, dtype="bfloat16"), [ids], 1)[0][1][0].float()
    with torch.inference_mode():
        exact = hf_model(path, torch.float32)(torch.tensor([ids])).logits[0, -1]
        ref = hf_model(path, torch.bfloat16)(torch.tensor([ids])).logits[0, -1].float()
    ours, theirs = (seen - exact).abs(), (ref - exact).abs()
    assert ours.max() <= 1.5 * theirs.max() and ours.mean() <= 1.5 * theirs.mean()


def test_sink_eviction_keeps_every_window_whole(checkpoint):
    """A model whose every layer attends within 8 tokens, with one block table for all layers, under `sink` with a
    window of 8: the cache drops the blocks that left the window, and the output is transformers' exactly (no
    layer ever looks past it)."""
    path = checkpoint("mistral", sliding_window=WINDOW)
    prompts = [prompt(40)]
    llm = LLM(str(path), eviction="sink:sinks=4,window=8", disable_hybrid_kv_cache_manager=True, **CHUNKED)
    assert_matches(generate(llm, prompts, 12), reference(path, prompts, 12))
    assert llm.engine.evictor.num_evicted_tokens > 0


@pytest.mark.parametrize("disable", [True, False], ids=["one-table", "hybrid"])
@pytest.mark.parametrize("eviction, option", [("sink:sinks=4,window=4", "sink's window"),
                                              ("h2o:budget=32,recent=7", "h2o's recent"),
                                              ("snapkv:budget=32,window=4", "snapkv's window")])
def test_eviction_that_would_cut_a_window_is_refused(checkpoint, eviction, option, disable):
    """A policy whose recent tokens do not cover the window, per request or for the engine, with either cache: a
    ValueError naming the policy, the window and the option."""
    path = checkpoint("gemma2", **FAMILIES["gemma2"][1])
    llm = LLM(str(path), block_size=4, num_kv_blocks=64, disable_hybrid_kv_cache_manager=disable)
    message = (f"eviction '{eviction.split(':')[0]}.* sliding-window layers \\(window 8\\): {option} \\(\\d\\) "
               f"must be at least 8 tokens")
    with pytest.raises(ValueError, match=message):
        llm.engine.add_request("r", {"prompt_token_ids": prompt(20)}, SamplingParams(max_tokens=4, eviction=eviction))
    assert not llm.engine.requests
    with pytest.raises(ValueError, match=message):
        LLM(str(path), block_size=4, num_kv_blocks=64, disable_hybrid_kv_cache_manager=disable, eviction=eviction)


@pytest.mark.parametrize("disable", [True, False], ids=["one-table", "hybrid"])
@pytest.mark.parametrize("eviction", ["h2o:budget=12,recent=8", "h2o:budget=13,recent=9,score=sum",
                                      "snapkv:budget=12,window=8"])
def test_scored_eviction_keeps_every_window_whole(checkpoint, eviction, disable):
    """A model whose every layer attends within 8 tokens, under h2o or snapkv keeping the last 8 (or 9) tokens, with
    one block table for all layers or the hybrid cache: the cache is compacted well below the prompt, and the output
    is transformers' exactly (each layer still sees its last 8 positions)."""
    path = checkpoint("mistral", sliding_window=WINDOW)
    prompts = [prompt(40), prompt(17)]
    llm = LLM(str(path), eviction=eviction, disable_hybrid_kv_cache_manager=disable, **CHUNKED)
    assert_matches(generate(llm, prompts, 12), reference(path, prompts, 12))
    assert llm.engine.evictor.num_evicted_tokens >= 24
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"] - (not disable)     # the null block


def test_a_window_past_max_model_len_leaves_eviction_free(checkpoint):
    """Phi-3-128k's window (262144) exceeds its context: no cache reaches it, so every policy may run."""
    path = checkpoint("phi3", sliding_window=1024)       # the tiny model's context: 512
    llm = LLM(str(path), block_size=4, num_kv_blocks=64)
    params = SamplingParams(max_tokens=2, eviction="h2o:budget=16,recent=4")
    out = llm.generate({"prompt_token_ids": prompt(20)}, params, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


BASE = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)


def config(arch: str, **fields) -> ModelConfig:
    return ModelConfig.from_dict({"architectures": [arch], **BASE, **fields})


@pytest.mark.parametrize("fields, windows", [
    (dict(sliding_window=16, max_window_layers=2), (None,) * 4),                  # use_sliding_window is off
    (dict(use_sliding_window=True, sliding_window=16, max_window_layers=2), (None, None, 16, 16)),
    (dict(use_sliding_window=True, sliding_window=16, max_window_layers=2,
          layer_types=["sliding_attention", "full_attention"] * 2), (16, None, 16, None)),
], ids=["off", "max_window_layers", "layer_types"])
def test_qwen2_windows(fields, windows):
    assert config("Qwen2ForCausalLM", num_hidden_layers=4, **fields).sliding_windows == windows


def test_gemma_configs_as_the_hub_writes_them():
    """Gemma 2 alternates from a sliding first layer; a Gemma 3 config of transformers 4 (sliding_window_pattern,
    rope_local_base_freq, rope_scaling of the global layers) reads as transformers 5's does."""
    gemma2 = config("Gemma2ForCausalLM", num_hidden_layers=4, sliding_window=4096, hidden_act="gelu")
    assert gemma2.sliding_windows == (4096, None, 4096, None)
    assert gemma2.tie_word_embeddings and gemma2.hidden_act == "gelu_pytorch_tanh" and gemma2.embed_scale == 8.0
    gemma3 = config("Gemma3ForCausalLM", num_hidden_layers=6, sliding_window=512, sliding_window_pattern=3,
                    rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0})
    assert gemma3.sliding_windows == (512, 512, None, 512, 512, None)
    assert (gemma3.rope_theta, gemma3.rope_local_base_freq) == (1e6, 1e4)
    assert gemma3.rope_scaling == {"rope_type": "linear", "factor": 8.0} and gemma3.qk_norm


def test_phi3_su_rope_is_longrope():
    """Phi-3's configs of transformers 4: rope_scaling type "su", the original context at the top level."""
    phi3 = config("Phi3ForCausalLM", num_hidden_layers=2, max_position_embeddings=131072, sliding_window=262144,
                  original_max_position_embeddings=4096, partial_rotary_factor=0.75,
                  rope_scaling={"type": "su", "short_factor": [1.0] * 6, "long_factor": [2.0] * 6})
    assert phi3.rope_scaling["rope_type"] == "longrope" and phi3.rope_scaling["factor"] == 32.0
    assert phi3.rope_scaling["original_max_position_embeddings"] == 4096 and phi3.rotary_dim == 12
    assert phi3.sliding_windows == (262144, 262144)


@pytest.mark.parametrize("fields, message", [
    (dict(sliding_window=8, layer_types=["sliding_attention"]), "layer_types must name 2 layers"),
    (dict(sliding_window=0), "sliding_window must be a positive integer"),
    (dict(hidden_activation="relu"), "unsupported hidden_act 'relu'"),
])
def test_bad_window_fields_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        config("Gemma2ForCausalLM", num_hidden_layers=2, **fields)
