"""The CPU's native decode step (csrc/decode_step.c) against the eager forward, and where it applies."""
from __future__ import annotations

import shutil

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.engine.native_decode import MAX_BATCH
from kvserve.kernels import STRICT_ENV
from kvserve.model import layers

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
VECTOR = layers.vector_kernel(layers.gemm_kernels(torch.float32))      # the build's own tiles
VARIANTS = {
    "llama-gqa2": ("llama", {}),
    "llama-mha-bias": ("llama", dict(num_key_value_heads=4, attention_bias=True, mlp_bias=True)),
    "llama-gqa8-head-dim-80": ("llama", dict(num_attention_heads=8, num_key_value_heads=1, head_dim=80)),
    "qwen3-tied": ("qwen3", dict(head_dim=32, tie_word_embeddings=True)),
    # rows and heads that are not whole vectors of 16: the kernels' masked tails
    "llama-head-dim-24-odd-sizes": ("llama", dict(head_dim=24, hidden_size=72, intermediate_size=100)),
    # a hybrid cache: a full-attention layer group and one sliding (window 4), each with its block tables
    "qwen2-hybrid": ("qwen2", dict(use_sliding_window=True, sliding_window=4, max_window_layers=1,
                                   num_hidden_layers=3)),
    # Gemma 2: caps low enough to change these weights' scores and logits, query_pre_attn_scalar, tied embeddings
    "gemma2-caps-tied": ("gemma2", dict(sliding_window=4, head_dim=16, query_pre_attn_scalar=24,
                                        attn_logit_softcapping=2.0, final_logit_softcapping=5.0,
                                        tie_word_embeddings=True, num_hidden_layers=3)),
    # Gemma 3: q/k norms, the sliding layers' own RoPE base
    "gemma3": ("gemma3", dict(sliding_window=4, head_dim=16, sliding_window_pattern=2, num_hidden_layers=3,
                              rope_local_base_freq=100.0)),
    # Phi-4-mini's partial RoPE (the first half of each head's channels) with LongRoPE's table
    "phi3-partial-longrope": ("phi3", dict(head_dim=16, partial_rotary_factor=0.5, original_max_position_embeddings=16,
                                           rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.5, 2.0, 3.0],
                                                         "long_factor": [2.0] * 4})),
}


def compare_with_eager(llm: LLM) -> list[float]:
    """After each native step, the eager forward of the same inputs (which rewrites the same K/V, so
    that every step starts from the eager model's cache): the largest logit difference of each. The
    engine runs a step at a time (num_scheduler_steps=1), so that each step's logits come back."""
    runner, diffs = llm.engine.runner, []
    run = runner.run

    def checked_run(sched):
        out = run(sched)
        if runner.native.steps > len(diffs):
            inputs = runner.prepare(sched)
            with torch.inference_mode():
                hidden = runner.model(inputs.input_ids, inputs.positions, inputs.batch, runner.backend,
                                      runner.storage)
                eager = runner.model.compute_logits(hidden[inputs.logits_indices])
            diffs.append((out.logits.float() - eager.float()).abs().max().item())
        return out

    runner.run = checked_run
    return diffs


def prompts(lengths: list[int]) -> list[dict]:
    g = torch.Generator().manual_seed(sum(lengths))
    return [{"prompt_token_ids": torch.randint(3, 384, (n,), generator=g).tolist()} for n in lengths]


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype, atol, kernel", [      # AMX multiplies bfloat16 only; VECTOR: avx512 or avx2
    ("float32", 5e-5, VECTOR), ("float32", 5e-5, None),
    ("bfloat16", 0.1, VECTOR), ("bfloat16", 0.1, "amx"), ("bfloat16", 0.1, None),
], ids=["float32-gemm", "float32-matrix-vector", "bfloat16-gemm", "bfloat16-gemm-amx", "bfloat16-matrix-vector"])
def test_native_steps_give_the_eager_logits(checkpoint, monkeypatch, variant, dtype, atol, threads, kernel):
    arch, overrides = VARIANTS[variant]
    gemm = kernel is not None
    if kernel == "amx" and kernel not in layers.gemm_kernels(getattr(torch, dtype)):
        pytest.skip("this CPU has no AMX (or the OS does not grant it)")
    path = checkpoint(arch, dtype=getattr(torch, dtype), **overrides)
    torch.set_num_threads(threads)
    if gemm:            # AMX: at every row count, in the step and op by op
        monkeypatch.setenv("KVSERVE_GEMM", kernel)
    else:               # as on a CPU whose csrc/gemm.c does not multiply the dtype
        monkeypatch.setenv(STRICT_ENV, "0")
        monkeypatch.setattr(layers, "_gemm_function", lambda *args: None)
    # sequences of mixed lengths, crossing blocks of 4 while they decode, in batches of 1 to 4, their
    # layers multiplied by the packed GEMM or by the step's matrix-vector products
    llm = LLM(str(path), block_size=4, num_kv_blocks=64, dtype=dtype, max_num_seqs=4, num_scheduler_steps=1)
    native = llm.engine.runner.native
    assert native.packed == (gemm and layers.gemm_packs(getattr(torch, dtype)))
    native.max_batch = None
    diffs = compare_with_eager(llm)
    params = SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)
    llm.generate(prompts([1, 3, 4, 5, 13, 6]), params, use_tqdm=False)
    assert len(diffs) >= 9 and max(diffs) <= atol
    assert llm.stats()["steps"]["native"] == len(diffs)


def test_bfloat16_rounds_where_the_eager_model_does(checkpoint):
    """Activations kept in float32 between the ops (not rounded where the eager model rounds them) leave
    differences of whole bfloat16 steps at every step (0.09-0.13 here); what is left is the order of the
    sums, which now and then tips a rounding."""
    path = checkpoint("llama", dtype=torch.bfloat16, hidden_size=256, intermediate_size=512)
    llm = LLM(str(path), block_size=4, num_kv_blocks=64, dtype="bfloat16", num_scheduler_steps=1)
    diffs = compare_with_eager(llm)
    llm.generate(prompts([7]), SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)
    assert len(diffs) == 5 and sorted(diffs)[2] <= 0.02 and max(diffs) <= 0.1


# Llama: one layer group; Gemma 3: three (two sliding layers of window 4, one global: a hybrid cache), with its
# q/k norms and the sliding layers' own RoPE base
QUANTIZED_MODELS = {"llama": ("llama", {}),
                    "gemma3-hybrid": ("gemma3", dict(sliding_window=4, head_dim=16, sliding_window_pattern=3,
                                                     num_hidden_layers=3, rope_local_base_freq=100.0))}


def page_rows(storage) -> list[torch.Tensor]:
    """Every layer's pages as bytes, a row for each K or V of a head at a slot [2, KVH, blocks, block_size, bytes]:
    its numbers, then (quantized pages) its scales."""
    rows = []
    for layer in storage.layers:
        if layer.format.quantized:
            bs = layer.shape[3]
            scales = torch.stack([m.view(*m.shape[:2], -1, bs).transpose(-1, -2) for m in layer.meta])
            rows.append(torch.cat((layer.pages.view(torch.uint8), scales.contiguous().view(torch.uint8)), -1))
        else:
            rows.append(layer.pages.view(torch.uint8).clone())
    return rows


def compare_pages_with_eager(llm: LLM) -> list[tuple[float, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """As compare_with_eager, the eager forward of each native step, run from the cache as it was before the native
    step: for each, the largest logit difference, and over every row of pages (page_rows', flat): which rows the
    native step wrote, which the eager step wrote, and which hold the same bytes after both."""
    runner, storage, checks = llm.engine.runner, llm.engine.storage, []
    run, blocks = runner.run, list(range(llm.engine.storage.num_blocks))

    def checked_run(sched):
        steps, before = runner.native.steps, storage.read_blocks(blocks)
        out = run(sched)
        if runner.native.steps > steps:
            native = page_rows(storage)
            storage.write_blocks(blocks, before)
            old = page_rows(storage)
            inputs = runner.prepare(sched)
            with torch.inference_mode():
                hidden = runner.model(inputs.input_ids, inputs.positions, inputs.batch, runner.backend, storage)
                eager = runner.model.compute_logits(hidden[inputs.logits_indices])
            rows = [torch.cat([pages.any(-1).flatten() for pages in masks]) for masks in (
                [n != o for n, o in zip(native, old)], [e != o for e, o in zip(page_rows(storage), old)])]
            same = torch.cat([(n == e).all(-1).flatten() for n, e in zip(native, page_rows(storage))])
            checks.append(((out.logits.float() - eager.float()).abs().max().item(), *rows, same))
        return out

    runner.run = checked_run
    return checks


@pytest.mark.parametrize("dtype, atol", [("float32", 5e-5), ("bfloat16", 0.1)])
@pytest.mark.parametrize("model, kv_cache_dtype, skip", [
    *(pytest.param(model, kv, (), id=f"{model}-{kv}") for model in QUANTIZED_MODELS for kv in ("int8", "fp8", "int4")),
    pytest.param("llama", "int4", (0,), id="llama-int4-layer-0-full"),
    pytest.param("llama", "fp8", (1,), id="llama-fp8-layer-1-full")])
def test_native_steps_write_the_eager_steps_quantized_pages(checkpoint, model, kv_cache_dtype, skip, dtype, atol):
    """Over quantized pages (kv_cache_dtype_skip_layers: some full-precision), each native step writes its K/V where
    the eager step writes them, as the same numbers and scales (int4's keys rotated alike), and gives its logits.
    Llama's step computes its K/V as the eager model does (by the same kernels), and then writes every page bit
    for bit as kv/quant.py's codecs do. Gemma's norms sum in another order than torch's, and a K/V number a
    rounding apart now and then quantizes to its neighbour: most rows are still the same bytes."""
    arch, overrides = QUANTIZED_MODELS[model]
    path = checkpoint(arch, dtype=getattr(torch, dtype), **overrides)
    llm = LLM(str(path), block_size=4, num_kv_blocks=64, dtype=dtype, max_num_seqs=4, num_scheduler_steps=1,
              kv_cache_dtype=kv_cache_dtype, kv_cache_dtype_skip_layers=list(skip))
    storage = llm.engine.storage
    assert len(storage.quantized) == len(storage.layers) - len(skip) > 0
    assert (len(llm.engine.kv.layer_groups) > 1) == (model == "gemma3-hybrid")
    checks = compare_pages_with_eager(llm)
    llm.generate(prompts([1, 3, 4, 5, 13, 6]), SamplingParams(max_tokens=9, temperature=0, ignore_eos=True),
                 use_tqdm=False)
    assert len(checks) >= 9 and llm.stats()["steps"]["native"] == len(checks)
    assert max(diff for diff, *_ in checks) <= atol
    for _, native, eager, same in checks:
        assert torch.equal(native, eager) and native.any()
    same = torch.cat([same[native] for _, native, _, same in checks])
    assert same.all() if model == "llama" else same.float().mean() >= 0.9


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8", "int4"])
@pytest.mark.parametrize("model", list(QUANTIZED_MODELS))
def test_native_steps_over_quantized_pages_give_the_eager_engines_tokens(checkpoint, model, kv_cache_dtype):
    """Several steps a call (native_multi_step), a step a call (native) and op by op (enforce_eager): the same
    greedy tokens over quantized pages."""
    arch, overrides = QUANTIZED_MODELS[model]
    path = checkpoint(arch, **overrides)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    runs = {}
    for name, kw in {"native_multi_step": {"num_scheduler_steps": 8}, "native": {"num_scheduler_steps": 1},
                     "eager": {"enforce_eager": True}}.items():
        llm = LLM(str(path), block_size=4, num_kv_blocks=96, dtype="float32", kv_cache_dtype=kv_cache_dtype, **kw)
        runs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts([2, 9, 4, 13]), params, use_tqdm=False)]
        assert llm.stats()["steps"][name] >= (1 if name == "eager" else 11)
    assert runs["native_multi_step"] == runs["native"] == runs["eager"]


@pytest.mark.skipif(not layers.gemm_packs(torch.float32), reason="csrc/gemm.c does not multiply float32 here")
def test_it_runs_every_step_of_decodes_only(tiny_llama):
    llm = LLM(str(tiny_llama), block_size=4, num_kv_blocks=128, dtype="float32")
    native = llm.engine.runner.native
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    llm.generate(prompts([5] * (MAX_BATCH[torch.float32] + 3)), params, use_tqdm=False)
    assert native.steps == 3                       # a prefill, then decodes of 7 sequences
    # (in one call of three steps)
    assert llm.stats()["steps"] == {"native_multi_step": 3, "native": 0, "eager": 1}
    # h2o scores the cache with the attention of each step: those steps need the eager forward
    llm.generate(prompts([5]), SamplingParams(max_tokens=4, eviction="h2o:budget=64,recent=8"), use_tqdm=False)
    assert native.steps == 3
    assert llm.stats()["steps"] == {"native_multi_step": 3, "native": 0, "eager": 5}


def test_without_its_gemm_it_runs_small_decode_steps_only(tiny_llama, monkeypatch):
    """Weights packed for oneDNN (no csrc/gemm.c for the dtype here): past its matrix-vector products'
    limit, steps run op by op."""
    monkeypatch.setenv(STRICT_ENV, "0")
    monkeypatch.setattr(layers, "_gemm_function", lambda *args: None)
    llm = LLM(str(tiny_llama), block_size=4, num_kv_blocks=128, dtype="float32")
    native = llm.engine.runner.native
    assert native.max_batch == MAX_BATCH[torch.float32]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    llm.generate(prompts([5] * (MAX_BATCH[torch.float32] + 1)), params, use_tqdm=False)
    assert native.steps == 0
    assert llm.stats()["steps"] == {"native_multi_step": 0, "native": 0, "eager": 4}
    llm.generate(prompts([5] * MAX_BATCH[torch.float32]), params, use_tqdm=False)
    assert native.steps == 3
    assert llm.stats()["steps"] == {"native_multi_step": 3, "native": 0, "eager": 5}


def test_steps_at_once_give_the_tokens_of_steps_one_at_a_time(tiny_llama):
    """An offline greedy batch decodes several steps in one native call (vLLM's multi-step scheduling): the
    tokens, texts and finish reasons of steps one at a time, for requests of different max_tokens and ones
    that a stop token or a stop string ends inside a call; every block back in the pool, and the blocks the
    steps filled indexed for the prefix cache as single steps index them."""
    batch = prompts([2, 9, 4, 13, 5, 7])
    runs = {}
    for steps in (1, 8):
        llm = LLM(str(tiny_llama), block_size=4, num_kv_blocks=128, dtype="float32", num_scheduler_steps=steps)
        greedy = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (20, 7, 13, 20, 1, 20)]
        first = llm.generate(batch, greedy, use_tqdm=False)
        if steps == 1:
            stop_token = first[0].outputs[0].token_ids[10]
            stop_text = first[3].outputs[0].text[5:8]
        ends = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop_token_ids=[stop_token]),
                SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=[stop_text])]
        ended = llm.generate([batch[0], batch[3]], ends, use_tqdm=False)
        # prompts that extend the ones above by their outputs: prefix cache hits on the blocks decodes filled
        follow = [{"prompt_token_ids": p["prompt_token_ids"] + o.outputs[0].token_ids} for p, o in zip(batch, first)]
        llm.generate(follow, SamplingParams(max_tokens=1), use_tqdm=False)
        stats = llm.stats()
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
        assert (stats["steps"].get("native_multi_step", 0) > 0) == (steps > 1)
        runs[steps] = ([(c.token_ids, c.text, c.finish_reason) for o in first + ended for c in o.outputs],
                       stats["prefix_cache_hits"])
    assert runs[8] == runs[1]
    outputs = runs[8][0]
    assert outputs[6][2] == outputs[7][2] == "stop" and len(outputs[6][0]) == 11 and len(outputs[7][0]) < 20


def test_streamed_requests_decode_a_step_at_a_time(tiny_llama):
    """Outside LLM.generate, each step reports one more token of a request, as it comes."""
    engine = LLM(str(tiny_llama), block_size=4, num_kv_blocks=64, dtype="float32").engine
    engine.add_request("r", prompts([5])[0], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    counts = []
    while engine.has_unfinished_requests():
        counts += [len(o.outputs[0].token_ids) for o in engine.step()]
    assert counts == [1, 2, 3, 4, 5, 6]
    assert engine.stats()["steps"] == {"native_multi_step": 0, "native": 5, "eager": 1}


@pytest.mark.parametrize("kwargs", [dict(enforce_eager=True), dict(attention_backend="sdpa"),
                                    dict(cache_mode="none"), dict(dtype="float16")])
def test_it_is_off_where_it_does_not_apply(tiny_llama, kwargs):
    llm = LLM(str(tiny_llama), block_size=4, num_kv_blocks=64, **{"dtype": "float32", **kwargs})
    assert llm.engine.runner.native is None
    assert [e.name for e in llm.engine.runner.executors] == ["eager"]
    # and the eager model keeps only its prepacked weights (float16 is not prepacked)
    linear = llm.engine.model.model.layers[0].mlp.down_proj
    assert linear.packed is None or linear.weight.numel() == 0


@pytest.mark.parametrize("kwargs", [{}, dict(cache_mode="contiguous"), dict(eviction="sink:sinks=4,window=8")],
                         ids=["paged", "contiguous", "sink"])
def test_the_same_tokens_with_and_without_it(tiny_llama, kwargs):
    """Each side over its own cache: K/V written at the wrong slot would change what follows. A sink
    cache's positions run past the places its tokens have in the cache."""
    params = SamplingParams(max_tokens=16, temperature=0.8, seed=3, ignore_eos=True, logprobs=3)
    outs = []
    for eager in (False, True):
        llm = LLM(str(tiny_llama), block_size=4, num_kv_blocks=64, dtype="float32", enforce_eager=eager, **kwargs)
        outs.append(llm.generate(prompts([2, 9, 4]), params, use_tqdm=False))
        assert (llm.engine.runner.native is None) == eager
        assert (llm.stats()["steps"].get("native", 0) > 0) != eager
    for native, eager in zip(*outs):
        assert native.outputs[0].token_ids == eager.outputs[0].token_ids
        for a, b in zip(native.outputs[0].logprobs, eager.outputs[0].logprobs):
            assert a.keys() == b.keys()
            for token in a:
                assert abs(a[token].logprob - b[token].logprob) < 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, out, in_", [(1, 37, 80), (3, 5, 128), (4, 64, 13), (6, 130, 65)])
def test_the_matrix_vector_products_equal_torch(dtype, n, out, in_):
    from kvserve.engine.native_decode import linear_rows

    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(n * out)
    w = torch.randn(out, in_, generator=g).to(dtype)
    x = torch.randn(n, in_, generator=g).to(dtype)
    ref = torch.nn.functional.linear(x.float(), w.float())
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.05, rtol=0.01)
    torch.testing.assert_close(linear_rows(w, x), ref, **tol)


def test_without_a_c_compiler_the_engine_decodes_op_by_op(tiny_llama, monkeypatch):
    from kvserve import kernels

    monkeypatch.setenv(STRICT_ENV, "0")
    monkeypatch.setattr(kernels, "library", lambda: None)
    llm = LLM(str(tiny_llama), block_size=4, num_kv_blocks=64, dtype="float32")
    assert llm.engine.runner.native is None
    out = llm.generate(prompts([5]), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    assert llm.stats()["steps"] == {"eager": 4}


def test_strict_mode_refuses_to_decode_op_by_op_without_a_c_compiler(tiny_llama, monkeypatch):
    """Under KVSERVE_STRICT_KERNELS=1 (the tests' mode where the CPU runs the kernels), kernels that cannot
    be built are an error that names them, not a silent fallback."""
    from kvserve import kernels

    def no_compiler():
        raise OSError("cc: not found")

    monkeypatch.setenv(STRICT_ENV, "1")
    monkeypatch.setattr(kernels, "build", no_compiler)
    kernels.library.cache_clear()
    try:
        with pytest.raises(RuntimeError, match=r"native kernels .* cannot be built: cc: not found"):
            LLM(str(tiny_llama), block_size=4, num_kv_blocks=64, dtype="float32")
    finally:
        kernels.library.cache_clear()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_steps_of_more_sequences_than_a_gemm_row_block(checkpoint, dtype):
    """260 sequences: past the GEMM's 252-row blocks; the eager forward checks every step's logits."""
    path = checkpoint("llama", dtype=getattr(torch, dtype))
    llm = LLM(str(path), block_size=4, num_kv_blocks=600, dtype=dtype, max_num_seqs=260, num_scheduler_steps=1)
    llm.engine.runner.native.max_batch = None      # the matrix-vector products too, on CPUs without gemm.c
    diffs = compare_with_eager(llm)
    llm.generate(prompts([3, 5] * 130), SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), use_tqdm=False)
    assert len(diffs) == 2 and max(diffs) <= (5e-5 if dtype == "float32" else 0.1)
    assert llm.stats()["steps"] == {"native": 2, "eager": 1}
