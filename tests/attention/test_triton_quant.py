"""The Triton kernels over quantized pages (kv_cache_dtype int8, fp8, int4) against the textbook
over the plain pages the QuantizedPages stand for (its blocks dequantized, the last one of most
sequences part full).

Without CUDA the kernels run in Triton's interpreter, with small tiles (see test_triton_attention)
so that short contexts span several key tiles, pages and decode partitions.
"""
from __future__ import annotations


import pytest
import torch

from triton_setup import DEVICE, SMALL_TILES, TOL, compile_for_hopper  # noqa: I001  (first: it sets TRITON_INTERPRET)

from attention_cases import make_case, quantize_case
from kvserve.attention.textbook import TextbookBackend
from kvserve.attention.triton import TritonBackend
from kvserve.kv.pages import FullPages

# ((query_len, context_len) per sequence, number of decodes). 40: two decode partitions of 32.
MIXED = ([(1, 40), (1, 3), (1, 21), (7, 20), (13, 13), (9, 31)], 3)   # prefixes and a fresh prompt
FRESH = ([(1, 33), (1, 9), (17, 17), (6, 6)], 2)                      # no prefix: the step's own K/V


def quantized_step(case, heads, kv_heads, head_dim, kv_cache_dtype, block_size, dtype=torch.float32, seed=0):
    """q, k, v, the QuantizedPages, the plain pages it stands for, and the batch."""
    seqs, num_decodes = case
    q_lens, ctx_lens = [n for n, _ in seqs], [c for _, c in seqs]
    q, k, v, kv_cache, batch = make_case(q_lens, ctx_lens, num_decodes, heads, kv_heads, head_dim,
                                         block_size=block_size, dtype=dtype, seed=seed)
    layer, pages = quantize_case(kv_cache, k, v, batch, kv_cache_dtype, block_size, DEVICE)
    nb = pages.shape[2]
    torch.testing.assert_close(layer.gather(torch.arange(nb, device=DEVICE)).cpu(), pages, atol=0, rtol=0)
    batch.block_tables, batch.context_lens = batch.block_tables.to(DEVICE), batch.context_lens.to(DEVICE)
    return q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), layer, pages.to(DEVICE), batch


def check(step) -> None:
    q, k, v, layer, pages, batch = step
    scale = q.shape[-1] ** -0.5
    out = TritonBackend(**SMALL_TILES).forward(q, k, v, layer, batch, scale)
    ref = TextbookBackend().forward(q, k, v, FullPages(pages), batch, scale)
    torch.testing.assert_close(out.float(), ref.float(), **TOL[q.dtype])


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8", "int4"])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(4, 4, 64, 5), (8, 2, 80, 16), (8, 1, 128, 5)])
def test_decodes_and_prefills_with_prefix(kv_cache_dtype, heads, kv_heads, head_dim, block_size):
    step = quantized_step(MIXED, heads, kv_heads, head_dim, kv_cache_dtype, block_size)
    assert step[-1].has_prefix
    check(step)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8", "int4"])
def test_decodes_and_fresh_prefills(kv_cache_dtype):
    """No prefix: the prefills attend to the step's own k, v (here the values the layer holds)."""
    step = quantized_step(FRESH, 8, 2, 80, kv_cache_dtype, 5)
    assert not step[-1].has_prefix
    check(step)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int4"])
def test_bfloat16_model(kv_cache_dtype):
    """Dequantized tiles in bf16, as the model's pages would be."""
    check(quantized_step(MIXED, 8, 2, 64, kv_cache_dtype, 16, dtype=torch.bfloat16))


def test_quantization_is_visible():
    """The reference is not the exact pages' answer: the check above tells the codecs apart."""
    seqs, num_decodes = MIXED
    q_lens, ctx_lens = [n for n, _ in seqs], [c for _, c in seqs]
    q, k, v, kv_cache, batch = make_case(q_lens, ctx_lens, num_decodes, 4, 2, 64, block_size=5)
    exact = TextbookBackend().forward(q, k, v, FullPages(kv_cache), batch, 0.125)
    _, pages = quantize_case(kv_cache, k, v, batch, "int8", 5)
    assert not torch.allclose(TextbookBackend().forward(q, k, v, FullPages(pages), batch, 0.125), exact, atol=1e-4)


# The interpreter checks no types: compile the quantized kernels for Hopper (sm_90) in a fresh
# process, as test_triton_attention does for the full-precision ones.
_COMPILE_FOR_HOPPER = r'''
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvserve.attention.triton import kernels as K

def build(fn, types, consts):
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if n not in consts and (sig[n].startswith("*") or n.startswith("stride"))}
    triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                   target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})

for quant, data in ((1, "*i8"), (2, "*u8"), (3, "*u8")):
    types = {"q_ptr": "*bf16", "out_ptr": "*bf16", "k_ptr": data, "v_ptr": data,
             "k_meta_ptr": "*fp16", "v_meta_ptr": "*fp16",
             "q_start_ptr": "*i32", "q_len_ptr": "*i32", "ctx_len_ptr": "*i32", "table_ptr": "*i64",
             "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "qk_scale": "fp32"}
    dims = {"HEAD_DIM": 80, "BLOCK_D": 128, "PAGE_SIZE": 16, "DOT_FP32": False, "KV_QUANT": quant}
    build(K._prefill_quant_kernel, types, {"GROUP": 4, "PAGED": True, "BLOCK_M": 64, "BLOCK_N": 64, **dims})
    build(K._decode_partition_quant_kernel, types, {"GROUP": 8, "PARTITION": 512, "BLOCK_G": 16, "BLOCK_N": 64,
                                                   **dims})
print("compiled")
'''


def test_quantized_kernels_compile_for_hopper():
    compile_for_hopper(_COMPILE_FOR_HOPPER)
