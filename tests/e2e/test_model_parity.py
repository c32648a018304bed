"""Every architecture and switch against Hugging Face transformers on the same weights."""
from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from tiny_models import hf_model

VARIANTS = {
    "llama-gqa2": ("llama", {}),
    "llama-mha": ("llama", dict(num_key_value_heads=4)),
    "llama-gqa4": ("llama", dict(num_attention_heads=8, num_key_value_heads=2, hidden_size=128)),
    "llama-gqa8": ("llama", dict(num_attention_heads=8, num_key_value_heads=1, hidden_size=128)),
    "llama-head-dim": ("llama", dict(head_dim=32)),
    "llama-bias": ("llama", dict(attention_bias=True, mlp_bias=True)),
    "llama-tied": ("llama", dict(tie_word_embeddings=True)),
    "llama-theta": ("llama", dict(rope_theta=500000.0)),
    "llama-rope-linear": ("llama", dict(rope_scaling={"rope_type": "linear", "factor": 4.0})),
    "llama-rope-llama3": ("llama", dict(rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})),
    "mistral": ("mistral", dict(sliding_window=None)),
    "qwen2": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen3": ("qwen3", dict(head_dim=32)),
    # sliding windows of 8 tokens: the longer prompts and their 12 new tokens outgrow them
    "mistral-window": ("mistral", dict(sliding_window=8)),
    "qwen2-window": ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)),
    # caps low enough to change the scores and logits of these weights
    "gemma2": ("gemma2", dict(sliding_window=8, head_dim=16, query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                              final_logit_softcapping=5.0)),
    "gemma3": ("gemma3", dict(sliding_window=8, head_dim=16, sliding_window_pattern=2)),
    "phi3": ("phi3", dict(sliding_window=8)),
    "phi3-longrope": ("phi3", dict(original_max_position_embeddings=512, partial_rotary_factor=0.5, rope_scaling={
        "rope_type": "longrope", "factor": 4.0, "short_factor": [1.0, 1.5, 2.0, 3.0], "long_factor": [2.0] * 4})),
}
PROMPT_LENS = [1, 3, 4, 5, 13]   # block_size 4: 1, bs-1, bs, bs+1, several blocks


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, checkpoint):
    arch, overrides = VARIANTS[request.param]
    return checkpoint(arch, **overrides)


def capture_logits(llm: LLM) -> list[torch.Tensor]:
    """Record the logits the engine samples from, step by step."""
    runner, seen = llm.engine.runner, []
    run = runner.run

    def recording_run(sched):
        out = run(sched)
        if out.tokens is None:      # (several steps at once return their tokens only)
            seen.append(out.logits.clone())
        return out

    runner.run = recording_run
    return seen


def prompt_ids(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed + n)
    return torch.randint(3, 384, (n,), generator=g).tolist()


def test_prefill_logits_match_transformers(variant):
    """Logits of every prompt position, computed through the paged cache, equal transformers'."""
    llm = LLM(str(variant), block_size=4, num_kv_blocks=64, dtype="float32")
    engine = llm.engine
    hf = hf_model(variant)
    for n in PROMPT_LENS:
        ids = prompt_ids(n)
        engine.add_request(f"p{n}", {"prompt_token_ids": ids}, SamplingParams(max_tokens=1))
        inputs = engine.runner.prepare(engine.scheduler.schedule())
        with torch.inference_mode():
            hidden = engine.model(inputs.input_ids, inputs.positions, inputs.batch, engine.runner.backend,
                                  engine.runner.storage)
            ours = engine.model.compute_logits(hidden)
            ref = hf(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
        engine.abort_request(f"p{n}")


@pytest.mark.parametrize("decode", ["native", "native-steps", "eager"])
def test_decode_logits_and_greedy_tokens_match_transformers(variant, decode):
    """Decode steps by the native C step (the CPU's default), several in one call (an offline greedy batch's,
    whose logits stay inside: tokens only), and op by op."""
    steps = 8 if decode == "native-steps" else 1
    llm = LLM(str(variant), block_size=4, num_kv_blocks=64, dtype="float32", enforce_eager=decode == "eager",
              num_scheduler_steps=steps)
    # every family in the C step: Gemma's layers, partial RoPE, a hybrid cache's block tables (qwen2-window's)
    native = decode != "eager"
    hf = hf_model(variant)
    for n in PROMPT_LENS:
        ids = prompt_ids(n, seed=1)
        seen = capture_logits(llm)
        out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]
        del llm.engine.runner.run
        with torch.inference_mode():
            ref_tokens = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                                     eos_token_id=None, pad_token_id=2)[0, n:].tolist()
            ref_logits = hf(torch.tensor([ids + out.token_ids])).logits[0, n - 1:-1]
        assert out.token_ids == ref_tokens
        # steps one at a time return every logit; with 8 at a time, the 11 decode steps run as 8 and 3 in two
        # calls, and only the prefill's come back
        torch.testing.assert_close(torch.cat(seen), ref_logits[:len(seen)], atol=1e-4, rtol=1e-4)
        assert len(seen) == (1 if native and steps > 1 else 12)
    if native:
        assert llm.engine.runner.native.steps == 11 * len(PROMPT_LENS)
    else:
        assert llm.engine.runner.native is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_tracks_transformers(checkpoint, dtype):
    """Against the float32 forward of the same weights, kvserve's error is no larger than transformers'
    own in that dtype (half again as large at most: the roundings fall elsewhere)."""
    path = checkpoint("llama", dtype=dtype)
    name = "bfloat16" if dtype == torch.bfloat16 else "float16"
    llm = LLM(str(path), block_size=4, num_kv_blocks=64, dtype=name)
    assert llm.engine.model.lm_head.weight.dtype == dtype
    ids = prompt_ids(13)
    seen = capture_logits(llm)
    llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    with torch.inference_mode():
        exact = hf_model(path, torch.float32)(torch.tensor([ids])).logits[0, -1]
        ref = hf_model(path, dtype)(torch.tensor([ids])).logits[0, -1].float()
    ours, theirs = (seen[0][0].float() - exact).abs(), (ref - exact).abs()
    assert ours.max() <= 1.5 * theirs.max() and ours.mean() <= 1.5 * theirs.mean()
    torch.testing.assert_close(seen[0][0].float(), ref, atol=0.2, rtol=0.05)


def test_auto_dtype(checkpoint):
    """auto takes the checkpoint's dtype, except float16 on the CPU, which runs in float32."""
    bf16 = checkpoint("llama", dtype=torch.bfloat16)
    fp16 = checkpoint("llama", dtype=torch.float16)
    assert LLM(str(bf16), num_kv_blocks=8).engine.dtype == torch.bfloat16
    assert LLM(str(fp16), num_kv_blocks=8).engine.dtype == torch.float32
