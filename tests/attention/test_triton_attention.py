"""The Triton kernels against the textbook recipe, on small awkward shapes.

Without CUDA the kernels run in Triton's interpreter (numpy on the CPU): TRITON_INTERPRET must be
set before the kernels are decorated, i.e. before kvserve.attention.triton is first imported.
Tiles are kept small (16) so that short sequences still span several query tiles, key tiles,
pages and decode partitions, and lengths are chosen not to be multiples of any of them.
"""
from __future__ import annotations


import pytest
import torch

from triton_setup import DEVICE, SMALL_TILES, TOL, compile_for_hopper  # noqa: I001  (first: it sets TRITON_INTERPRET)

from kvserve.attention.batch import AttentionBatch
from kvserve.attention.gather import gather_context
from kvserve.attention.textbook import TextbookBackend, attend
from kvserve.attention.triton import TritonBackend, kernels, store_kv
from kvserve.kv.pages import FullPages


class Step:
    """One engine step built by hand, as ModelRunner.prepare would: q, k, v as views of a fused qkv
    (non-contiguous, like the decoder's), a cache of random garbage whose pages are handed out in
    shuffled order, the step's K/V stored at slot_mapping, the prefix tokens already in the cache."""

    def __init__(self, seqs: list[tuple[int, int]], num_decodes: int, heads: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, page_size: int, seed: int = 0, cache: bool = True):
        gen = torch.Generator().manual_seed(seed)

        def rand(*shape):
            return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)
        self.seqs, self.heads, self.kv_heads, self.head_dim = seqs, heads, kv_heads, head_dim
        q_lens, ctx_lens = [q for q, _ in seqs], [c for _, c in seqs]
        tokens = sum(q_lens)
        qkv = rand(tokens, (heads + 2 * kv_heads) * head_dim)
        self.q = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)
        kv = qkv[:, heads * head_dim:].view(tokens, 2, kv_heads, head_dim)
        self.k, self.v = kv[:, 0], kv[:, 1]
        self.scale = head_dim ** -0.5
        self.kv_cache = slot_mapping = block_tables = None
        if cache:
            tables = _shuffled_tables(ctx_lens, page_size, gen)
            num_blocks = max(max(t) for t in tables) + 3
            self.kv_cache = FullPages(rand(2, kv_heads, num_blocks, page_size, head_dim))
            width = max(len(t) for t in tables)
            block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], device=DEVICE)
            slots = [t[p // page_size] * page_size + p % page_size
                     for t, q, c in zip(tables, q_lens, ctx_lens) for p in range(c - q, c)]
            slot_mapping = torch.tensor(slots, device=DEVICE)
            self.kv_cache.write_tokens(kv, slot_mapping)
        self.batch = AttentionBatch(
            num_decodes=num_decodes, slot_mapping=slot_mapping, block_tables=block_tables,
            context_lens=torch.tensor(ctx_lens, device=DEVICE), query_lens=q_lens, context_lens_list=ctx_lens,
            has_prefix=any(c > q for q, c in seqs[num_decodes:]))

    def run(self, backend) -> torch.Tensor:
        return backend.forward(self.q, self.k, self.v, self.kv_cache, self.batch, self.scale)

    def shifted_reference(self, shift: int) -> torch.Tensor:
        """The textbook output with every query's position moved by `shift`: what an off-by-one in
        the causal offset would produce. A kernel that matches it instead of the truth must fail."""
        out = torch.empty_like(self.q)
        start = 0
        for i, (q_len, ctx_len) in enumerate(self.seqs):
            end = start + q_len
            if self.kv_cache is None:
                keys, values = self.k[start:end], self.v[start:end]
            else:
                pages = gather_context(self.kv_cache, self.batch.block_tables[i:i + 1], ctx_len)
                keys, values = pages[:, :, 0].transpose(1, 2)
            offset = max(ctx_len - q_len + shift, 0)   # never below 0: key 0 stays visible
            out[start:end] = attend(self.q[start:end], keys, values, self.scale, offset)
            start = end
        return out


def _shuffled_tables(ctx_lens: list[int], page_size: int, gen: torch.Generator) -> list[list[int]]:
    """Each sequence's pages, drawn from a shuffled pool (page 0 included, so the tables' 0 padding
    points at somebody else's data), with unused pages left between them."""
    needed = [-(-c // page_size) for c in ctx_lens]
    pool = torch.randperm(2 * sum(needed) + 1, generator=gen).tolist()
    tables, taken = [], 0
    for n in needed:
        tables.append(pool[taken:taken + n])
        taken += 2 * n   # skip as many: they hold garbage a paging bug would read
    return tables


def check(step: Step, backend: TritonBackend) -> None:
    out = step.run(backend)
    ref = step.run(TextbookBackend())
    tol = TOL[step.q.dtype]
    torch.testing.assert_close(out.float(), ref.float(), **tol)
    # The inputs must tell the right causal offset from its neighbours, or the check above is moot.
    for shift in (-1, 1):
        wrong = step.shifted_reference(shift)
        if not torch.equal(wrong, ref):
            assert (out.float() - wrong.float()).abs().max() > 20 * tol["atol"], f"matches offset shift {shift}"


# ------------------------------------------------------------------------------------------------
# store
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,head_dim,kv_heads,page_size", [
    (torch.float32, 80, 3, 5), (torch.bfloat16, 128, 8, 16), (torch.float16, 64, 1, 1)])
def test_store_kv_matches_kvstorage_write(dtype, head_dim, kv_heads, page_size):
    gen = torch.Generator().manual_seed(1)
    tokens, num_blocks = 13, 16
    kv = torch.randn(tokens, 2, kv_heads, head_dim + 8, generator=gen).to(dtype).to(DEVICE)[..., :head_dim]
    cache = torch.randn(2, kv_heads, num_blocks, page_size, head_dim, generator=gen).to(dtype).to(DEVICE)
    slots = torch.randperm(num_blocks * page_size, generator=gen)[:tokens].to(DEVICE)
    expected = cache.clone()
    FullPages(expected).write_tokens(kv.contiguous(), slots)
    store_kv(cache, kv[:, 0], kv[:, 1], slots)
    assert torch.equal(cache, expected)


def test_store_kv_skips_negative_slots():
    kv = torch.randn(3, 2, 2, 64, device=DEVICE)
    cache = torch.zeros(2, 2, 2, 4, 64, device=DEVICE)
    store_kv(cache, kv[:, 0], kv[:, 1], torch.tensor([5, -1, 0], device=DEVICE))
    expected = torch.zeros_like(cache)
    FullPages(expected).write_tokens(kv[[0, 2]], torch.tensor([5, 0], device=DEVICE))
    assert torch.equal(cache, expected)


# ------------------------------------------------------------------------------------------------
# prefill
# ------------------------------------------------------------------------------------------------

PREFIX_SEQS = [(5, 5), (17, 40), (1, 18), (33, 50), (16, 17)]   # (query_len, context_len)


@pytest.mark.parametrize("head_dim,heads,kv_heads,dtype,page_size", [
    (64, 4, 4, torch.float32, 4),
    (80, 8, 2, torch.float32, 5),
    (96, 8, 1, torch.bfloat16, 16),
    (128, 4, 1, torch.bfloat16, 3),
    (80, 4, 1, torch.float16, 8),
])
def test_prefill_over_cached_prefix(head_dim, heads, kv_heads, dtype, page_size):
    check(Step(PREFIX_SEQS, 0, heads, kv_heads, head_dim, dtype, page_size), TritonBackend(**SMALL_TILES))


@pytest.mark.parametrize("head_dim,kv_heads,dtype", [(96, 2, torch.float32), (64, 1, torch.bfloat16)])
def test_prefill_fresh_prompts_read_the_steps_own_kv(head_dim, kv_heads, dtype):
    step = Step([(1, 1), (17, 17), (33, 33), (5, 5)], 0, 8, kv_heads, head_dim, dtype, page_size=4)
    assert not step.batch.has_prefix
    check(step, TritonBackend(**SMALL_TILES))


def test_prefill_fresh_prompts_over_the_paged_cache():
    """The paged path with no prefix (has_prefix only picks the path; the kernel must agree)."""
    step = Step([(17, 17), (5, 5), (33, 33)], 0, 4, 2, 80, torch.float32, page_size=4)
    out = torch.empty_like(step.q)
    q_starts = torch.tensor([0, 17, 22], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([17, 5, 33], dtype=torch.int32, device=DEVICE)
    kernels.prefill_attention(step.q, *step.kv_cache.data, out, q_starts, lens, lens,
                              step.batch.block_tables, 33, step.scale, block_m=16, block_n=16)
    torch.testing.assert_close(out, step.run(TextbookBackend()), **TOL[torch.float32])


def test_prefill_without_cache():
    step = Step([(1, 1), (5, 5), (17, 17), (33, 33)], 0, 4, 1, 128, torch.float32, page_size=4, cache=False)
    check(step, TritonBackend(**SMALL_TILES))


# ------------------------------------------------------------------------------------------------
# decode
# ------------------------------------------------------------------------------------------------

DECODE_SEQS = [(1, 1), (1, 5), (1, 17), (1, 33), (1, 70)]   # 70: three partitions of 32, the last partial


@pytest.mark.parametrize("head_dim,heads,kv_heads,dtype,page_size", [
    (64, 2, 2, torch.float32, 4),
    (80, 8, 2, torch.bfloat16, 5),
    (96, 4, 1, torch.float32, 16),
    (128, 8, 1, torch.float32, 3),
])
def test_paged_decode(head_dim, heads, kv_heads, dtype, page_size):
    check(Step(DECODE_SEQS, len(DECODE_SEQS), heads, kv_heads, head_dim, dtype, page_size),
          TritonBackend(**SMALL_TILES))


def test_decode_one_partition_per_sequence():
    """partition_size above every context: the merge sees a single partition."""
    step = Step(DECODE_SEQS, len(DECODE_SEQS), 4, 1, 64, torch.float32, page_size=4)
    check(step, TritonBackend(prefill_block_m=16, prefill_block_n=16, decode_block_n=16, partition_size=128))


def test_decode_merge_spans_several_chunks_of_partitions():
    """300 keys in partitions of 16: 19 partitions, more than the 16 the merge kernel reads at
    once, so its loops run twice."""
    step = Step([(1, 300), (1, 70)], 2, 4, 2, 64, torch.float32, page_size=8)
    check(step, TritonBackend(prefill_block_m=16, prefill_block_n=16, decode_block_n=16, partition_size=16))


# ------------------------------------------------------------------------------------------------
# mixed steps
# ------------------------------------------------------------------------------------------------

MIXED_SEQS = [(1, 3), (1, 33), (1, 64), (5, 5), (17, 29)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_decodes_and_prefills_with_prefix(dtype):
    step = Step(MIXED_SEQS, 3, 8, 2, 80, dtype, page_size=4)
    assert step.batch.has_prefix
    check(step, TritonBackend(**SMALL_TILES))


def test_mixed_decodes_and_fresh_prefills():
    step = Step([(1, 9), (1, 40), (17, 17), (1, 1)], 2, 8, 1, 64, torch.float32, page_size=16)
    assert not step.batch.has_prefix
    check(step, TritonBackend(**SMALL_TILES))


def test_default_tiles():
    """The GPU tile sizes (64 x 64, partitions of 512) on the same kind of step."""
    check(Step(MIXED_SEQS + [(70, 100)], 3, 4, 1, 128, torch.float32, page_size=16), TritonBackend())


# ------------------------------------------------------------------------------------------------
# compilation for a GPU
# ------------------------------------------------------------------------------------------------

# The interpreter checks no types, layouts or register budgets: compile the bf16 kernels for
# Hopper (sm_90, the H200) ahead of time, which needs Triton's bundled ptxas but no GPU, in a
# fresh process where the kernels are decorated for real.
_COMPILE_FOR_HOPPER = r'''
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvserve.attention.triton import kernels as K

def build(fn, types, consts, num_warps=4):
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    # What the JIT assumes of real tensors: 16-byte aligned pointers, strides multiple of 16.
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if n not in consts and (sig[n].startswith("*") or n.startswith("stride"))}
    triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                   target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})

bf16 = {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "out_ptr", "cache_ptr")}
ints = {"q_start_ptr": "*i32", "q_len_ptr": "*i32", "ctx_len_ptr": "*i32", "table_ptr": "*i64", "slot_ptr": "*i64",
        "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "qk_scale": "fp32"}
types = {**bf16, **ints}
dims = {"HEAD_DIM": 80, "BLOCK_D": 128}
build(K._store_kv_kernel, types, {"PAGE_SIZE": 16, "NUM_KV_HEADS": 8, "BLOCK_H": 8, **dims})
for paged in (True, False):
    build(K._prefill_kernel, types, {"GROUP": 4, "PAGE_SIZE": 16, "PAGED": paged, "BLOCK_M": 64, "BLOCK_N": 64,
                                     "DOT_FP32": False, **dims})
build(K._decode_partition_kernel, types, {"GROUP": 8, "PAGE_SIZE": 16, "PARTITION": 512, "BLOCK_G": 16,
                                          "BLOCK_N": 64, "DOT_FP32": False, **dims})
build(K._decode_merge_kernel, types, {"PARTITION": 512, "BLOCK_P": 16, **dims}, num_warps=1)
print("compiled")
'''


def test_kernels_compile_for_hopper():
    compile_for_hopper(_COMPILE_FOR_HOPPER)
