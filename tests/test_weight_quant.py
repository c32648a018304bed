"""Weight-only int8 (`quantization="int8"`): csrc/gemm.c's int8 panels against the float products of the
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
from kvserve.model.layers import NEVER, GateUpLinear, Linear, dequantize, gemm, gemm_pack, quantize_int8
from kvserve.planner import plan, weight_bytes
from tiny_models import hf_model, make_checkpoint

pytestmark = pytest.mark.skipif(shutil.which("cc") is None or not layers.gemm_packs(torch.float32),
                                reason="csrc/gemm.c does not run here")
KERNELS = [(torch.float32, "avx512"), (torch.bfloat16, "avx512"), (torch.bfloat16, "amx")]
# rows in registers (1, 2), past a tile (14) and a block (252); columns past a panel (32); k odd, past a chunk (256;
# bf16 512), past an AMX tile (32)
SHAPES = [(1, 1, 1), (2, 70, 129), (3, 33, 7), (15, 65, 257), (29, 100, 513), (253, 40, 300), (40, 96, 1031)]


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


@pytest.mark.parametrize("dtype, kernel", KERNELS)
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_int8_gemm_is_the_product_of_the_dequantized_weight(dtype, kernel, m, n, k):
    amx_from = _amx_from(kernel, dtype)
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w, x, b = (torch.randn(*shape, generator=g).to(dtype) for shape in ((n, k), (m, k), (n,)))
    q, scales = quantize_int8(w)
    packed = gemm_pack(q, dtype=dtype)
    assert packed.dtype == torch.int8
    for bias in (None, b):
        got = gemm(x, packed, bias, n, amx_from=amx_from, scales=scales)
        _close(got, _reference(x, dequantize(q, scales), bias), x)


@pytest.mark.parametrize("dtype, kernel", KERNELS)
@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (15, 64, 257), (64, 100, 513)])
def test_int8_gate_up_is_swiglu_of_the_dequantized_weight(dtype, kernel, m, n, k):
    amx_from = _amx_from(kernel, dtype)
    g = torch.Generator().manual_seed(m + n + k)
    w, x = torch.randn(2 * n, k, generator=g).to(dtype), torch.randn(m, k, generator=g).to(dtype)
    lin = GateUpLinear(k, 2 * n, bias=False, dtype=dtype)
    assert lin.load(w.clone(), "gemm", "int8") == "gemm" and lin.quantization == "int8"
    lin.amx_from = amx_from
    rnd = (lambda t: t.to(dtype).double()) if dtype == torch.bfloat16 else (lambda t: t)
    gate, up = rnd(_reference(x, dequantize(quantize_int8(w)[0], lin.scales), None)).chunk(2, dim=-1)
    ref = rnd(rnd(F.silu(gate)) * up)
    tol = 1e-5 * k ** 0.5 if dtype == torch.float32 else 2 ** -6
    assert ((lin(x).double() - ref).abs() <= tol * (ref.abs() + 1)).all()


def test_a_layer_that_cannot_be_quantized_says_why():
    lin = Linear(8, 4, bias=False, dtype=torch.float16)
    with pytest.raises(ValueError, match="quantization='int8' multiplies by csrc/gemm.c's panels"):
        lin.load(torch.zeros(4, 8, dtype=torch.float16), "gemm", "int8")
    with pytest.raises(ValueError, match="quantization must be one of"):
        Linear(8, 4, bias=False).load(torch.zeros(4, 8), "gemm", "int3")


def _dequantized_checkpoint(src: Path, dst: Path) -> Path:
    """The checkpoint with each linear layer's weight (q, k, v, o, gate, up, down, lm_head) replaced by its
    int8-dequantized weight, as the engine quantizes it at load: per output column, so q, k, v (and gate, up)
    quantize alone as they do merged. A tied embedding table is lm_head's weight: dequantized too."""
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    tied = ModelConfig.from_path(src).tie_word_embeddings
    for name, t in tensors.items():
        if t.dim() == 2 and (tied or "embed_tokens" not in name):
            tensors[name] = dequantize(*quantize_int8(t)).to(t.dtype)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("arch, overrides", [("llama", {}), ("qwen2", dict(tie_word_embeddings=True))])
def test_greedy_tokens_match_transformers_on_the_dequantized_weights(tmp_path, arch, overrides):
    """Float32, int8 weights: the engine's greedy tokens are those of transformers running the dequantized
    weights (a tied table is lm_head's, its rows dequantized too), prefill and decode, in the C step and
    op by op."""
    path = make_checkpoint(tmp_path / "model", arch, **overrides)
    reference = hf_model(_dequantized_checkpoint(path, tmp_path / "dequantized"))
    if overrides.get("tie_word_embeddings"):
        table = reference.get_input_embeddings().weight
        q, scales = quantize_int8(load_file(str(path / "model.safetensors"))["model.embed_tokens.weight"])
        assert torch.equal(table, dequantize(q, scales))
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 30)]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    for eager in (False, True):
        llm = LLM(str(path), dtype="float32", block_size=4, num_kv_blocks=64, quantization="int8", enforce_eager=eager)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert (llm.stats()["steps"].get("native_multi_step", 0) > 0) != eager
        for prompt, out in zip(prompts, outs):
            ids = torch.tensor([prompt])
            expected = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=10,
                                          min_new_tokens=10)[0, len(prompt):].tolist()
            assert out.outputs[0].token_ids == expected


@pytest.mark.parametrize("kwargs", [dict(kv_cache_dtype="int8"), dict(kv_cache_dtype="fp8"),
                                    dict(kv_cache_dtype="int4"), dict(eviction="h2o:budget=16,recent=4"),
                                    dict(eviction="sink:sinks=4,window=8", num_scheduler_steps=1)],
                         ids=["int8-pages", "fp8-pages", "int4-pages", "h2o", "sink"])
def test_int8_weights_take_every_kv_dtype_and_eviction(tmp_path, kwargs):
    """With quantized pages or an eviction policy, int8 weights give the tokens of the dequantized weights held
    in float32 under the same cache."""
    path = make_checkpoint(tmp_path / "model", "llama")
    dequantized = _dequantized_checkpoint(path, tmp_path / "dequantized")
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (7, 26)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = []
    for checkpoint, quantization in ((path, "int8"), (dequantized, None)):
        llm = LLM(str(checkpoint), dtype="float32", block_size=4, num_kv_blocks=64, quantization=quantization,
                  **kwargs)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert outs[0] == outs[1]


@pytest.mark.parametrize("kernel", ["avx512", "amx"])
def test_the_c_step_gives_the_eager_logits_with_int8_weights(tmp_path, monkeypatch, kernel):
    from test_native_decode import compare_with_eager, prompts

    if kernel not in layers.gemm_kernels(torch.bfloat16):
        pytest.skip(f"csrc/gemm.c has no {kernel} kernel here")
    monkeypatch.setenv(GEMM_ENV, kernel)
    path = make_checkpoint(tmp_path, "qwen3", dtype=torch.bfloat16, head_dim=24, hidden_size=72,
                           intermediate_size=100, tie_word_embeddings=True)
    llm = LLM(str(path), block_size=4, num_kv_blocks=64, dtype="bfloat16", max_num_seqs=4, num_scheduler_steps=1,
              quantization="int8")
    diffs = compare_with_eager(llm)
    llm.generate(prompts([1, 3, 4, 5, 13]), SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                 use_tqdm=False)
    assert len(diffs) >= 5 and max(diffs) <= 0.1


def test_int8_weights_take_a_byte_a_number(tmp_path):
    from test_weight_memory import held_bytes

    path = make_checkpoint(tmp_path, "llama", tie_word_embeddings=True)
    llm = LLM(str(path), dtype="float32", block_size=4, num_kv_blocks=8, quantization="int8")
    cfg = ModelConfig.from_path(path)
    model = llm.engine.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert all(m.quantization == "int8" and m.packed.dtype == torch.int8 for m in linears)
    numbers = sum(m.in_features * m.out_features for m in linears)
    columns = sum(m.out_features for m in linears)
    others = sum(p.numel() for name, p in model.named_parameters() if "norm" in name)
    assert held_bytes(model, llm.engine.runner.native) == numbers + 4 * columns + 4 * others
    assert weight_bytes(cfg, 4, "int8") == numbers + 4 * columns + 4 * others


def test_where_int8_weights_cannot_run_is_a_value_error(tmp_path):
    cfg = ModelConfig.from_path(make_checkpoint(tmp_path, "llama"))
    with pytest.raises(ValueError, match="quantization='int8' runs on the CPU only"):
        choose_gemm(cfg, torch.bfloat16, torch.device("cuda"), False, "int8")
    with pytest.raises(ValueError, match="it does not multiply torch.float16"):
        choose_gemm(cfg, torch.float16, torch.device("cpu"), False, "int8")
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="int3")


def test_the_planner_and_the_command_line_take_it():
    bf16 = plan("llama-3.2-1b", 24 * 2**30, 4096).weight_bytes
    int8 = plan("llama-3.2-1b", 24 * 2**30, 4096, quantization="int8").weight_bytes
    assert 0.5 < int8 / bf16 < 0.52
    args = build_parser().parse_args(["generate", "hi", "--quantization", "int8"])
    assert engine_kwargs(args)["quantization"] == "int8"
