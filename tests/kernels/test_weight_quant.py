"""Weight-only int8 and int4 (`quantization=`): csrc/gemm.c's quantized panels against the float products of the
dequantized weights, the engine against transformers running those weights, and where it cannot run."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from kvserve import LLM, SamplingParams
from kvserve.cli import build_parser, engine_kwargs
from kvserve.config import EngineConfig, ModelConfig
from kvserve.model import layers
from kvserve.model.gemm_choice import GEMM_ENV, choose_gemm
from kvserve.model.layers import (INT4_GROUP, NEVER, GateUpLinear, Linear, dequantize, dequantize_int4, gemm,
                                  gemm_pack, gemm_pack_groups, quantize_int4, quantize_int8)
from kvserve.planner import plan, weight_bytes
from tiny_models import hf_model

pytestmark = pytest.mark.skipif(shutil.which("cc") is None or not layers.gemm_packs(torch.float32),
                                reason="csrc/gemm.c does not run here")
KERNELS = [(torch.float32, "avx512"), (torch.bfloat16, "avx512"), (torch.bfloat16, "amx")]
# rows in registers (1, 2), past a tile (14) and a block (252); columns past a panel (32); k odd, past a chunk (256;
# bf16 512), past an AMX tile (32)
SHAPES = [(1, 1, 1), (2, 70, 129), (3, 33, 7), (15, 65, 257), (29, 100, 513), (253, 40, 300), (40, 96, 1031)]


QUANTIZATIONS = ["int8", "int4"]


def _quantized(w: torch.Tensor, quantization: str, dtype: torch.dtype, gated: bool = False, kernel: str = "avx512"):
    """w packed as `quantization` for products in dtype: (packed, scales) as gemm() takes them, and the dequantized
    weight whose products they are (int8: q * scale, in float32; int4: q * scale + min, in float32, but rounded to
    bfloat16 for AMX's kernel, whose tiles take the weight widened to it)."""
    if quantization == "int8":
        q, scales = quantize_int8(w)
        return gemm_pack(q, gated, dtype=dtype), scales, dequantize(q, scales)
    q, scales, mins = quantize_int4(w)
    dequantized = dequantize_int4(q, scales, mins)
    return (gemm_pack(q, gated, dtype=dtype), gemm_pack_groups(scales, mins, gated, dtype),
            dequantized.to(dtype).float() if kernel == "amx" else dequantized)


def _amx_from(kernel: str, dtype: torch.dtype) -> int:
    if kernel not in layers.gemm_kernels(dtype):
        pytest.skip(f"csrc/gemm.c has no {kernel} kernel for {dtype} here")
    return 1 if kernel == "amx" else NEVER


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), w.double(), None if b is None else b.double())


def _close(got: torch.Tensor, ref: torch.Tensor, x: torch.Tensor) -> None:
    """Up to the order of the float32 sums (float32), or one rounding of them (bfloat16)."""
    err = (got.double() - ref).abs()
    if got.dtype == torch.float32:
        assert (err <= 1e-5 * (ref.abs() + x.shape[-1] ** 0.5)).all(), err.max()
    else:
        assert (err <= ref.abs() * 2 ** -8 + 1e-3 * x.shape[-1] ** 0.5 * 2 ** -8).all(), err.max()


def test_quantize_int8_is_symmetric_per_output_column():
    w = torch.randn(5, 40) * torch.tensor([1.0, 10.0, 0.01, 3.0, 0.0])[:, None]
    q, scales = quantize_int8(w)
    assert q.dtype == torch.int8 and scales.dtype == torch.float32 and scales.shape == (5,)
    assert torch.equal(scales[:4], w[:4].abs().amax(dim=1) / 127) and scales[4] == 1 and not q[4].any()
    assert (q.abs().amax(dim=1)[:4] == 127).all()
    # each number to the nearest step of its column's scale
    assert ((dequantize(q, scales) - w).abs() <= scales[:, None] / 2 * (1 + 1e-6)).all()


def test_quantize_int4_is_asymmetric_per_group():
    w = torch.randn(3, 70) * torch.tensor([1.0, 50.0, 0.0])[:, None] + torch.tensor([0.0, 5.0, 2.0])[:, None]
    q, scales, mins = quantize_int4(w)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15 and scales.dtype == mins.dtype == torch.float16
    assert scales.shape == mins.shape == (3, 3)           # 70 inputs: groups of 32, 32 and 6
    groups = [w[:, i:i + INT4_GROUP] for i in range(0, 70, INT4_GROUP)]
    low = torch.stack([g.amin(dim=1) for g in groups], dim=1)
    high = torch.stack([g.amax(dim=1) for g in groups], dim=1)
    assert torch.equal(mins, low.half()) and torch.equal(scales[:2], ((high - low) / 15).half()[:2])
    assert (scales[2] == 1).all() and not q[2].any()      # a constant row: its minimum alone
    # each number to the nearest step of its group (float16's rounding of min and scale aside)
    step = scales.float().repeat_interleave(INT4_GROUP, dim=1)[:, :70]
    assert ((dequantize_int4(q, scales, mins) - w).abs() <= step * 0.51 + w.abs() * 2 ** -10).all()


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
@pytest.mark.parametrize("dtype, kernel", KERNELS)
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_quantized_gemm_is_the_product_of_the_dequantized_weight(quantization, dtype, kernel, m, n, k):
    amx_from = _amx_from(kernel, dtype)
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w, x, b = (torch.randn(*shape, generator=g).to(dtype) for shape in ((n, k), (m, k), (n,)))
    packed, scales, dequantized = _quantized(w, quantization, dtype, kernel=kernel)
    assert packed.dtype == (torch.int8 if quantization == "int8" else torch.uint8)
    for bias in (None, b):
        got = gemm(x, packed, bias, n, amx_from=amx_from, scales=scales)
        _close(got, _reference(x, dequantized, bias), x)


def test_int4_bfloat16_products_take_x_in_fixed_point_per_group():
    """AVX-512's int4 kernel (VNNI) multiplies x as a 24-bit fixed point per group of 32 inputs, its unit the power
    of two that puts the group's largest |x| under 2^22: 0.75 beside 2^20 (unit 0.5) counts as 1.0, the nearest
    even multiple; the next group, without a large number, keeps its 0.75. Where the CPU has no VNNI, chunks are
    widened and 0.75 is exact."""
    amx_from = _amx_from("avx512", torch.bfloat16)
    w = torch.zeros(1, 64)
    w[0, 1] = w[0, 33] = 1.0              # each group's q: 15 for its second input, scale 1/15, minimum 0
    x = torch.zeros(1, 64)
    x[0, 0], x[0, 1], x[0, 33] = 2.0 ** 20, 0.75, 0.75
    packed, scales, dequantized = _quantized(w.bfloat16(), "int4", torch.bfloat16)
    assert dequantized[0, 0] == 0 and dequantized[0, 32] == 0
    got = gemm(x.bfloat16(), packed, None, 1, amx_from=amx_from, scales=scales).float()
    vnni = "avx512_vnni" in Path("/proc/cpuinfo").read_text()
    fixed = torch.tensor([1.0 if vnni else 0.75, 0.75])
    expected = (fixed * dequantized[0, [1, 33]]).sum().bfloat16().float()
    assert torch.equal(got, expected.reshape(1, 1)), (got, expected)


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
@pytest.mark.parametrize("dtype, kernel", KERNELS)
@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (15, 64, 257), (64, 100, 513)])
def test_quantized_gate_up_is_swiglu_of_the_dequantized_weight(quantization, dtype, kernel, m, n, k):
    amx_from = _amx_from(kernel, dtype)
    g = torch.Generator().manual_seed(m + n + k)
    w, x = torch.randn(2 * n, k, generator=g).to(dtype), torch.randn(m, k, generator=g).to(dtype)
    lin = GateUpLinear(k, 2 * n, bias=False, dtype=dtype)
    assert lin.load(w.clone(), "gemm", quantization) == "gemm" and lin.quantization == quantization
    lin.amx_from = amx_from
    rnd = (lambda t: t.to(dtype).double()) if dtype == torch.bfloat16 else (lambda t: t)
    packed = _quantized(w, quantization, dtype, gated=True, kernel=kernel)[2]
    gate, up = rnd(_reference(x, packed, None)).chunk(2, dim=-1)
    ref = rnd(rnd(F.silu(gate)) * up)
    tol = 1e-5 * k ** 0.5 if dtype == torch.float32 else 2 ** -6
    assert ((lin(x).double() - ref).abs() <= tol * (ref.abs() + 1)).all()


def test_a_layer_that_cannot_be_quantized_says_why():
    lin = Linear(8, 4, bias=False, dtype=torch.float16)
    with pytest.raises(ValueError, match="quantization='int8' multiplies by csrc/gemm.c's panels"):
        lin.load(torch.zeros(4, 8, dtype=torch.float16), "gemm", "int8")
    with pytest.raises(ValueError, match="quantization must be one of"):
        Linear(8, 4, bias=False).load(torch.zeros(4, 8), "gemm", "int3")


def _dequantized_checkpoint(src: Path, dst: Path, quantization: str = "int8") -> Path:
    """The checkpoint with each linear layer's weight (q, k, v, o, gate, up, down, lm_head) replaced by its
    dequantized weight, as the engine quantizes it at load: per output column (int8) or per column and group
    of inputs (int4), so q, k, v (and gate, up) quantize alone as they do merged. A tied embedding table is
    lm_head's weight: dequantized too."""
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    tied = ModelConfig.from_path(src).tie_word_embeddings
    for name, t in tensors.items():
        if t.dim() == 2 and (tied or "embed_tokens" not in name):
            tensors[name] = (dequantize(*quantize_int8(t)) if quantization == "int8"
                             else dequantize_int4(*quantize_int4(t))).to(t.dtype)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
@pytest.mark.parametrize("arch, overrides", [("llama", {}), ("qwen2", dict(tie_word_embeddings=True)), ("phi3", {}),
                                             ("gemma2", dict(sliding_window=8))])
def test_greedy_tokens_match_transformers_on_the_dequantized_weights(checkpoint, tmp_path, quantization, arch,
                                                                     overrides):
    """Float32, quantized weights: the engine's greedy tokens are those of transformers running the dequantized
    weights (a tied table is lm_head's, its rows dequantized too), prefill and decode, in the C step and
    op by op. Phi-3's checkpoint holds q, k, v (and gate, up) fused; Gemma 2 is tied, with sliding windows."""
    path = checkpoint(arch, **overrides)
    reference = hf_model(_dequantized_checkpoint(path, tmp_path / "dequantized", quantization))
    if reference.config.tie_word_embeddings:
        table = reference.get_input_embeddings().weight
        original = load_file(str(path / "model.safetensors"))["model.embed_tokens.weight"]
        assert torch.equal(table, _quantized(original, quantization, torch.float32)[2])
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 30)]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    for eager in (False, True):
        llm = LLM(str(path), dtype="float32", block_size=4, num_kv_blocks=64, quantization=quantization,
                  enforce_eager=eager)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert (llm.stats()["steps"].get("native_multi_step", 0) > 0) == (not eager)
        for prompt, out in zip(prompts, outs):
            ids = torch.tensor([prompt])
            expected = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=10,
                                          min_new_tokens=10)[0, len(prompt):].tolist()
            assert out.outputs[0].token_ids == expected


@pytest.mark.parametrize("weights, kwargs", [("int8", dict(kv_cache_dtype="int8")),
                                             ("int8", dict(kv_cache_dtype="fp8")),
                                             ("int8", dict(kv_cache_dtype="int4")),
                                             ("int4", dict(kv_cache_dtype="int8")),
                                             ("int8", dict(eviction="h2o:budget=16,recent=4")),
                                             ("int4", dict(eviction="sink:sinks=4,window=8", num_scheduler_steps=1))],
                         ids=["int8-pages", "fp8-pages", "int4-pages", "int4-weights-int8-pages", "h2o", "int4-sink"])
def test_quantized_weights_take_every_kv_dtype_and_eviction(checkpoint, tmp_path, weights, kwargs):
    """With quantized pages or an eviction policy, quantized weights give the tokens of the dequantized weights
    held in float32 under the same cache."""
    path = checkpoint("llama")
    dequantized = _dequantized_checkpoint(path, tmp_path / "dequantized", weights)
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (7, 26)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = []
    for checkpoint, quantization in ((path, weights), (dequantized, None)):
        llm = LLM(str(checkpoint), dtype="float32", block_size=4, num_kv_blocks=64, quantization=quantization,
                  **kwargs)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert outs[0] == outs[1]


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
@pytest.mark.parametrize("kernel", ["avx512", "amx", "vnni", "widen"])
def test_the_c_step_gives_the_eager_logits_with_quantized_weights(checkpoint, monkeypatch, kernel, quantization):
    from test_native_decode import compare_with_eager, prompts

    if kernel not in layers.gemm_kernels(torch.bfloat16):
        pytest.skip(f"csrc/gemm.c has no {kernel} kernel here")
    monkeypatch.setenv(GEMM_ENV, kernel)
    path = checkpoint("qwen3", dtype=torch.bfloat16, head_dim=24, hidden_size=72,
                      intermediate_size=100, tie_word_embeddings=True)
    llm = LLM(str(path), block_size=4, num_kv_blocks=64, dtype="bfloat16", max_num_seqs=4, num_scheduler_steps=1,
              quantization=quantization)
    diffs = compare_with_eager(llm)
    llm.generate(prompts([1, 3, 4, 5, 13]), SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                 use_tqdm=False)
    assert len(diffs) >= 5 and max(diffs) <= 0.1


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
def test_quantized_weights_take_a_byte_or_half_a_byte_a_number(checkpoint, quantization):
    from test_weight_memory import held_bytes

    path = checkpoint("llama", tie_word_embeddings=True)
    llm = LLM(str(path), dtype="float32", block_size=4, num_kv_blocks=8, quantization=quantization)
    cfg = ModelConfig.from_path(path)
    model = llm.engine.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert all(m.quantization == quantization for m in linears)
    numbers = sum(m.in_features * m.out_features for m in linears)
    if quantization == "int8":      # a float32 scale per output column
        expected = numbers + 4 * sum(m.out_features for m in linears)
    else:                           # a float16 scale and minimum per output column and group of 32
        expected = numbers // 2 + 4 * sum(m.out_features * -(-m.in_features // INT4_GROUP) for m in linears)
    others = 4 * sum(p.numel() for name, p in model.named_parameters() if "norm" in name)
    assert held_bytes(model, llm.engine.runner.native) == expected + others
    assert weight_bytes(cfg, 4, quantization) == expected + others


def test_where_int8_weights_cannot_run_is_a_value_error(checkpoint):
    cfg = ModelConfig.from_path(checkpoint("llama"))
    with pytest.raises(ValueError, match="quantization='int8' runs on the CPU only"):
        choose_gemm(cfg, torch.bfloat16, torch.device("cuda"), False, "int8")
    with pytest.raises(ValueError, match="it does not multiply torch.float16"):
        choose_gemm(cfg, torch.float16, torch.device("cpu"), False, "int8")
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="int3")


def test_the_planner_and_the_command_line_take_it():
    bf16 = plan("llama-3.2-1b", 24 * 2**30, 4096).weight_bytes
    int8 = plan("llama-3.2-1b", 24 * 2**30, 4096, quantization="int8").weight_bytes
    int4 = plan("llama-3.2-1b", 24 * 2**30, 4096, quantization="int4").weight_bytes
    assert 0.5 < int8 / bf16 < 0.52 and 0.3 < int4 / bf16 < 0.33
    args = build_parser().parse_args(["generate", "hi", "--quantization", "int8"])
    assert engine_kwargs(args)["quantization"] == "int8"
