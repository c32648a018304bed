"""csrc/gemm.c, the CPU's linear layers: against float64 on awkward shapes, and the fallbacks where it is not built."""
import ctypes

import pytest
import torch
import torch.nn.functional as F

from kvserve import kernels
from kvserve.model import layers
from kvserve.model.layers import GateUpLinear, Linear, gemm, gemm_pack

DTYPES = [torch.float32, torch.bfloat16]
# rows past a tile (14) and a row block (252), columns past a panel (32), k odd and past a chunk (256; bf16 512)
SHAPES = [(1, 1, 1), (3, 33, 7), (14, 32, 256), (15, 65, 257), (29, 100, 513), (64, 96, 1031), (253, 40, 300)]


def _own_gemm(dtype: torch.dtype) -> bool:
    return gemm_pack(torch.zeros(1, 1, dtype=dtype)) is not None


def _format(own: bool, dtype: torch.dtype) -> str:
    """The weight format of csrc/gemm.c (skip where it does not multiply dtype), or (own False) oneDNN's."""
    if own and not _own_gemm(dtype):
        pytest.skip(f"csrc/gemm.c does not multiply {dtype} on this CPU")
    return "gemm" if own else "onednn"


def _check(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    """Within the error of torch's own F.linear (float32), or one rounding of the exact sum (bfloat16)."""
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    err = (got.double() - exact).abs()
    if got.dtype == torch.float32:
        torch_err = (F.linear(x, w, b).double() - exact).abs().max().item()
        assert err.max().item() <= 4 * torch_err + 1e-6
    else:
        # the float32 sum rounded once to bfloat16: half an ulp (2^-8 relative), and the sum's own error
        assert (err <= exact.abs() * 2 ** -8 + 1e-3 * x.shape[-1] ** 0.5 * 2 ** -8).all()


def _amx_from(kernel: str, dtype: torch.dtype) -> int:
    """Linear.amx_from that runs `kernel` at every row count (skip where csrc/gemm.c has no such kernel)."""
    if kernel not in layers.gemm_kernels(dtype):
        pytest.skip(f"csrc/gemm.c has no {kernel} kernel for {dtype} on this CPU")
    return 1 if kernel == "amx" else layers.NEVER


KERNELS = [(torch.float32, "avx512"), (torch.bfloat16, "avx512"), (torch.bfloat16, "amx")]
# and for AMX's tiles: rows past a group of 16 and 32 and its block of rows (128 at k 2048), k past a tile (32)
AMX_SHAPES = [(16, 64, 64), (17, 32, 31), (35, 64, 2048), (300, 96, 2100)]


@pytest.mark.parametrize("dtype, kernel", KERNELS)
@pytest.mark.parametrize("m,n,k", SHAPES + AMX_SHAPES)
def test_gemm_matches_float64(dtype, kernel, m, n, k):
    amx_from = _amx_from(kernel, dtype)
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w, x, b = (torch.randn(*shape, generator=g).to(dtype) for shape in ((n, k), (m, k), (n,)))
    packed = gemm_pack(w)
    _check(gemm(x, packed, None, n, amx_from=amx_from), x, w, None)
    _check(gemm(x, packed, b, n, amx_from=amx_from), x, w, b)


@pytest.mark.parametrize("dtype, kernel", KERNELS)
def test_gemm_takes_strided_rows_and_leading_dimensions(dtype, kernel):
    amx_from = _amx_from(kernel, dtype)
    wide = torch.randn(2, 9, 90).to(dtype)
    x = wide[..., 7:77]                       # rows 90 numbers apart
    w = torch.randn(50, 70).to(dtype)
    out = gemm(x, gemm_pack(w), None, 50, amx_from=amx_from)
    assert out.shape == (2, 9, 50)
    _check(out.reshape(18, 50), x.reshape(18, 70), w, None)
    with pytest.raises(TypeError, match="dtype"):
        gemm(x.float() if dtype != torch.float32 else x.bfloat16(), gemm_pack(w), None, 50)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("own", [True, False])
def test_linear_packs_for_either_gemm_and_drops_the_plain_weight(dtype, own):
    """Linear.load holds the weight packed for csrc/gemm.c or for oneDNN's GEMM: both compute F.linear."""
    w, b, x = torch.randn(40, 24).to(dtype), torch.randn(40).to(dtype), torch.randn(3, 24).to(dtype)
    lin = Linear(24, 40, bias=True, dtype=dtype)
    lin.bias.data.copy_(b)
    assert lin.load(w.clone(), _format(own, dtype)) == _format(own, dtype)
    assert lin.own_gemm == own and lin.weight.numel() == 0 and lin.weight.dtype == dtype
    _check(lin(x), x, w, b)


def _swiglu_reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """silu(gate) * up from the exact products, rounded where a bfloat16 model rounds (float32: not)."""
    rnd = (lambda t: t.to(x.dtype).double()) if x.dtype == torch.bfloat16 else (lambda t: t)
    gate, up = rnd(F.linear(x.double(), w.double(), None if b is None else b.double())).chunk(2, dim=-1)
    return rnd(rnd(F.silu(gate)) * up)


@pytest.mark.parametrize("dtype, kernel", KERNELS)
@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (3, 33, 7), (15, 64, 257), (64, 100, 513), (253, 40, 300)])
def test_gated_gemm_writes_silu_of_gate_times_up(dtype, kernel, m, n, k):
    """A weight [gate; up] of 2n rows, packed gated: n outputs silu(gate) * up (n past a panel, and not
    a whole number of panels: gate and up columns stay paired), each half with its half of the bias."""
    amx_from = _amx_from(kernel, dtype)
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w, x, b = (torch.randn(*shape, generator=g).to(dtype) for shape in ((2 * n, k), (m, k), (2 * n,)))
    packed = gemm_pack(w, gated=True)
    for bias in (None, b):
        got, ref = gemm(x, packed, bias, n, gated=True, amx_from=amx_from).double(), _swiglu_reference(x, w, bias)
        # float32: the sums' error; bfloat16: a gate or up sum that rounds the other way moves a few ulps
        tol = 1e-5 * k ** 0.5 if dtype == torch.float32 else 2 ** -6
        assert ((got - ref).abs() <= tol * (ref.abs() + 1)).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("own", [True, False])
def test_gate_up_linear_is_swiglu_packed_or_not(dtype, own):
    w, x = torch.randn(80, 24).to(dtype), torch.randn(5, 24).to(dtype)
    lin = GateUpLinear(24, 80, bias=False, dtype=dtype)
    lin.load(w.clone(), "plain")
    unpacked = lin(x)
    assert lin.load(w.clone(), _format(own, dtype)) != "plain" and lin.own_gemm == own
    ref = _swiglu_reference(x, w, None)
    for out in (unpacked, lin(x)):
        assert out.shape == (5, 40)
        torch.testing.assert_close(out.double(), ref, rtol=2 ** -6, atol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemm_of_no_inputs_is_the_bias(dtype):
    if not _own_gemm(dtype):
        pytest.skip(f"csrc/gemm.c does not multiply {dtype} on this CPU")
    x, b = torch.empty(3, 0, dtype=dtype), torch.arange(4.0).to(dtype)
    assert torch.equal(gemm(x, gemm_pack(torch.empty(4, 0, dtype=dtype)), b, 4), b.expand(3, 4))


def test_linear_leaves_float16_to_torch():
    lin = Linear(8, 4, bias=False, dtype=torch.float16)
    assert not lin.pack() and lin.packed is None


@pytest.mark.parametrize("flags,dtypes", [("-mno-avx512f", 3), ("-mno-avx512bw", 3), ("-mno-avx512bf16", 1),
                                          ("-mno-avx2", 0)])
def test_builds_without_the_instructions_say_so(flags, dtypes, tmp_path, monkeypatch):
    """A build without AVX-512 (F, BW) multiplies both dtypes by its AVX2 tiles; one without AVX-512's BF16
    extension, float32 only; one with neither AVX-512 nor AVX2, none. It reports the dtypes it cannot multiply,
    which then go to oneDNN."""
    if kernels.library() is None:
        pytest.skip("no C compiler")
    wrapper = tmp_path / "cc-flags"
    wrapper.write_text(f'#!/bin/sh\nexec cc {flags} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("CC", str(wrapper))
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(kernels.MARCH_ENV, "native")          # the flags take instructions from this CPU's
    library = ctypes.CDLL(str(kernels.build()))
    assert kernels.typed(library, "gemm_dtypes")() == dtypes


def test_strict_mode_raises_where_a_linear_layer_would_fall_back(monkeypatch):
    """Under KVSERVE_STRICT_KERNELS=1, a weight csrc/gemm.c does not pack, or oneDNN cannot, is an error
    naming the packing; without it, the layer is left to torch's F.linear."""
    monkeypatch.setattr(layers, "_gemm_function", lambda *args: None)
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    monkeypatch.setenv(kernels.STRICT_ENV, "1")
    with pytest.raises(RuntimeError, match="gemm_pack did not run: csrc/gemm.c does not multiply torch.float32"):
        gemm_pack(torch.zeros(4, 4))
    with pytest.raises(RuntimeError, match="onednn_pack did not run: this build of torch has no oneDNN"):
        layers.onednn_pack(torch.zeros(4, 4))
    monkeypatch.setenv(kernels.STRICT_ENV, "0")
    lin = Linear(4, 4, bias=False)
    for weight_format in ("gemm", "onednn"):
        assert lin.load(torch.zeros(4, 4), weight_format) == "plain"
        assert lin.packed is None and lin.weight.numel() == 16


def test_amx_runs_where_asked():
    """AMX's tiles sum in another order than AVX-512's: over a few thousand outputs, some round the other way.
    Bit-equal outputs would mean the AMX kernel did not run (AVX-512's ran in its place)."""
    amx_from = _amx_from("amx", torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(96, 2048, generator=g).bfloat16(), torch.randn(64, 2048, generator=g).bfloat16()
    packed = gemm_pack(w)
    amx, avx512 = gemm(x, packed, None, 96, amx_from=amx_from), gemm(x, packed, None, 96)
    assert not torch.equal(amx, avx512)
    _check(amx, x, w, None)
