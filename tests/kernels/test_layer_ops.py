"""The C kernels of the layer ops (csrc/layer_ops.c) against the same ops in torch, on awkward shapes."""
from __future__ import annotations

import shutil

import pytest
import torch

from kvserve.kernels import STRICT_ENV, library
from kvserve.kv.pages import FullPages
from kvserve.model import layers

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")


def test_the_kernels_build():
    assert library() is not None        # else every comparison below would be torch against torch


DTYPES = [(torch.float32, 2e-6), (torch.bfloat16, 0.0)]


@pytest.fixture
def torch_ops(monkeypatch):
    """A context in which the layer ops run in torch (as where the kernels cannot be built)."""
    def run(fn):
        with monkeypatch.context() as m:
            m.setattr(layers, "function", lambda *args: None)
            return fn()
    return run


@pytest.mark.parametrize("dtype, tol", DTYPES)
@pytest.mark.parametrize("rows, dim", [(1, 80), (7, 37), (300, 512)])   # 300 x 512: shared between threads
def test_add_rms_norm_is_torchs(rows, dim, dtype, tol, torch_ops):
    g = torch.Generator().manual_seed(rows)
    norm = layers.RMSNorm(dim, 1e-5)
    norm.weight.data = torch.randn(dim, generator=g).to(dtype)
    x, residual = (torch.randn(rows, dim, generator=g).to(dtype) * 3 for _ in range(2))
    ref_out, ref_residual = torch_ops(lambda: norm(x, residual.clone()))
    out, new_residual = norm(x, residual)
    assert new_residual is residual          # in place, as torch's path adds
    torch.testing.assert_close(new_residual, ref_residual, atol=0, rtol=0)
    # bfloat16 sums of squares in another order can round the normalised number the other way
    # float32: sums of squares in another order (and unvectorized in sanitizer builds) move a few ulp
    atol = tol if dtype == torch.float32 else 2 * (out.float().abs().max() * 2 ** -8).item()
    torch.testing.assert_close(out.float(), ref_out.float(), atol=atol, rtol=1e-6 if dtype == torch.float32 else 0)
    if dtype == torch.bfloat16:
        assert (out != ref_out).float().mean() < 0.01
    torch.testing.assert_close(norm(x), torch_ops(lambda: norm(x)), atol=atol, rtol=0)


@pytest.mark.parametrize("dtype, tol", DTYPES)
@pytest.mark.parametrize("tokens, heads, extra, d", [(1, 3, 2, 24), (5, 10, 4, 64), (700, 10, 4, 80),
                                                     (3, 2, 0, 128)])
def test_rope_of_q_and_k_views_is_torchs(tokens, heads, extra, d, dtype, tol, torch_ops):
    """q and k are the first heads of each token's qkv row: rotated in place, the rest untouched."""
    g = torch.Generator().manual_seed(d)
    qkv = torch.randn(tokens, (heads + extra) * d, generator=g).to(dtype)
    rope = layers.RotaryEmbedding(d, 1024, 10000.0, None, torch.device("cpu"))
    cos, sin = rope(torch.randint(0, 1024, (tokens,), generator=g), dtype)
    ref, before = qkv.clone(), qkv.clone()
    torch_ops(lambda: layers.apply_rope_(ref[:, :heads * d].view(tokens, heads, d), cos, sin))
    layers.apply_rope_(qkv[:, :heads * d].view(tokens, heads, d), cos, sin)
    torch.testing.assert_close(qkv, ref, atol=tol, rtol=0)
    assert torch.equal(qkv[:, heads * d:], before[:, heads * d:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_store_kv_writes_what_index_copy_writes(dtype, monkeypatch):
    g = torch.Generator().manual_seed(0)
    kvh, d, nb, bs, tokens = 3, 24, 9, 5, 11
    qkv = torch.randn(tokens, (4 + 2 * kvh) * d, generator=g).to(dtype)
    kv = qkv[:, 4 * d:].view(tokens, 2, kvh, d)               # K/V of each token: a view of its qkv row
    slots = torch.randperm(nb * bs, generator=g)[:tokens]
    cache, ref = torch.zeros(2, kvh, nb, bs, d, dtype=dtype), torch.zeros(2, kvh, nb, bs, d, dtype=dtype)
    FullPages(cache).write_tokens(kv, slots)
    monkeypatch.setenv(STRICT_ENV, "0")
    monkeypatch.setattr("kvserve.kv.pages.function", lambda *args: None)
    FullPages(ref).write_tokens(kv, slots)
    assert torch.equal(cache, ref) and ref.abs().sum() > 0


def test_store_kv_skips_a_padding_slot():
    kv = torch.randn(2, 2, 1, 8)
    cache = torch.zeros(2, 1, 3, 4, 8)
    FullPages(cache).write_tokens(kv, torch.tensor([-1, 5]))
    assert torch.equal(cache.view(2, 1, 12, 8)[:, 0, 5], kv[1, :, 0]) and cache.abs().sum() == kv[1].abs().sum()
