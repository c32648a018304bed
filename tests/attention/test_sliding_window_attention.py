"""Sliding windows and soft-capped scores in the CPU backends (sdpa, flash, native), against the textbook."""
from __future__ import annotations

import pytest
import torch

from attention_cases import make_case, quantize_case
from kvserve.attention.flash import FlashBackend
from kvserve.attention.native import NativeBackend
from kvserve.attention.sdpa import SdpaBackend
from kvserve.attention.textbook import TextbookBackend
from kvserve.kv.pages import FullPages

CASES = {
    # q_lens, ctx_lens, num_decodes: contexts shorter than, as long as and longer than the windows
    "decode": ([1, 1, 1, 1], [3, 8, 21, 46], 4),
    "prefill": ([19, 8, 37], [19, 8, 37], 0),
    # a decode, then prompt chunks after cached prefixes that end inside a block and inside a window
    "chunks": ([1, 7, 12, 3], [30, 19, 33, 11], 1),
}
# (window, soft cap): a window shorter than a block (4), one of two blocks, a cap alone and both
LIMITS = [(3, None), (8, None), (None, 1.5), (8, 1.5)]
BACKENDS = {"sdpa": SdpaBackend, "flash": lambda: FlashBackend(q_tile=8, k_tile=12, decode_k_tile=12),
            "native": NativeBackend}


def _run(backend, case: str, window, cap, dtype=torch.float32, **shape):
    q_lens, ctx_lens, nd = CASES[case]
    shape = {"num_heads": 8, "num_kv_heads": 2, "head_dim": 32} | shape
    q, k, v, kv_cache, batch = make_case(q_lens, ctx_lens, nd, **shape, block_size=4, dtype=dtype)
    scale = shape["head_dim"] ** -0.5
    ref = TextbookBackend().forward(q.float(), k.float(), v.float(), FullPages(kv_cache.float()), batch, scale, window,
                                    cap)
    out = backend.forward(q, k, v, FullPages(kv_cache), batch, scale, sliding_window=window, logits_soft_cap=cap)
    # the window and the cap change these outputs: a backend that ignored them would not match
    full = TextbookBackend().forward(q.float(), k.float(), v.float(), FullPages(kv_cache.float()), batch, scale)
    assert (full - ref).abs().max() > 1e-2
    return out, ref


@pytest.mark.parametrize("window, cap", LIMITS, ids=lambda x: str(x))
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("name", BACKENDS)
def test_backend_matches_textbook_within_windows_and_caps(name, case, window, cap):
    out, ref = _run(BACKENDS[name](), case, window, cap)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("heads, kv_heads", [(8, 2), (16, 1)], ids=["rows", "rows-in-lanes"])
@pytest.mark.parametrize("case", ["prefill", "chunks"])
def test_native_bfloat16_pairs_within_windows(case, heads, kv_heads):
    """bfloat16 pages scored by pairs, in tiles of a few rows and of rows in vector lanes (16 query heads a
    token), whose steps start at a window's first block."""
    backend = NativeBackend()
    out, ref = _run(backend, case, 8, 1.5, torch.bfloat16, num_heads=heads, num_kv_heads=kv_heads)
    torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)
    assert backend.calls == {"paged_prefill": 1}


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("name", ["sdpa", "native"])
def test_quantized_pages_within_windows(name, kind):
    q_lens, ctx_lens, nd = [1, 1, 6], [13, 30, 22], 2
    q, k, v, kv_cache, batch = make_case(q_lens, ctx_lens, nd, 8, 2, 32, block_size=4)
    layer, pages = quantize_case(kv_cache, k, v, batch, kind, 4)
    ref = TextbookBackend().forward(q, k, v, FullPages(pages), batch, 32 ** -0.5, 8, 1.5)
    out = BACKENDS[name]().forward(q, k, v, layer, batch, 32 ** -0.5, sliding_window=8, logits_soft_cap=1.5)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("window, cap", LIMITS, ids=lambda x: str(x))
@pytest.mark.parametrize("name", ["sdpa", "flash"])
def test_no_cache_prefill_within_windows(name, window, cap):
    q, k, v, _, batch = make_case([19, 6, 11], [19, 6, 11], 0, 8, 2, 32, paged=False)
    ref = TextbookBackend().forward(q, k, v, None, batch, 0.2, window, cap)
    out = BACKENDS[name]().forward(q, k, v, None, batch, 0.2, sliding_window=window, logits_soft_cap=cap)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_textbook_sees_only_its_window():
    """The oracle itself: a query at position p moves with the keys (p - W, p] and with no other."""
    q, k, v, kv, batch = make_case([1], [12], 1, 2, 2, 16)                 # the query sits at position 11
    out = TextbookBackend().forward(q, k, v, FullPages(kv), batch, 0.25, sliding_window=5)
    for pos, inside in ((6, False), (7, True), (11, True)):
        moved = kv.clone()
        moved.view(2, 2, -1, 16)[:, :, batch.block_tables[0, pos // 4] * 4 + pos % 4] += 1.0
        changed = TextbookBackend().forward(q, k, v, FullPages(moved), batch, 0.25, sliding_window=5)
        assert torch.equal(changed, out) != inside, pos


def test_textbook_soft_cap_bounds_the_scores():
    """cap * tanh(s / cap): with a cap far above every score, the plain softmax; with a tiny one, nearly
    uniform weights."""
    q, k, v, kv, batch = make_case([1], [9], 1, 2, 2, 16)
    plain = TextbookBackend().forward(q, k, v, FullPages(kv), batch, 0.25)
    huge = TextbookBackend().forward(q, k, v, FullPages(kv), batch, 0.25, logits_soft_cap=1e6)
    torch.testing.assert_close(huge, plain)
    flat = TextbookBackend().forward(q, k, v, FullPages(kv), batch, 0.25, logits_soft_cap=1e-6)
    values = kv[1][:, batch.block_tables[0]].flatten(1, 2)[:, :9].mean(1)  # [KVH, D]: every key alike
    torch.testing.assert_close(flat[0], values, atol=1e-4, rtol=1e-4)
