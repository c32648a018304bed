"""csrc/gemm.c's kernels of quantized weights beside AVX-512's own, bfloat16 products: vnni (x rounded to int8 per
group of 32 inputs, multiplied by the weight's bytes with VPDPBUSD) and widen (each chunk of the weight dequantized to
bfloat16 once for all rows), against float references on awkward shapes; and how the measured choice takes them."""
from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from kvserve import LLM, SamplingParams
from kvserve.model import gemm_choice, layers
from kvserve.model.gemm_choice import GEMM_ENV, ROWS, Shape, decide, quantized_thresholds, time_shape
from kvserve.model.layers import (INT4_GROUP, NEVER, GateUpLinear, Linear, dequantize, dequantize_int4, gemm,
                                  gemm_pack, gemm_pack_groups, quantize_int4, quantize_int8)

pytestmark = pytest.mark.skipif(shutil.which("cc") is None or not layers.gemm_packs(torch.bfloat16),
                                reason="csrc/gemm.c does not multiply bfloat16 here")
QUANTIZATIONS = ["int8", "int4"]
# rows: one, a vnni tile's (6) and past it, past an int4 tile of split_rows (2), past a block (252); columns past a
# panel (32); k odd, short of a group (32), past a chunk (512)
SHAPES = [(1, 1, 1), (2, 70, 129), (6, 33, 7), (7, 65, 31), (13, 100, 513), (253, 40, 300), (40, 96, 1031)]


def _plan(kernel: str) -> dict[str, int]:
    """gemm()'s keywords that run `kernel` at every row count (skip where csrc/gemm.c has no such kernel)."""
    if kernel not in layers.gemm_kernels(torch.bfloat16):
        pytest.skip(f"csrc/gemm.c has no {kernel} kernel here")
    return {"avx512": {}, "vnni": {"vnni_from": 1}, "widen": {"widen_from": 1}}[kernel]


def _quantized(w: torch.Tensor, quantization: str, gated: bool = False):
    """(packed, scales, the dequantized weight in float32), bfloat16 products."""
    if quantization == "int8":
        q, scales = quantize_int8(w)
        return gemm_pack(q, gated, dtype=torch.bfloat16), scales, dequantize(q, scales)
    q, scales, mins = quantize_int4(w)
    return (gemm_pack(q, gated, dtype=torch.bfloat16), gemm_pack_groups(scales, mins, gated, torch.bfloat16),
            dequantize_int4(q, scales, mins))


def rounded_rows(x: torch.Tensor) -> torch.Tensor:
    """x [m, k] as the vnni kernel multiplies it (float64): each group of 32 inputs of a row q * unit, unit = the
    group's max |x| / 127 and q = x / unit rounded to nearest (in float32, as csrc/gemm.c's quantize_rows)."""
    m, k = x.shape
    padded = F.pad(x.float(), (0, -k % INT4_GROUP)).reshape(m, -1, INT4_GROUP)
    largest = padded.abs().amax(dim=-1, keepdim=True)
    # a true division, as csrc/gemm.c's (a number over a tensor is torch's reciprocal times the number)
    to_q = torch.where(largest > 0, torch.full_like(largest, 127).div(largest), torch.zeros_like(largest))
    q = torch.round(padded * to_q)
    assert q.abs().max() <= 127
    return (q.double() * largest.div(127).double()).reshape(m, -1)[:, :k]


def _rounding_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """How far x's rounding (rounded_rows) can move each product: half a unit (max |x| / 254 of its group) times
    sum |w| over the group, summed over the groups."""
    m, k = x.shape
    half_units = F.pad(x.double(), (0, -k % INT4_GROUP)).reshape(m, -1, INT4_GROUP).abs().amax(dim=-1) / 254
    w_sums = F.pad(w.double().abs(), (0, -k % INT4_GROUP)).reshape(w.shape[0], -1, INT4_GROUP).sum(dim=-1)
    return half_units @ w_sums.T


def _close(got: torch.Tensor, ref: torch.Tensor, x: torch.Tensor) -> None:
    """One rounding of float32 sums to bfloat16 (as test_weight_quant's)."""
    err = (got.double() - ref).abs()
    assert (err <= ref.abs() * 2 ** -8 + 1e-3 * x.shape[-1] ** 0.5 * 2 ** -8).all(), err.max()


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), w.double(), None if b is None else b.double())


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_vnni_is_the_product_of_the_dequantized_weight_by_x_rounded_to_int8(quantization, m, n, k):
    """Exactly the products of the dequantized weight by rounded_rows(x), up to the order of float32 sums and
    bfloat16's rounding; and off the unrounded x's products by no more than x's rounding can move them."""
    plan = _plan("vnni")
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w, x, b = (torch.randn(*shape, generator=g).bfloat16() for shape in ((n, k), (m, k), (n,)))
    packed, scales, dequantized = _quantized(w, quantization)
    for bias in (None, b):
        got = gemm(x, packed, bias, n, scales=scales, **plan)
        _close(got, _reference(rounded_rows(x), dequantized, bias), x)
        exact = _reference(x, dequantized, bias)
        assert ((got.double() - exact).abs() <= _rounding_bound(x, dequantized) * 1.001 + exact.abs() * 2 ** -8
                + 1e-3 * k ** 0.5 * 2 ** -8).all()


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_widen_is_the_product_of_the_dequantized_weight_rounded_to_bfloat16(quantization, m, n, k):
    """int8's q widens exactly (its column's scale is applied to the sums); int4's q * scale + min is rounded to
    bfloat16, as AMX's tiles take it."""
    plan = _plan("widen")
    g = torch.Generator().manual_seed(m * 1000 + n + k + 1)
    w, x, b = (torch.randn(*shape, generator=g).bfloat16() for shape in ((n, k), (m, k), (n,)))
    packed, scales, dequantized = _quantized(w, quantization)
    weight = dequantized if quantization == "int8" else dequantized.bfloat16()
    for bias in (None, b):
        _close(gemm(x, packed, bias, n, scales=scales, **plan), _reference(x, weight, bias), x)


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
@pytest.mark.parametrize("kernel", ["vnni", "widen"])
@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (7, 64, 257), (64, 100, 513)])
def test_gate_up_is_swiglu_of_each_kernels_products(quantization, kernel, m, n, k):
    plan = _plan(kernel)
    g = torch.Generator().manual_seed(m + n + k)
    w, x, b = (torch.randn(*shape, generator=g).bfloat16() for shape in ((2 * n, k), (m, k), (2 * n,)))
    lin = GateUpLinear(k, 2 * n, bias=True, dtype=torch.bfloat16)
    lin.bias = torch.nn.Parameter(b, requires_grad=False)
    assert lin.load(w.clone(), "gemm", quantization) == "gemm"
    lin.widen_from, lin.vnni_from = plan.get("widen_from", NEVER), plan.get("vnni_from", NEVER)
    dequantized = _quantized(w, quantization, gated=True)[2]
    weight = dequantized.bfloat16() if kernel == "widen" and quantization == "int4" else dequantized
    rows = rounded_rows(x) if kernel == "vnni" else x
    rnd = lambda t: t.bfloat16().double()        # noqa: E731
    gate, up = rnd(_reference(rows, weight, b)).chunk(2, dim=-1)
    ref = rnd(rnd(F.silu(gate)) * up)
    assert ((lin(x).double() - ref).abs() <= 2 ** -6 * (ref.abs() + 1)).all()


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
def test_each_kernel_takes_x_as_it_says(quantization):
    """Inputs 1 and 33 of one column weigh 1 (int8: q 127, scale 1/127; int4: q 15, scale 1/15). x holds 254 at
    input 0 and 0.75 at inputs 1 and 33: vnni rounds its first group to units of 2, so 0.75 counts as 0 there, and
    keeps the second group's 0.75 (its own unit 0.75 / 127); avx512 and widen take both."""
    kernels = [k for k in ("avx512", "vnni", "widen") if k in layers.gemm_kernels(torch.bfloat16)]
    w = torch.zeros(1, 64)
    w[0, 1] = w[0, 33] = 1.0
    x = torch.zeros(1, 64)
    x[0, 0], x[0, 1], x[0, 33] = 254.0, 0.75, 0.75
    packed, scales, dequantized = _quantized(w.bfloat16(), quantization)
    one = dequantized[0, 1]
    expected = {"avx512": 1.5 * one, "vnni": 0.75 * one, "widen": 1.5 * one.bfloat16().float()}
    for kernel in kernels:
        got = gemm(x.bfloat16(), packed, None, 1, scales=scales, **_plan(kernel)).float()
        assert torch.equal(got, expected[kernel].bfloat16().float().reshape(1, 1)), (kernel, got)


def _timings(avx512: list[float], vnni: list[float], widen: list[float]) -> dict[int, dict[str, float]]:
    return {m: {"avx512": a, "vnni": v, "widen": w, "onednn": 99.0} for m, a, v, w in zip(ROWS, avx512, vnni, widen)}


def test_widen_and_vnni_run_from_the_rows_where_they_win_at_every_larger_count():
    assert ROWS == (1, 4, 8, 16, 64, 512)
    slow = [9.0] * 6
    # vnni everywhere
    assert quantized_thresholds(_timings([2] * 6, [1] * 6, slow), NEVER) == (NEVER, 1)
    # avx512 at 1 and 4 rows, vnni from 8, widen at 512 alone
    assert quantized_thresholds(_timings([1, 1, 3, 3, 3, 9], [2, 2, 2, 2, 2, 8], [5, 5, 5, 5, 5, 7]), NEVER) == (512, 8)
    # vnni faster at 1 row, slower at 4: not taken below 8
    assert quantized_thresholds(_timings([2, 1, 3, 3, 3, 3], [1, 2, 2, 2, 2, 2], slow), NEVER) == (NEVER, 8)
    # AMX from 16 rows: the others are chosen below it
    assert quantized_thresholds(_timings([2, 2, 2, 2, 2, 2], [1, 1, 1, 3, 3, 3], slow), 16) == (NEVER, 1)
    # unquantized weights: neither measured
    assert quantized_thresholds({m: {"avx512": 1.0} for m in ROWS}, NEVER) == (NEVER, NEVER)


def test_the_choice_runs_each_kernel_at_its_rows():
    shapes = [Shape("qkv_proj", 64, 32, False, 2), Shape("lm_head", 96, 32, False, 1)]
    by_rows = _timings([1, 1, 3, 3, 3, 9], [2, 2, 2, 2, 2, 8], [5, 5, 5, 5, 5, 7])
    choice = decide(shapes, {"qkv_proj": by_rows, "lm_head": by_rows}, "measured")
    assert choice.widen_from == {"qkv_proj": 512, "lm_head": 512} and choice.vnni_from == {"qkv_proj": 8, "lm_head": 8}
    # avx512 at 1 and 4 rows, vnni at 8 to 64
    assert choice.per_row((1, 4, 8, 16, 64)) == pytest.approx({"gemm": 3 * (1 + 1 / 4 + 2 / 8 + 2 / 16 + 2 / 64),
                                                              "onednn": 3 * 99 * (1 + 1 / 4 + 1 / 8 + 1 / 16 + 1 / 64)})
    assert choice.per_row((512,))["gemm"] == pytest.approx(3 * 7 / 512)
    report = choice.report()
    assert report["widen_from"]["qkv_proj"] == 512 and report["vnni_from"]["lm_head"] == 8
    layer = Linear(32, 64, bias=False, dtype=torch.bfloat16)
    layer.load(torch.randn(64, 32, dtype=torch.bfloat16), "gemm", "int8")
    model = torch.nn.ModuleDict({"qkv_proj": layer})
    choice.apply(model)
    assert layer.kernel_plan() == {"amx_from": NEVER, "widen_from": 512, "vnni_from": 8}


def test_quantized_weights_are_timed_by_their_own_kernels_too(monkeypatch):
    monkeypatch.setattr(gemm_choice, "_BUDGET", 0.0)       # the fewest runs: what is chosen is not tested here
    kernels = layers.gemm_kernels(torch.bfloat16)
    own = {k for k in kernels if k not in layers.QUANTIZED_KERNELS}
    shape = Shape("o_proj", 64, 96, False, 1)
    assert all(set(t) == own | {"onednn"} for t in time_shape(shape, torch.bfloat16, kernels).values())
    assert all(set(t) == set(kernels) for t in time_shape(shape, torch.bfloat16, kernels, "int8").values())


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
def test_a_forced_vnni_runs_on_every_quantized_layer_with_the_eager_tokens(checkpoint, monkeypatch, quantization):
    """KVSERVE_GEMM=vnni: every layer packed for csrc/gemm.c runs vnni at every row count, in the C step and op by
    op alike (the same greedy tokens)."""
    _plan("vnni")
    monkeypatch.setenv(GEMM_ENV, "vnni")
    path = checkpoint("llama", dtype=torch.bfloat16, hidden_size=128, intermediate_size=256)
    prompts = [{"prompt_token_ids": list(range(3 + i, 30 + 3 * i))} for i in range(4)]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    outs = []
    for eager in (False, True):
        llm = LLM(str(path), block_size=4, num_kv_blocks=128, dtype="bfloat16", quantization=quantization,
                  enforce_eager=eager)
        report = llm.stats()["gemm"]
        assert report["source"] == f"{GEMM_ENV}=vnni" and set(report["vnni_from"].values()) == {1}
        linears = [m for m in llm.engine.model.modules() if isinstance(m, Linear) and m.own_gemm]
        assert linears and all(m.vnni_from == 1 and m.quantization == quantization for m in linears)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        assert (llm.stats()["steps"].get("native_multi_step", 0) > 0) == (not eager)
    assert outs[0] == outs[1]
