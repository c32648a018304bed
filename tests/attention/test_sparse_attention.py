"""Sparse decode attention (kvserve.kv.sparse, Quest): page summaries, the selection of blocks against a brute-force
reference (textbook attention over the chosen blocks), and the kernels that select (the C kernels, Triton under
its interpreter)."""
from __future__ import annotations

import ctypes
import re
import shutil

import pytest
import torch

from kvserve import kernels
from kvserve.attention import native
from kvserve.attention.sparse import SparseDecode, block_bytes, select_blocks
from kvserve.attention.textbook import attend
from kvserve.kv import KVSpec, KVStorage
from kvserve.kv.sparse import Quest, parse_sparse_attention, selection_pays
from kvserve.kv.summaries import round_down, round_up

needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Case:
    """Sequences over one layer's pages: block tables (sequence 1 shares sequence 0's leading blocks, as a fork
    or a prefix hit does), their tokens written in order in chunks (each block from its offset 0 on), decode
    queries, and their sparse options."""

    def __init__(self, dtype, kv_cache_dtype, bs, kvh, groups, d, ctx_lens, seed=0, shared=2):
        g = torch.Generator().manual_seed(seed)
        self.bs, self.kvh, self.groups, self.d, self.ctx = bs, kvh, groups, d, ctx_lens
        num_blocks = sum(cdiv(c, bs) for c in ctx_lens) + 4
        self.storage = KVStorage(KVSpec(1, kvh, d, dtype, bs, kv_cache_dtype, summaries=True), num_blocks, "cpu")
        self.layer = self.storage.layer(0)
        free = torch.randperm(num_blocks, generator=g).tolist()
        tables = []
        for i, c in enumerate(ctx_lens):
            n = cdiv(c, bs)
            own = tables[0][:min(shared, n - 1)] if i == 1 else []     # full blocks shared with sequence 0
            tables.append(own + [free.pop() for _ in range(n - len(own))])
        self.tables = tables
        for i, (table, c) in enumerate(zip(tables, ctx_lens)):
            start = min(shared, cdiv(c, bs) - 1) * bs if i == 1 else 0          # its shared blocks are written
            while start < c:
                n = min(c - start, int(torch.randint(1, 2 * bs + 2, (1,), generator=g)))
                pos = torch.arange(start, start + n)
                slots = torch.tensor(table)[pos // bs] * bs + pos % bs
                # keys with a few strong channels, as RoPE'd keys have
                kv = torch.randn(n, 2, kvh, d, generator=g) * (1 + 4 * (torch.rand(d, generator=g) > 0.8))
                self.layer.write_tokens(kv.to(dtype), slots)
                start += n
        width = max(len(t) for t in tables)
        self.block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
        self.context_lens = torch.tensor(ctx_lens)
        self.q = torch.randn(len(ctx_lens), kvh * groups, d, generator=g).to(dtype)

    def sparse(self, params: list[tuple[int, int, int, int]]) -> SparseDecode:
        n, width = len(self.ctx), self.block_tables.shape[1]
        return SparseDecode(torch.tensor(params, dtype=torch.int64), torch.zeros(2, dtype=torch.int64),
                            torch.zeros(1, n, width, dtype=torch.uint8), layer=0)


def brute_force(case: Case, params, scale: float):
    """Quest from its definition, in float64, from the pages themselves (not their summaries): per (sequence, KV
    head) the blocks of the sinks and of the recent window, and the middle blocks of the highest
    sum over the group's heads of sum_i max(q_i min_i, q_i max_i) (min and max over the block's cached keys, as
    attention reads them), the earlier of equal ones (every block where choosing does not pay: selection_pays);
    then textbook attention over those blocks' tokens. Returns the outputs [n, H, D], each (sequence, head)'s chosen
    table entries, and the smallest gap between a chosen and an unchosen bound (relative), which must be clear of
    float32's rounding for the kernels to agree."""
    bs, kvh, groups = case.bs, case.kvh, case.groups
    out = torch.zeros(case.q.shape, dtype=torch.float64)
    chosen, gap = {}, float("inf")
    for s, (table, ctx) in enumerate(zip(case.tables, case.ctx)):
        ids = torch.tensor(table)
        keys = case.layer.decoded_keys(ids).double()                      # [KVH, nb, BS, D]
        pages = case.layer.gather(ids).double()                          # [2, KVH, nb, BS, D]
        nb = len(table)
        budget, sinks, recent, _ = params[s]
        for h in range(kvh):
            q = case.q[s, h * groups:(h + 1) * groups].double()          # [G, D]
            first = min(cdiv(sinks, bs), nb)
            last = max((ctx - recent) // bs, first)
            k = max(0, min(budget // bs - first - (nb - last), last - first))
            if budget <= 0 or ctx <= budget or not selection_pays(last - first, k, *block_bytes(case.layer)):
                picks = list(range(nb))
            else:
                bounds = {}
                for j in range(first, last):
                    block = keys[h, j, :min(bs, ctx - j * bs)]
                    lo, hi = block.amin(0), block.amax(0)
                    bounds[j] = torch.maximum(q * lo, q * hi).sum().item()
                ranked = sorted(bounds, key=lambda j: (-bounds[j], j))
                if 0 < k < len(ranked):
                    edge = bounds[ranked[k - 1]] - bounds[ranked[k]]
                    gap = min(gap, edge / (abs(bounds[ranked[k - 1]]) + 1e-9))
                picks = sorted(range(first)) + sorted(ranked[:k]) + list(range(last, nb))
            chosen[s, h] = picks
            tokens = [(j, t) for j in picks for t in range(min(bs, ctx - j * bs))]
            k_rows = torch.stack([pages[0, h, j, t] for j, t in tokens])[:, None]
            v_rows = torch.stack([pages[1, h, j, t] for j, t in tokens])[:, None]
            out[s, h * groups:(h + 1) * groups] = attend(q[None], k_rows, v_rows, scale, len(tokens) - 1)[0]
    return out, chosen, gap


def clear_case(shape, ctx_lens, params, scale):
    """The first Case (by seed) whose queries are clear of near ties at the selection's edge (the kernels sum in
    float32, in another order), with the brute force's outputs and choice."""
    for seed in range(20):
        case = Case(*shape, ctx_lens, seed)
        want, chosen, gap = brute_force(case, params, scale)
        if gap > 1e-4:
            return case, want, chosen
    raise AssertionError("no case clear of near ties")


SHAPES = [  # dtype, kv_cache_dtype, block size, KV heads, query heads a KV head, head_dim
    (torch.float32, "auto", 1, 1, 1, 16),
    (torch.bfloat16, "auto", 3, 2, 3, 24),
    (torch.float32, "int8", 4, 2, 4, 64),
    (torch.bfloat16, "fp8", 5, 3, 2, 32),
    (torch.bfloat16, "int4", 16, 1, 8, 80),
    (torch.bfloat16, "auto", 16, 2, 4, 64),
]
# per sequence: budget, sinks, recent (tokens), dense_layers; budgets of a few blocks, one past the context (dense),
# one of 0 (a dense layer), and a sequence without sparse attention (budget -1)
PARAMS = [(24, 4, 8, 0), (40, 0, 1, 0), (17, 3, 13, 0), (10**6, 4, 8, 0), (0, 4, 8, 0), (-1, 0, 0, 0)]
CTX = [150, 97, 61, 80, 77, 66]


def expected_counts(case: Case, chosen: dict, params) -> tuple[list[int], torch.Tensor]:
    """counts (blocks read, blocks of the contexts) and the record [seqs, width] of the brute force's choice."""
    record = torch.zeros(len(case.ctx), case.block_tables.shape[1], dtype=torch.uint8)
    read = total = 0
    for (s, _), picks in chosen.items():
        if params[s][0] >= 0:
            read, total = read + len(picks), total + len(case.tables[s])
            record[s, picks] += 1
    return [read, total], record


@needs_cc
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{s[0]}-{s[1]}-bs{s[2]}-kvh{s[3]}-g{s[4]}-d{s[5]}".replace("torch.", "")
                                                for s in SHAPES])
def test_the_c_kernels_choose_and_attend_as_the_brute_force(shape):
    """paged_decode (and paged_prefill's one-token decodes) under sparse attention: per (sequence, KV head) the
    blocks Quest's definition chooses (checked through the record of which blocks each task read), and attention
    over exactly them: bit for bit the dense kernel's over a table of those blocks alone, and (float32) the
    textbook's over their tokens; a budget at least the context, or of 0, is the dense kernel's output bit for bit."""
    dtype, kv_cache_dtype, bs, kvh, groups, d = shape
    case, want, chosen = clear_case(shape, CTX, PARAMS, d ** -0.5)
    dense = native.paged_decode(case.q, case.layer, case.block_tables, case.context_lens, d ** -0.5)
    counts, record = expected_counts(case, chosen, PARAMS)
    for name, run in (("paged_decode", native.paged_decode), ("paged_prefill", native.paged_prefill)):
        sparse = case.sparse(PARAMS)
        args = (case.q, case.layer, case.block_tables, case.context_lens)
        if name == "paged_prefill":
            args += (torch.arange(len(CTX) + 1),)
        got = run(*args, d ** -0.5, sparse=sparse)
        assert torch.equal(sparse.record[0], record), name
        assert sparse.counts.tolist() == counts, name
        for (s, h), picks in chosen.items():
            heads = slice(h * groups, (h + 1) * groups)
            table = torch.tensor([[case.tables[s][j] for j in picks]])
            ctx = torch.tensor([sum(min(bs, CTX[s] - j * bs) for j in picks)])
            alone = native.paged_decode(case.q[s:s + 1], case.layer, table, ctx, d ** -0.5)
            assert torch.equal(got[s, heads], alone[0, heads]), (name, s, h)
        if dtype == torch.float32:     # (bfloat16's kernels against the textbook: test_native_attention.py)
            torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
        for s in (3, 4, 5):        # past the context, a dense layer, no sparse attention: the dense kernel's
            assert torch.equal(got[s], dense[s]), (name, s)


@pytest.mark.parametrize("shape", SHAPES[:3] + SHAPES[4:5], ids=["f32-bs1", "bf16-bs3", "int8-bs4", "int4-bs16"])
def test_select_blocks_chooses_as_the_brute_force(shape):
    """attention/sparse.py's select_blocks (the GPU's selection, in torch): each (sequence, KV head)'s table and
    context are those of the brute force's blocks, the counts and record alike."""
    bs = shape[2]
    case, _, chosen = clear_case(shape, CTX, PARAMS, 1.0)
    sparse = case.sparse(PARAMS)
    tables, lens = select_blocks(case.q, case.layer, case.block_tables, case.context_lens, sparse)
    for (s, h), picks in chosen.items():
        ctx = case.ctx[s]
        assert lens[s, h] == sum(min(bs, ctx - j * bs) for j in picks), (s, h)
        assert tables[s, h, :len(picks)].tolist() == [case.tables[s][j] for j in picks], (s, h)
    counts, record = expected_counts(case, chosen, PARAMS)
    assert sparse.counts.tolist() == counts and torch.equal(sparse.record[0], record)


# shape (as SHAPES), contexts: middles of many blocks (past the C bounds' steps of four blocks and their read-ahead,
# with tails of one to three), head_dims that fill no whole vector of 16 lanes
LONG = [((torch.bfloat16, "auto", 2, 1, 5, 40), [301, 222, 150]),
        ((torch.float32, "auto", 2, 2, 3, 80), [413, 390, 257]),
        ((torch.bfloat16, "int8", 3, 1, 4, 48), [700, 455, 204])]
LONG_PARAMS = [(60, 5, 9, 0), (48, 0, 1, 0), (21, 3, 17, 0)]


@needs_cc
@pytest.mark.parametrize("shape, ctx_lens", LONG, ids=["bf16-bs2-d40", "f32-bs2-d80", "int8-bs3-d48"])
def test_the_c_selection_is_the_brute_forces_over_long_middles(shape, ctx_lens):
    """decode_blocks' choice (each task's reads, through the record) over middles of 40 to 400 blocks, and
    attention over exactly them (the dense kernel's over a table of those blocks alone); select_blocks' too."""
    d, groups, bs = shape[5], shape[4], shape[2]
    case, _, chosen = clear_case(shape, ctx_lens, LONG_PARAMS, d ** -0.5)
    counts, record = expected_counts(case, chosen, LONG_PARAMS)
    sparse = case.sparse(LONG_PARAMS)
    got = native.paged_decode(case.q, case.layer, case.block_tables, case.context_lens, d ** -0.5, sparse=sparse)
    assert sparse.counts.tolist() == counts and torch.equal(sparse.record[0], record)
    assert counts[0] < counts[1] / 2
    for (s, h), picks in chosen.items():
        heads = slice(h * groups, (h + 1) * groups)
        table = torch.tensor([[case.tables[s][j] for j in picks]])
        ctx = torch.tensor([sum(min(bs, ctx_lens[s] - j * bs) for j in picks)])
        assert torch.equal(got[s, heads], native.paged_decode(case.q[s:s + 1], case.layer, table, ctx, d ** -0.5)[
            0, heads]), (s, h)
    sparse = case.sparse(LONG_PARAMS)
    tables, _ = select_blocks(case.q, case.layer, case.block_tables, case.context_lens, sparse)
    for (s, h), picks in chosen.items():
        assert tables[s, h, :len(picks)].tolist() == [case.tables[s][j] for j in picks], (s, h)


@needs_cc
def test_equal_bounds_choose_the_earlier_blocks():
    """Where every middle block bounds alike (the same key in each), the C kernel and select_blocks both read the
    earliest of them: the choice is one, whatever order a partial selection leaves the bounds in."""
    bs, d, ctx, nb = 2, 32, 101, 51
    budget, sinks, recent = 24, 2, 4     # 1 sink block, 3 recent ones, 8 of the 47 middle ones
    layer = KVStorage(KVSpec(1, 1, d, torch.bfloat16, bs, summaries=True), 64, "cpu").layer(0)
    g = torch.Generator().manual_seed(0)
    table = torch.randperm(64, generator=g)[:nb]
    pos = torch.arange(ctx)
    layer.write_tokens(torch.randn(1, 2, 1, d, generator=g).expand(ctx, 2, 1, d).to(torch.bfloat16).contiguous(),
                       table[pos // bs] * bs + pos % bs)
    q = torch.randn(1, 4, d, generator=g).to(torch.bfloat16)
    want = [0, *range(1, 9), 48, 49, 50]
    params = torch.tensor([[budget, sinks, recent, 0]])
    sparse = SparseDecode(params, torch.zeros(2, dtype=torch.int64), torch.zeros(1, 1, nb, dtype=torch.uint8), layer=0)
    native.paged_decode(q, layer, table[None], torch.tensor([ctx]), d ** -0.5, sparse=sparse)
    assert sparse.record[0, 0].nonzero().flatten().tolist() == want
    tables, lens = select_blocks(q, layer, table[None], torch.tensor([ctx]), SparseDecode(
        params, torch.zeros(2, dtype=torch.int64), None, layer=0))
    assert tables[0, 0, :len(want)].tolist() == table[want].tolist() and lens.tolist() == [[(len(want) - 1) * bs + 1]]


# dtype, kv_cache_dtype, a block's bytes in a KV head (K and V, scales included; block size 16, head_dim 64), middle
# blocks n and the blocks skipped where those bytes equal the n summaries' (2 x 64 numbers of the model's dtype)
RULE = [(torch.bfloat16, "auto", 4096, 32, 2), (torch.float32, "auto", 8192, 32, 2),
        (torch.bfloat16, "int8", 2112, 33, 4), (torch.bfloat16, "int4", 1152, 36, 8)]


@needs_cc
@pytest.mark.parametrize("dtype, kv_cache_dtype, page, middle, skipped", RULE, ids=[r[1] + "-" + str(r[0])[6:]
                                                                                    for r in RULE])
def test_a_choice_that_skips_no_more_bytes_than_it_reads_attends_densely(dtype, kv_cache_dtype, page, middle,
                                                                          skipped):
    """kv/sparse.py's selection_pays: a task whose budget would skip `skipped` middle blocks, whose bytes equal those
    of the n summaries the choice reads, reads every block (the C kernels and select_blocks, counted as the
    engine's stats count them); one block fewer in the budget and it chooses, skipping skipped + 1."""
    bs, d = 16, 64
    case = Case(dtype, kv_cache_dtype, bs, 1, 4, d, [(middle + 1) * bs], shared=0)
    assert block_bytes(case.layer) == (page, 2 * d * case.layer.summaries.data.element_size())
    nb = middle + 1
    for skip in (skipped, skipped + 1):
        params = [((middle - skip + 1) * bs, 0, bs, 0)]         # no sinks, one recent block, middle - skip chosen
        read = nb if skip == skipped else nb - skip
        sparse = case.sparse(params)
        native.paged_decode(case.q, case.layer, case.block_tables, case.context_lens, d ** -0.5, sparse=sparse)
        assert sparse.counts.tolist() == [read, nb], skip
        sparse = case.sparse(params)
        select_blocks(case.q, case.layer, case.block_tables, case.context_lens, sparse)
        assert sparse.counts.tolist() == [read, nb], skip


def test_triton_decodes_over_each_heads_blocks(triton_interpreter):
    """The Triton decode kernel over a block table and a context per (sequence, KV head): the textbook over the
    brute force's chosen blocks (under the interpreter)."""
    from kvserve.attention.triton.kernels import decode_attention

    for kv_cache_dtype in ("auto", "int8"):
        case, want, _ = clear_case((torch.float32, kv_cache_dtype, 4, 2, 2, 16), CTX[:4], PARAMS[:4], 0.25)
        tables, lens = select_blocks(case.q, case.layer, case.block_tables, case.context_lens, case.sparse(PARAMS[:4]))
        out = torch.empty_like(case.q)
        quant = case.layer if case.layer.format.quantized else None
        decode_attention(case.q, *case.layer.data, out, lens.to(torch.int32), tables, max(CTX), 0.25,
                         partition_size=32, block_n=16, quant=quant)
        torch.testing.assert_close(out.double(), want, atol=1e-4, rtol=1e-4)


@pytest.fixture
def triton_interpreter():
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        import os
        assert os.environ.get("TRITON_INTERPRET") == "1"


# ---- summaries ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_summaries_are_the_min_and_max_of_each_blocks_keys(dtype, kv_cache_dtype):
    """Written token by token and chunk by chunk, over blocks used before: each block's summary is the min and max
    of its cached keys as attention reads them (decoded, in float32), rounded outward to the model's dtype (exact
    for full-precision pages); no key of a block scores above its bound; whole blocks summarised from their pages
    (a load from the second tier) give the same numbers."""
    case = Case(dtype, kv_cache_dtype, 4, 2, 2, 32, [45, 30], shared=0)
    case2 = Case(dtype, kv_cache_dtype, 4, 2, 2, 32, [45, 30], seed=1, shared=0)  # reuses the blocks, other keys
    for c in (case, case2):
        for table, ctx in zip(c.tables, c.ctx):
            ids = torch.tensor(table)
            keys = c.layer.decoded_keys(ids)
            summary = c.layer.summaries.data[:, ids].clone()
            for j in range(len(table)):
                filled = keys[:, j, :min(c.bs, ctx - j * c.bs)]
                assert torch.equal(summary[:, j, 0], round_down(filled.amin(1), dtype))
                assert torch.equal(summary[:, j, 1], round_up(filled.amax(1), dtype))
                q = torch.randn(2, c.d)
                bound = torch.maximum(q * summary[:, j, 0].float(), q * summary[:, j, 1].float()).sum(-1)
                assert (filled @ q[:, :, None]).squeeze(-1).amax(1).le(bound + 1e-4).all()
            full = ids[:ctx // c.bs]
            c.layer.summarize_blocks(full)
            assert torch.equal(c.layer.summaries.data[:, full], summary[:, :len(full)])


def test_padding_rows_summarise_nothing():
    """A CUDA graph's padding rows (slot -1) are written nowhere: they change no block's summary."""
    storage = KVStorage(KVSpec(1, 2, 8, torch.float32, 4, summaries=True), 6, "cpu")
    layer = storage.layer(0)
    keys = torch.randn(4, 2, 8)
    layer.summarize_tokens(keys, torch.tensor([8, -1, 9, -1]))
    summary = layer.summaries.data
    assert torch.equal(summary[:, 2, 0], torch.minimum(keys[0], keys[2]))
    assert torch.equal(summary[:, 2, 1], torch.maximum(keys[0], keys[2]))
    assert not summary[:, [0, 1, 3, 4, 5]].any()


def test_bf16_rounding_outward_is_the_c_codes():
    """round_down and round_up to bfloat16 are the largest bfloat16 at most x and the smallest at least x."""
    x = torch.tensor([1.0, -1.0, 0.0, -0.0, 1 + 2**-10, -(1 + 2**-10), 3e-41, -3e-41, 1e38])
    down, up = round_down(x, torch.bfloat16).float(), round_up(x, torch.bfloat16).float()
    assert (down <= x).all() and (up >= x).all()
    assert down.tolist()[:6] == [1.0, -1.0, 0.0, 0.0, 1.0, -(1 + 2**-7)]
    assert up.tolist()[:6] == [1.0, -1.0, 0.0, 0.0, 1 + 2**-7, -1.0]


@needs_cc
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8", "int4"])
def test_the_c_step_summarises_a_token_as_the_pages_do(kv_cache_dtype, dtype):
    """csrc/kv_codecs.c's store_token (the C decode step's writes) keeps the summaries as PageSummaries.add_tokens
    does, bit for bit, each block written from its offset 0 on (over blocks used before)."""
    cache = kernels.c_structs(re.search(r"typedef struct \{[^}]*\} Cache;", (kernels.CSRC / "common.h").read_text())[0])
    Cache = cache["Cache"]
    store = getattr(kernels.library(), "store_token")
    store.argtypes = [ctypes.POINTER(Cache), ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_void_p]
    store.restype = None
    bs, nb, d = 4, 6, 24
    spec = KVSpec(1, 2, d, dtype, bs, kv_cache_dtype, summaries=True)
    python, c = (KVStorage(spec, nb, "cpu").layer(0) for _ in "pc")
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        kv = (torch.randn(nb * bs, 2, 2, d, generator=g) * 3).to(dtype)
        order = torch.randperm(nb, generator=g)
        slots = (order[:, None] * bs + torch.arange(bs)).flatten()   # block by block, each from offset 0
        python.write_tokens(kv, slots)
        pages, kind, kvh, blocks, block_size, head_dim, k_meta, v_meta, summary, summary_kind = native.cache_args(c)
        at = Cache(pages=pages, kind=kind, kvh=kvh, nb=blocks, bs=block_size, d=head_dim, k_meta=k_meta,
                   v_meta=v_meta, summary=summary, summary_kind=summary_kind)
        rows = kv.float()
        for t, slot in enumerate(slots.tolist()):
            for which in (0, 1):
                for h in range(2):
                    store(ctypes.byref(at), which, h, slot, rows[t, which, h].data_ptr())
        assert torch.equal(c.summaries.data, python.summaries.data)


# ---- the policy ---------------------------------------------------------------------------------------------------

def test_the_policy_parses_and_refuses_with_the_form():
    assert parse_sparse_attention("quest:budget=256,recent=32,sinks=0,dense_layers=1") == Quest(256, 32, 0, 1)
    assert parse_sparse_attention({"policy": "quest", "budget": 64, "recent": 16, "sinks": 16}).budget == 64
    assert parse_sparse_attention("none") is None and parse_sparse_attention(None) is None
    assert parse_sparse_attention(Quest().spec()) == Quest()
    for bad, message in [("quest:budget=20,recent=16,sinks=8", "budget .20. must be at least sinks . recent"),
                         ("quest:recent=0", "recent >= 1"), ("quest:window=4", "has no option window"),
                         ("sparse:budget=4", "unknown sparse_attention policy"),
                         ("quest:budget=1.5", "budget must be a whole number"), (3, "must be a string or a dict")]:
        with pytest.raises(ValueError, match=message):
            parse_sparse_attention(bad)


def test_summaries_are_counted_in_the_kv_bytes():
    """A block's summaries (min and max of head_dim numbers in the model's dtype, per layer and KV head) are part
    of bytes_per_block and of the pool's bytes, not of the bytes a block moves to the second tier."""
    plain = KVSpec(3, 2, 16, torch.bfloat16, 4)
    spec = KVSpec(3, 2, 16, torch.bfloat16, 4, summaries=True)
    assert spec.summary_bytes_per_block == 3 * 2 * 2 * 16 * 2
    assert spec.bytes_per_block == plain.bytes_per_block + spec.summary_bytes_per_block
    assert spec.page_bytes_per_block == plain.bytes_per_block
    storage = KVStorage(spec, 5, "cpu")
    assert storage.nbytes == 5 * spec.bytes_per_block
    assert storage.read_blocks([1, 2]).shape == (2, spec.page_bytes_per_block)
