"""Sliding windows and soft-capped scores in the Triton kernels, against the textbook (in Triton's interpreter
where there is no GPU: see triton_setup)."""
from __future__ import annotations

import pytest
import torch

from triton_setup import DEVICE, SMALL_TILES, TOL  # noqa: I001  (first: it sets TRITON_INTERPRET)

from attention_cases import make_case, quantize_case
from kvserve.attention.textbook import TextbookBackend
from kvserve.attention.triton import TritonBackend
from kvserve.kv.pages import FullPages

CASES = {
    # q_lens, ctx_lens, num_decodes: contexts past two partitions of 32 keys (SMALL_TILES), and shorter
    "decode": ([1, 1, 1], [5, 40, 75], 3),
    "prefill": ([37, 9], [37, 9], 0),
    "chunks": ([1, 21, 3], [50, 40, 11], 1),
}
LIMITS = [(3, None), (20, None), (20, 1.5)]


def _case(case: str, **kw):
    q_lens, ctx_lens, nd = CASES[case]
    q, k, v, kv_cache, batch = make_case(q_lens, ctx_lens, nd, 4, 2, 16, block_size=4, **kw)
    return q, k, v, kv_cache, batch


def _on_device(batch):
    batch.context_lens = batch.context_lens.to(DEVICE)
    if batch.block_tables is not None:
        batch.block_tables = batch.block_tables.to(DEVICE)
    return batch


@pytest.mark.parametrize("window, cap", LIMITS, ids=lambda x: str(x))
@pytest.mark.parametrize("case", CASES)
def test_triton_matches_textbook_within_windows_and_caps(case, window, cap):
    q, k, v, kv_cache, batch = _case(case)
    ref = TextbookBackend().forward(q, k, v, FullPages(kv_cache), batch, 0.25, window, cap)
    full = TextbookBackend().forward(q, k, v, FullPages(kv_cache), batch, 0.25)
    assert (full - ref).abs().max() > 1e-2                # the limits matter here
    dev = [t.to(DEVICE) for t in (q, k, v)]
    out = TritonBackend(**SMALL_TILES).forward(*dev, FullPages(kv_cache.to(DEVICE)), _on_device(batch), 0.25,
                                               sliding_window=window,
                                               logits_soft_cap=cap)
    torch.testing.assert_close(out.cpu(), ref, **TOL[torch.float32])


@pytest.mark.parametrize("window, cap", LIMITS, ids=lambda x: str(x))
def test_triton_no_cache_prefill_within_windows(window, cap):
    q, k, v, _, batch = make_case([37, 9], [37, 9], 0, 4, 2, 16, paged=False)
    ref = TextbookBackend().forward(q, k, v, None, batch, 0.25, window, cap)
    out = TritonBackend(**SMALL_TILES).forward(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), None, _on_device(batch),
                                               0.25, sliding_window=window, logits_soft_cap=cap)
    torch.testing.assert_close(out.cpu(), ref, **TOL[torch.float32])


@pytest.mark.parametrize("case", ["decode", "chunks"])
def test_triton_quantized_pages_within_windows(case):
    q, k, v, kv_cache, batch = _case(case)
    layer, pages = quantize_case(kv_cache, k, v, batch, "int8", 4, DEVICE)
    ref = TextbookBackend().forward(q, k, v, FullPages(pages), batch, 0.25, 20, 1.5)
    out = TritonBackend(**SMALL_TILES).forward(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), layer, _on_device(batch),
                                               0.25, sliding_window=20, logits_soft_cap=1.5)
    torch.testing.assert_close(out.cpu(), ref, atol=1e-4, rtol=1e-4)
