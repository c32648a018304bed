"""The native backend's C kernel: it builds where a C compiler exists, and falls back to sdpa where not."""
from __future__ import annotations

import ctypes
import platform
import shutil
import tempfile

import pytest
import torch

from attention_cases import make_case, quantize_case
from kvserve import kernels
from kvserve.kernels import DTYPE_KINDS
from kvserve.attention import native
from kvserve.attention.native import NativeBackend, paged_decode
from kvserve.attention.sdpa import SdpaBackend
from kvserve.attention.textbook import TextbookBackend
from kvserve.kv.pages import FullPages


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_the_kernel_builds_and_reads_every_kind_of_page():
    assert native.kernel() is not None
    q, k, v, kv_cache, batch = make_case([1, 1], [9, 30], 2, 4, 2, 64, block_size=4)
    args = (batch.block_tables, batch.context_lens, 0.125)
    assert paged_decode(q, FullPages(kv_cache), *args) is not None
    for kind in ("int8", "fp8", "int4"):
        layer, _ = quantize_case(kv_cache, k, v, batch, kind, 4)
        assert paged_decode(q, layer, *args) is not None


@pytest.mark.parametrize("q_lens", [[1, 1], [1, 1, 5]], ids=["decode", "prefill"])
def test_without_the_kernels_attention_is_sdpas(monkeypatch, q_lens):
    monkeypatch.setenv(kernels.STRICT_ENV, "0")
    monkeypatch.setattr(native, "kernel", lambda: None)
    monkeypatch.setattr(native, "prefill_kernel", lambda: None)
    q, k, v, kv_cache, batch = make_case(q_lens, [9, 30, 5][:len(q_lens)], 2, 4, 2, 64, block_size=4)
    backend = NativeBackend()
    torch.testing.assert_close(backend.forward(q, k, v, FullPages(kv_cache), batch, 0.125),
                               SdpaBackend().forward(q, k, v, FullPages(kv_cache), batch, 0.125))
    assert not backend.calls


@pytest.mark.parametrize("q_lens, kernel", [([1, 1], "paged_decode"), ([1, 1, 5], "paged_prefill")])
def test_strict_mode_raises_where_the_kernel_does_not_run(monkeypatch, q_lens, kernel):
    """Pages the kernel does not read (not contiguous) are not a silent fallback to sdpa: the error names the
    kernel and why."""
    monkeypatch.setenv(kernels.STRICT_ENV, "1")
    q, k, v, kv_cache, batch = make_case(q_lens, [9, 30, 5][:len(q_lens)], 2, 4, 2, 64, block_size=4)
    strided = torch.cat((kv_cache, kv_cache), -1)[..., :64]
    with pytest.raises(RuntimeError, match=f"{kernel} did not run: it does not read this cache"):
        NativeBackend().forward(q, k, v, FullPages(strided), batch, 0.125)


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_the_kernel_builds_in_the_temporary_directory_when_the_cache_is_not_writable(tmp_path, monkeypatch):
    (tmp_path / "not-a-directory").write_text("")
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path / "not-a-directory"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    library = kernels.build()
    assert library.is_relative_to(tmp_path / "tmp") and library.stat().st_size > 0


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("block_size", [16, 37])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(8, 2, 72), (8, 1, 128), (4, 4, 24)])
def test_decode_in_blocks_of_sixteen_keys_and_a_rest(block_size, heads, kv_heads, head_dim, dtype, tol):
    """The kernel scores keys sixteen at a time: whole groups, a partial last one, head_dims not
    a multiple of sixteen; bfloat16 pages are widened as they are loaded."""
    ctx = [1, 15, 16, 17, 40, 75]
    q, k, v, kv_cache, batch = make_case([1] * len(ctx), ctx, len(ctx), heads, kv_heads, head_dim,
                                         block_size=block_size, dtype=dtype)
    ref = TextbookBackend().forward(q.float(), k.float(), v.float(), FullPages(kv_cache.float()), batch,
                                    head_dim ** -0.5)
    out = paged_decode(q, FullPages(kv_cache), batch.block_tables, batch.context_lens, head_dim ** -0.5)
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("q_dtype, tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-5)])
@pytest.mark.parametrize("block_size", [16, 5, 37])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(8, 1, 64), (3, 1, 32), (24, 2, 128), (2, 2, 256)])
def test_decode_over_bfloat16_pages_scores_keys_in_lanes(heads, kv_heads, head_dim, block_size, q_dtype, tol):
    """Decode over bfloat16 pages, head_dim a multiple of 32: sixteen keys a vector, query heads eight at a time
    (groups of 1, 3, 8 and 12), contexts across its 64-key steps and 16-key chunks, blocks that split a chunk,
    sliding windows and soft caps; float32 queries that are not bfloat16 numbers are not rounded."""
    groups = heads // kv_heads
    if not kernels.function("keys_in_lanes")(DTYPE_KINDS[torch.bfloat16], head_dim, groups, 1):
        pytest.skip("this build of the kernels has no keys-in-lanes decode (no AVX-512 BW)")
    assert not kernels.function("keys_in_lanes")(DTYPE_KINDS[torch.float32], head_dim, groups, 1)
    ctx = [1, 15, 16, 17, 63, 64, 65, 129, 200]
    q, k, v, kv_cache, batch = make_case([1] * len(ctx), ctx, len(ctx), heads, kv_heads, head_dim,
                                         block_size=block_size, dtype=torch.bfloat16)
    if q_dtype == torch.float32:
        q = q.float() + torch.randn(q.shape, generator=torch.Generator().manual_seed(1)) * 1e-3
    for window, cap in ((None, None), (50, None), (None, 3.0), (20, 1.5)):
        ref = TextbookBackend().forward(q.float(), k.float(), v.float(), FullPages(kv_cache.float()), batch,
                                        head_dim ** -0.5, window, cap)
        out = paged_decode(q, FullPages(kv_cache), batch.block_tables, batch.context_lens, head_dim ** -0.5, window,
                           cap)
        assert out.dtype == q_dtype
        torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(8, 2, 72), (8, 1, 128), (4, 4, 24), (16, 1, 64)])
def test_prefill_in_causal_tiles_matches_the_textbook(heads, kv_heads, head_dim, block_size, dtype, tol):
    """Prompts of lengths that are not whole tiles, fresh or after a cached prefix, beside decodes:
    each token sees exactly the keys up to its own (16 // G tokens a tile; one when G is 16), over
    blocks that make steps of 64 keys (16) or of 60 and a rest (5); bfloat16 queries and pages are
    scored in pairs where the CPU has AVX-512 BF16."""
    q_lens, ctx = [1, 1, 37, 16, 5, 50], [20, 33, 37, 16, 61, 90]
    q, k, v, kv_cache, batch = make_case(q_lens, ctx, 2, heads, kv_heads, head_dim, block_size=block_size,
                                         dtype=dtype)
    ref = TextbookBackend().forward(q.float(), k.float(), v.float(), FullPages(kv_cache.float()), batch,
                                    head_dim ** -0.5)
    backend = NativeBackend()
    out = backend.forward(q, k, v, FullPages(kv_cache), batch, head_dim ** -0.5)
    assert out.dtype == dtype and backend.calls == {"paged_prefill": 1}
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


def test_float32_queries_over_bfloat16_pages_are_not_rounded():
    """Queries that are not bfloat16 numbers are scored as they are, not in bfloat16 pairs."""
    q, k, v, kv_cache, batch = make_case([1, 1, 9], [30, 17, 40], 2, 8, 2, 64, block_size=16, dtype=torch.bfloat16)
    q = q.float() + torch.randn(q.shape, generator=torch.Generator().manual_seed(1)) * 1e-3
    ref = TextbookBackend().forward(q, k.float(), v.float(), FullPages(kv_cache.float()), batch, 64 ** -0.5)
    backend = NativeBackend()
    torch.testing.assert_close(backend.forward(q, k, v, FullPages(kv_cache), batch, 64 ** -0.5), ref, atol=1e-5,
                               rtol=1e-5)
    assert backend.calls == {"paged_prefill": 1}


@pytest.mark.parametrize("tokens", [6, 20], ids=["tile-of-12-rows", "tile-of-32-rows"])
def test_prefill_rows_that_see_no_key_are_zero_not_nan(tokens):
    """Tokens whose causal window holds no cached key (a context shorter than the step's tokens: not
    something the engine schedules) come out 0, and the rest are not poisoned; in tiles of a few rows,
    and of 16 or more (rows in lanes)."""
    q, k, v, kv_cache, batch = make_case([tokens], [tokens], 0, 4, 2, 24, block_size=4)
    batch.context_lens = torch.tensor([tokens - 2])      # tokens 0 and 1 see nothing; token r sees r - 1
    out = native.paged_prefill(q, FullPages(kv_cache), batch.block_tables, batch.context_lens,
                               torch.tensor([0, tokens]), 24 ** -0.5)
    assert not out.isnan().any() and not out[:2].any() and out[2:].abs().sum(-1).all()


def test_a_block_as_long_as_a_whole_context_decodes():
    # cache_mode "contiguous" makes one block of max_model_len tokens: its rows must not live on a
    # thread's stack (32768 x 128 floats are 16 MiB, past the usual 8 MiB)
    q, k, v, kv_cache, batch = make_case([1, 1], [20000, 32768], 2, 4, 2, 128, block_size=32768)
    ref = TextbookBackend().forward(q, k, v, FullPages(kv_cache), batch, 128 ** -0.5)
    backend = NativeBackend()
    torch.testing.assert_close(backend.forward(q, k, v, FullPages(kv_cache), batch, 128 ** -0.5), ref, atol=1e-5,
                               rtol=1e-5)
    assert backend.calls == {"paged_decode": 1}


@pytest.mark.skipif(shutil.which("cc") is None or platform.machine() != "x86_64", reason="no C compiler, or not x86")
def test_the_portable_fallbacks_compute_the_same(tmp_path, monkeypatch):
    """CPUs without AVX-512 run the kernels' plain C loops: built so here, they decode as the textbook does, within
    sliding windows and with soft-capped scores too."""
    wrapper = tmp_path / "cc-no-avx512"
    wrapper.write_text('#!/bin/sh\nexec cc -mno-avx512f "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("CC", str(wrapper))
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path / "cache"))
    library = ctypes.CDLL(str(kernels.build()))
    for name, getter in (("paged_decode", "kernel"), ("paged_prefill", "prefill_kernel")):
        monkeypatch.setattr(native, getter, lambda portable=kernels.typed(library, name): portable)
    for heads, kv_heads, head_dim in [(4, 4, 64), (8, 2, 80), (4, 1, 24)]:
        q, k, v, kv_cache, batch = make_case([1, 1, 1], [9, 30, 17], 3, heads, kv_heads, head_dim, block_size=4)
        ref = TextbookBackend().forward(q, k, v, FullPages(kv_cache), batch, head_dim ** -0.5)
        out = paged_decode(q, FullPages(kv_cache), batch.block_tables, batch.context_lens, head_dim ** -0.5)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        q, k, v, kv_cache, batch = make_case([1, 9, 21], [9, 30, 21], 1, heads, kv_heads, head_dim, block_size=4)
        for limits in ((None, None), (5, 1.5)):       # (sliding window, soft cap)
            ref = TextbookBackend().forward(q, k, v, FullPages(kv_cache), batch, head_dim ** -0.5, *limits)
            out = NativeBackend().forward(q, k, v, FullPages(kv_cache), batch, head_dim ** -0.5, *limits)
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
