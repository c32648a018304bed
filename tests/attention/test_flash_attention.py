"""The CPU backends (flash, sdpa, native) against the textbook, on paged caches of awkward shapes."""
from __future__ import annotations

import pytest
import torch

from attention_cases import make_case
from kvserve.attention.flash import FlashBackend
from kvserve.attention.native import NativeBackend
from kvserve.attention.sdpa import SdpaBackend
from kvserve.attention.textbook import TextbookBackend
from kvserve.kv.pages import FullPages

CASES = [
    # q_lens, ctx_lens, num_decodes: decodes first, then prefills (fresh, or over a cached prefix)
    ([1, 1, 1], [1, 9, 33], 3),
    ([5, 17, 33], [5, 17, 33], 0),
    ([1, 1, 7, 13], [40, 3, 20, 13], 2),
    ([1, 31, 2], [70, 45, 2], 1),
]
SMALL_TILES = FlashBackend(q_tile=8, k_tile=12, decode_k_tile=12)
SHAPES = [(4, 4, 64), (8, 2, 80), (8, 1, 128), (4, 1, 96)]   # heads, kv heads (GQA 1/4/8/4), head_dim


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("backend", [SMALL_TILES, FlashBackend(), SdpaBackend(), NativeBackend()],
                         ids=["flash-small-tiles", "flash", "sdpa", "native"])
def test_backend_matches_textbook(backend, case, shape, dtype, tol):
    q_lens, ctx_lens, nd = case
    h, kvh, d = shape
    q, k, v, kv_cache, batch = make_case(q_lens, ctx_lens, nd, h, kvh, d, dtype=dtype, block_size=5)
    ref = TextbookBackend().forward(q, k, v, FullPages(kv_cache), batch, d ** -0.5)
    out = backend.forward(q, k, v, FullPages(kv_cache), batch, d ** -0.5)
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("backend", [SMALL_TILES, SdpaBackend()], ids=["flash", "sdpa"])
def test_no_cache_prefill_matches_textbook(backend):
    q, k, v, _, batch = make_case([5, 17, 1], [5, 17, 1], 0, 8, 2, 64, paged=False)
    ref = TextbookBackend().forward(q, k, v, None, batch, 0.125)
    torch.testing.assert_close(backend.forward(q, k, v, None, batch, 0.125), ref, atol=1e-5, rtol=1e-5)


def test_textbook_is_causal():
    """The oracle itself: a query never sees later keys, and its output moves when an earlier key does."""
    q, k, v, kv, batch = make_case([6], [6], 0, 2, 2, 64)
    out = TextbookBackend().forward(q, k, v, FullPages(kv), batch, 0.125)
    kv2 = kv.clone()
    kv2.view(2, 2, -1, 64)[:, :, batch.block_tables[0, 1] * 4 + 1] += 1.0   # position 5 (block 1, offset 1)
    moved = TextbookBackend().forward(q, k, v, FullPages(kv2), batch, 0.125)
    torch.testing.assert_close(moved[:5], out[:5])
    assert not torch.allclose(moved[5], out[5])
