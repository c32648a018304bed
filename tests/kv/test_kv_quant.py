"""Quantized KV pages: codec error bounds, int4 packing, writes token by token (kv/quant.py's, and the C decode
step's), attention over the pages."""
from __future__ import annotations

import ctypes
import re
import shutil

import pytest
import torch

from attention_cases import make_case, quantize_case
from kvserve import LLM, SamplingParams, kernels
from kvserve.attention.flash import FlashBackend
from kvserve.attention.native import NativeBackend, cache_args
from kvserve.attention.sdpa import SdpaBackend
from kvserve.attention.textbook import TextbookBackend
from kvserve.eval.perplexity import perplexity
from kvserve.kv.manager import KVCacheManager
from kvserve.engine.evictor import KeyRotation
from kvserve.kv.pages import PageFormat, QuantizedPages
from kvserve.kv.quant import FP8_MAX, Fp8PerToken, Int4, codecs, rotate_keys_
from kvserve.kv.spec import KVSpec
from kvserve.kv.storage import KVStorage
from kvserve.kv.pages import FullPages

DTYPES = ["int8", "fp8", "int4"]


def with_outliers(shape, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    x[..., 3] *= 20          # an outlier channel (as keys have)
    x[:, :, 1] *= 8          # an outlier token
    return x


def test_int8_error_is_within_half_a_step_per_token():
    x = with_outliers((2, 3, 16, 64))
    codec = codecs("int8")[0]
    q, meta = codec.encode(x)
    assert q.dtype == torch.int8 and meta.shape == (2, 3, 16)
    step = meta.float()[..., None]
    assert ((codec.decode(q, meta) - x).abs() <= step / 2 + 1e-6).all()


def test_fp8_keeps_three_mantissa_bits_per_token():
    x = with_outliers((2, 3, 16, 64))
    codec = codecs("fp8")[0]
    q, scale = codec.encode(x)
    assert q.dtype == torch.uint8 and scale.shape == (2, 3, 16)
    scale = scale.float()
    err = (codec.decode(q, scale) - x).abs()
    # relative 2^-4 for normal numbers; below the smallest normal (2^-6 x scale), an absolute 2^-10 x scale
    bound = torch.maximum(x.abs() * 2 ** -4, scale[..., None] * 2 ** -10)
    assert (err <= bound + 1e-7).all()
    # each token's largest number lands at the top of the range (the float16 scale rounds by 2^-11)
    assert (x.abs().amax(-1) / scale).allclose(torch.full_like(scale, FP8_MAX), rtol=2 ** -10)


@pytest.mark.parametrize("kv_cache_dtype", DTYPES)
@pytest.mark.parametrize("which", [0, 1], ids=["keys", "values"])
def test_every_codec_quantizes_a_token_alone(kv_cache_dtype, which):
    """What any codec stores for a key or value token does not depend on the other tokens of its block
    (an outlier token leaves its neighbours' precision alone), nor on when the block fills."""
    x = with_outliers((2, 3, 16, 64))
    codec = codecs(kv_cache_dtype)[which]
    whole = codec.decode(*codec.encode(x))
    alone = torch.cat([codec.decode(*codec.encode(x[:, :, t:t + 1])) for t in range(16)], 2)
    assert whole.equal(alone)
    assert ((whole - x).abs()[:, :, 0] < (whole - x).abs()[:, :, 1].amax()).all()   # beside the outlier token
    zeros = codec.decode(*codec.encode(torch.zeros(1, 1, 4, 64)))
    assert zeros.equal(torch.zeros(1, 1, 4, 64))


def min_max_step(x: torch.Tensor) -> torch.Tensor:
    """The step of the grid whose end levels are each row's min and max, [..., 1]."""
    return (x.amax(-1, keepdim=True) - x.amin(-1, keepdim=True)) / 15


def min_max_int4(x: torch.Tensor) -> torch.Tensor:
    """x through the 16 levels of each row's min-max grid, float16 scale and minimum: the plain int4."""
    scale = min_max_step(x).clamp_min(torch.finfo(torch.float16).tiny).half().float()
    lo = x.amin(-1, keepdim=True).half().float()
    return ((x - lo) / scale).round().clamp(0, 15) * scale + lo


def test_int4_error_is_within_a_step_per_token():
    """Every number comes back within one step of its row's min-max grid (that grid alone keeps half a
    step; the grid encode picks trades a little at the row's ends for the rest)."""
    x = with_outliers((2, 3, 16, 64))
    codec = Int4()
    q, meta = codec.encode(x)
    assert q.shape == (2, 3, 16, 32) and q.dtype == torch.uint8 and meta.shape == (2, 3, 2, 16)
    assert ((codec.decode(q, meta) - x).abs() <= min_max_step(x)).all()


@pytest.mark.parametrize("keys", [True, False], ids=["rotated-keys", "gaussian"])
def test_int4_rows_come_back_closer_than_by_their_min_max_grid_and_unshrunk(keys):
    """Near-Gaussian rows (keys with an outlier channel, rotated as they are stored, or plain Gaussian
    numbers): in all, at least 10% less squared error than through each row's min-max grid, and every
    row comes back unshrunk along itself (back . x = x . x up to the float16 scale and minimum), where
    the min-max grid misses by up to a few percent either way."""
    g = torch.Generator().manual_seed(1)
    x = rotated(with_outliers((2, 3, 256, 64))) if keys else torch.randn(2, 3, 256, 64, generator=g)
    codec = Int4()
    back = codec.decode(*codec.encode(x))
    err, plain = ((y - x).square().sum(-1) for y in (back, min_max_int4(x)))
    assert err.sum() < 0.9 * plain.sum()
    along = (back * x).sum(-1) / x.square().sum(-1)
    assert ((along - 1).abs() < 2e-3).all()


def rotated(x: torch.Tensor) -> torch.Tensor:
    y = x.clone()
    rotate_keys_(y)
    return y


@pytest.mark.parametrize("head_dim", [64, 24])
def test_key_rotation_is_orthonormal_and_keeps_scores(head_dim):
    """Blocks of the largest power of two dividing head_dim (8 of 24): q . k is unchanged when both turn,
    and turning twice gives the keys back."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(5, head_dim, generator=g), torch.randn(7, head_dim, generator=g)
    assert not torch.allclose(rotated(k), k, atol=0.1)
    torch.testing.assert_close(rotated(q) @ rotated(k).T, q @ k.T, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rotated(rotated(k)), k, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(rotated(k).norm(dim=-1), k.norm(dim=-1))
    if head_dim == 24:      # three blocks of 8: a key in the first block stays there
        assert rotated(torch.eye(24)[:8])[:, 8:].eq(0).all()


@pytest.mark.parametrize("head_dim, most", [(64, 1 / 4), (24, 2 / 3)])
def test_rotation_shrinks_int4_key_error_beside_an_outlier_channel(head_dim, most):
    """An outlier channel sets a token's int4 range, leaving its other channels a few levels: rotated keys
    spread it over their block (the wider, the more: 64 channels at head_dim 64, 8 at 24), and come back
    (turned again) closer to the keys."""
    x = with_outliers((2, 3, 16, head_dim))
    codec = Int4()
    plain = codec.decode(*codec.encode(x)) - x
    back = codec.decode(*codec.encode(rotated(x)))
    rotate_keys_(back)
    err = back - x
    assert err.pow(2).mean() < plain.pow(2).mean() * most


def test_int4_layers_store_the_keys_rotated(ckpt):
    """The engine's int4 pages hold H k (within a step of its min-max grid), not k; values are stored as they are."""
    prompt = {"prompt_token_ids": list(range(3, 33))}
    once = SamplingParams(max_tokens=1, temperature=0)
    full, int4 = (LLM(str(ckpt), block_size=4, num_kv_blocks=16, kv_cache_dtype=dt) for dt in ("auto", "int4"))
    for llm in (full, int4):
        llm.generate([prompt], once, use_tqdm=False)
    k, v = full.engine.storage.layer(0).pages     # layer 0's K and V do not depend on the cache
    layer = int4.engine.storage.layer(0)
    got_k, got_v = layer.gather(torch.arange(16))
    want = rotated(k)
    step = min_max_step(want)
    assert ((got_k - want).abs() <= step).all()
    assert not torch.allclose(got_k, k, atol=(step / 2).max().item())
    assert ((got_v - v).abs() <= min_max_step(v)).all()


def test_sink_moves_rotated_int4_keys_by_rope_of_the_model_keys():
    """sink's RoPE shift applies to the model's keys: an int4 layer's keys are turned back, shifted and turned
    again, so that its moved block holds H rope(k)."""
    bs, kvh, d = 4, 2, 64
    storage = KVStorage(KVSpec(1, kvh, d, torch.float32, bs, "int4"), 4, torch.device("cpu"))
    layer = storage.layer(0)
    kv = with_outliers((bs, 2, kvh, d), seed=2)
    rotate_keys_(kv[:, 0])                        # as the attention layer writes them
    layer.write_tokens(kv, torch.arange(bs))
    angle = torch.arange(d // 2) * 0.3
    cos, sin = torch.cat((angle.cos(), angle.cos())), torch.cat((-angle.sin(), angle.sin()))
    stored = layer.gather(torch.tensor([0]))[0, :, 0]                  # [KVH, BS, D]
    storage.rotate_keys([0], [1], KeyRotation(cos, sin))
    model_keys = stored.clone()
    rotate_keys_(model_keys)
    want = model_keys * cos + model_keys.roll(d // 2, -1) * sin
    rotate_keys_(want)
    got = layer.gather(torch.tensor([1]))[0, :, 0]
    assert ((got - want).abs() <= min_max_step(want) + 1e-5).all()


def test_int4_packs_two_numbers_per_byte():
    levels = torch.arange(16.0).repeat(2)[torch.randperm(32)]      # every level, even and odd channels
    x = levels.view(1, 1, 1, 32).expand(1, 1, 4, 32).contiguous()
    codec = Int4()
    q, meta = codec.encode(x)
    assert (q & 15).equal(x[..., 0::2].to(torch.uint8)) and (q >> 4).equal(x[..., 1::2].to(torch.uint8))
    assert codec.decode(q, meta).equal(x)


def test_bytes_per_token_count_the_scales():
    # 8 layers, 4 KV heads, head_dim 64, block 16, bf16: 8 x 2 x 4 x 64 x 2 = 8192 bytes per token
    spec = lambda dt, **kw: KVSpec(8, 4, 64, torch.bfloat16, 16, dt, **kw)  # noqa: E731
    assert spec("auto").bytes_per_token == 8192
    assert spec("int8").bytes_per_token == 8 * 2 * 4 * (64 + 2)                        # fp16 scale per token
    assert spec("fp8").bytes_per_token == 8 * 2 * 4 * (64 + 2)                         # fp16 scale per token
    assert spec("int4").bytes_per_token == 8 * 2 * 4 * (32 + 2 * 2)                    # fp16 scale, min per token
    # whatever the block size: every codec's scales are per token
    assert KVSpec(8, 4, 64, torch.bfloat16, 64, "int4").bytes_per_token == spec("int4").bytes_per_token
    assert spec("int8", skip_layers=(0,)).bytes_per_token == 1024 + 7 * 2 * 4 * 66
    int4 = spec("int4")
    assert int4.bytes_held(32 + 9) == 3 * int4.bytes_per_block and int4.bytes_held(32) == 2 * int4.bytes_per_block
    with pytest.raises(ValueError, match="not layers"):
        spec("int8", skip_layers=(8,))
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        spec("int3")


def c_kernel(name: str, *argtypes):
    """A function csrc/common.h declares for the kernels (not a kernel of SIGNATURES), typed for a test."""
    fn = getattr(kernels.library(), name)
    fn.argtypes, fn.restype = list(argtypes), None
    return fn


def awkward_rows(n: int, d: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """K/V rows [n, 2, KVH 2, d] of magnitudes 2^-4 to 2^4, and rows that are all zeros, constant, one outlier,
    float16-subnormal or below float16's range, as the model's dtype holds them."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2, 2, d, generator=g) * torch.rand(n, 2, 2, 1, generator=g).mul(8).exp2().div(16)
    x[0], x[1], x[2, :, :, 0], x[3], x[4] = 0.0, 3.0, 1e4, x[3] * 1e-6, x[4].sign() * 1e-8
    return x.to(dtype)


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_cache_dtype", DTYPES)
def test_the_c_step_writes_a_token_as_the_codecs_do(kv_cache_dtype, dtype):
    """csrc/kv_codecs.c's store_token, by which the C decode step writes its K/V, writes each token's numbers and
    scales as QuantizedPages.write_tokens does, bit for bit: int8's and fp8's rounding, int4's grid, its stretch
    and the float16 rounding of its scales; rows of every head_dim (a power of two or not, short ones)."""
    cache = kernels.c_structs(re.search(r"typedef struct \{[^}]*\} Cache;", (kernels.CSRC / "common.h").read_text())[0])
    Cache = cache["Cache"]
    store = c_kernel("store_token", ctypes.POINTER(Cache), ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_void_p)
    for d in (2, 16, 24, 80, 128, 256):
        n, bs, nb = 40, 4, 12
        kv = awkward_rows(n, d, dtype, d)
        slots = torch.randperm(nb * bs, generator=torch.Generator().manual_seed(d))[:n]
        fmt = PageFormat.of(kv_cache_dtype, dtype)
        python, c = (QuantizedPages(fmt, 2, nb, bs, d, torch.device("cpu")) for _ in "pc")
        python.write_tokens(kv, slots)
        pages, kind, kvh, blocks, block_size, head_dim, k_meta, v_meta, *_ = cache_args(c)
        at = Cache(pages=pages, kind=kind, kvh=kvh, nb=blocks, bs=block_size, d=head_dim, k_meta=k_meta, v_meta=v_meta)
        rows = kv.float()
        for t, slot in enumerate(slots.tolist()):
            for which in (0, 1):
                for h in range(2):
                    store(ctypes.byref(at), which, h, slot, rows[t, which, h].data_ptr())
        assert torch.equal(c.pages, python.pages), d
        for mine, theirs in zip(c.meta, python.meta):
            assert torch.equal(mine.view(torch.int16), theirs.view(torch.int16)), d


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_c_step_rotates_keys_as_rotate_keys_does(dtype):
    """csrc/kv_codecs.c's rotate_keys_row, which turns the C step's keys and queries for int4 pages: rotate_keys_'s
    numbers, bit for bit, at every head_dim (blocks of its largest power of two: none at an odd one)."""
    rotate = c_kernel("rotate_keys_row", ctypes.c_void_p, ctypes.c_int, ctypes.c_int)
    for d in (3, 2, 16, 24, 80, 128, 256):
        x = awkward_rows(8, d, dtype, d).flatten(0, 2)
        want, got = x.clone(), x.float()
        rotate_keys_(want)
        for row in got:
            rotate(row.data_ptr(), d, kernels.DTYPE_KINDS[dtype])
        assert torch.equal(got, want.float()), d


@pytest.mark.parametrize("kv_cache_dtype", DTYPES)
def test_storage_quantizes_each_token_as_it_is_written(kv_cache_dtype):
    """Chunked writes (partial blocks, blocks filled over several steps or in one), a copy-on-write of
    a block being filled, a sequence that ends while filling a block, which goes to a new sequence:
    every sequence reads back each of its tokens as the codecs quantize it alone, whether its block is
    full or still filling; every block comes back."""
    bs, kvh, d = 4, 2, 64
    spec = KVSpec(2, kvh, d, torch.float32, bs, kv_cache_dtype, skip_layers=(1,))
    kv = KVCacheManager(48, bs)
    storage = KVStorage(spec, 48, torch.device("cpu"))
    layer = storage.layer(0)
    assert not storage.layer(1).format.quantized
    codec = codecs(kv_cache_dtype)
    lens, truth = {0: 0, 1: 0, 2: 0}, {}
    g = torch.Generator().manual_seed(0)

    def step(new: dict[int, int]):
        copies = [c for i, n in new.items() for c in kv.allocate(i, lens[i], n)]
        storage.copy_blocks(copies)
        ids = list(new)
        kv_new = torch.randn(sum(new.values()), 2, kvh, d, generator=g)
        tables = [kv.block_tables[i] for i in ids]
        slots = torch.tensor([t[p // bs] * bs + p % bs for t, i in zip(tables, ids)
                              for p in range(lens[i], lens[i] + new[i])])
        layer.write_tokens(kv_new, slots)
        t = 0
        for i, n in new.items():
            for p in range(lens[i], lens[i] + n):
                truth[i, p] = kv_new[t]
                t += 1
            lens[i] += n
        check()

    def check():
        for i, n in lens.items():
            table = kv.block_tables.get(i, [])
            pages = layer.gather(torch.tensor(table, dtype=torch.long))           # [2, KVH, blocks, BS, D]
            for j in range(-(-n // bs)):
                want = torch.stack([truth[i, p] for p in range(j * bs, min(n, (j + 1) * bs))])   # [n, 2, KVH, D]
                want = torch.stack([c.decode(*c.encode(want[:, n].transpose(0, 1)))
                                    for n, c in enumerate(codec)], 1).transpose(0, 2)
                got = pages[:, :, j, :len(want)].permute(2, 0, 1, 3)       # [n, 2, KVH, D]
                torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)

    step({0: 3, 1: 1, 2: 2})       # all partial
    step({0: 1, 1: 8, 2: 1})       # seq 0 fills a block; seq 1 fills one and writes one whole
    step({0: 5, 1: 6})             # across block boundaries
    kv.fork(2, 3)                  # seq 3 forks seq 2 and copies its block being filled as it writes
    lens[3] = lens[2]
    truth.update({(3, p): truth[2, p] for p in range(lens[2])})
    step({2: 1, 3: 1})             # both write into their copy of the block
    step({2: 2, 3: 2})             # and fill it
    step({3: 1})
    kv.free(3)                     # seq 3 ends while filling a block; a new sequence may take it at once
    del lens[3]
    truth = {key: val for key, val in truth.items() if key[0] != 3}
    lens[4] = 0
    step({4: 3})
    for i in list(lens):
        kv.free(i)
    assert kv.num_free_blocks == kv.num_blocks


@pytest.mark.parametrize("kv_cache_dtype", DTYPES)
@pytest.mark.parametrize("backend", [FlashBackend(q_tile=8, k_tile=12, decode_k_tile=12), FlashBackend(),
                                     SdpaBackend(), NativeBackend(), TextbookBackend()],
                         ids=["flash-small-tiles", "flash", "sdpa", "native", "textbook"])
@pytest.mark.parametrize("shape", [(4, 4, 64), (8, 2, 80), (8, 1, 128)])
def test_attention_over_quantized_pages_equals_attention_over_their_values(backend, shape, kv_cache_dtype):
    h, kvh, d = shape
    q_lens, ctx_lens, nd = [1, 1, 7, 13], [40, 3, 20, 13], 2
    q, k, v, kv_cache, batch = make_case(q_lens, ctx_lens, nd, h, kvh, d, block_size=5)
    layer, pages = quantize_case(kv_cache, k, v, batch, kv_cache_dtype, 5)
    ref = TextbookBackend().forward(q, k, v, FullPages(pages), batch, d ** -0.5)
    out = backend.forward(q, k, v, layer, batch, d ** -0.5)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # and the quantization did change something: the exact pages give another answer
    exact = TextbookBackend().forward(q, k, v, FullPages(kv_cache), batch, d ** -0.5)
    assert not torch.allclose(exact, ref, atol=1e-5)


@pytest.mark.parametrize("kv_cache_dtype", DTYPES)
@pytest.mark.parametrize("backend", [SdpaBackend(), NativeBackend()], ids=["sdpa", "native"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_decode_over_quantized_pages_matches_the_dequantized_pages(backend, kv_cache_dtype, dtype):
    # sdpa scales queries, scores and probabilities instead of the numbers, native dequantizes in
    # float32 as it reads: either rounds differently from attention over the dequantized values,
    # but only within the model dtype's precision (bfloat16 keeps 8 bits: its int4 cases come within
    # 0.02 of the reference, or just past it, as the pages' scales happen to round)
    q_lens, ctx_lens = [1, 1, 1], [40, 3, 21]
    q, k, v, kv_cache, batch = make_case(q_lens, ctx_lens, 3, 8, 2, 64, block_size=5, dtype=dtype)
    layer, pages = quantize_case(kv_cache, k, v, batch, kv_cache_dtype, 5)
    ref = TextbookBackend().forward(q.float(), k.float(), v.float(), FullPages(pages.float()), batch, 0.125)
    out = backend.forward(q, k, v, layer, batch, 0.125)
    tol = 3e-2 if dtype == torch.bfloat16 else 2e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


# ---------------------------------------------------------------- the engine end to end

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(checkpoint):
    # head_dim 64, 2 KV heads; small weights so that nearby caches give nearby logits
    return checkpoint("llama", hidden_size=256, num_attention_heads=4,
                      num_key_value_heads=2, initializer_range=0.02, max_position_embeddings=128)


def prompts(n: int = 6) -> list[dict]:
    g = torch.Generator().manual_seed(3)
    return [{"prompt_token_ids": torch.randint(3, 384, (k,), generator=g).tolist()} for k in [3, 9, 17, 30, 5, 22][:n]]


def streamed_nll(ckpt, **kwargs) -> float:
    """Next-token loss of a text fed one token per step, so that every token attends to the cache."""
    llm = LLM(str(ckpt), block_size=4, num_kv_blocks=64, long_prefill_token_threshold=1, **kwargs)
    ids = torch.randint(3, 384, (60,), generator=torch.Generator().manual_seed(1)).tolist()
    return perplexity(llm, ids, context=60).nll


def test_quantized_caches_cost_little_and_are_read(ckpt):
    full = streamed_nll(ckpt)
    for kv_cache_dtype, rel in [("int8", 0.002), ("fp8", 0.01), ("int4", 0.03)]:
        nll = streamed_nll(ckpt, kv_cache_dtype=kv_cache_dtype)
        assert nll != full                                  # the quantized pages are what attention read
        assert nll == pytest.approx(full, rel=rel), kv_cache_dtype
    assert streamed_nll(ckpt, kv_cache_dtype="int4", kv_cache_dtype_skip_layers=[0, 1]) == full


@pytest.mark.parametrize("kv_cache_dtype", DTYPES)
def test_pool_capacity_follows_the_bytes_per_block(ckpt, kv_cache_dtype):
    full = LLM(str(ckpt), block_size=16, kv_cache_memory="4MiB", max_num_seqs=4).stats()
    llm = LLM(str(ckpt), block_size=16, kv_cache_memory="4MiB", max_num_seqs=4, kv_cache_dtype=kv_cache_dtype)
    stats, spec = llm.stats(), llm.engine.kv_spec
    assert stats["kv_cache_dtype"] == kv_cache_dtype and stats["kv_bytes_per_token"] == spec.bytes_per_token
    # nothing is set aside
    assert stats["kv_blocks_total"] == 4 * 2**20 // spec.bytes_per_block
    assert stats["kv_cache_bytes"] <= 4 * 2**20
    # fp32 model, head_dim 64: 4 bytes a number become 1 (int8, fp8) or 1/2 (int4), plus scales
    ratio = stats["kv_blocks_total"] / full["kv_blocks_total"]
    assert ratio > {"int8": 3.75, "fp8": 3.75, "int4": 5.5}[kv_cache_dtype]


@pytest.mark.parametrize("kv_cache_dtype", DTYPES)
def test_batching_and_forks_keep_tokens(ckpt, kv_cache_dtype):
    """What a block stores depends on its tokens only: batching and backends do not change tokens,
    and n forked samples equal separate runs with their seeds."""
    alone = LLM(str(ckpt), block_size=4, num_kv_blocks=64, max_num_seqs=1, kv_cache_dtype=kv_cache_dtype)
    want = [o.outputs[0].token_ids for o in (alone.generate(p, GREEDY, use_tqdm=False)[0] for p in prompts())]
    for backend in ["sdpa", "flash", "textbook", "triton"]:
        if backend == "triton":
            pytest.importorskip("triton")
        llm = LLM(str(ckpt), block_size=4, num_kv_blocks=64, kv_cache_dtype=kv_cache_dtype, attention_backend=backend)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)] == want, backend
    llm = LLM(str(ckpt), block_size=4, num_kv_blocks=64, kv_cache_dtype=kv_cache_dtype)
    forked = llm.generate(prompts(1)[0], SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=5),
                          use_tqdm=False)[0]
    for i, completion in enumerate(forked.outputs):
        solo = llm.generate(prompts(1)[0], SamplingParams(max_tokens=8, temperature=1.0, seed=5 + i),
                            use_tqdm=False)[0]
        assert completion.token_ids == solo.outputs[0].token_ids
    assert llm.stats()["kv_blocks_free"] == 64


@pytest.mark.parametrize("kv_cache_dtype", DTYPES)
def test_prefix_hit_reads_the_same_pages_as_a_chunked_prefill(ckpt, kv_cache_dtype):
    """Tokens of earlier steps are read quantized, a step's own tokens exact: a prompt whose first two
    blocks hit the prefix cache gives the tokens of a prefill chunked at the same place."""
    prefix, suffix = prompts()[1]["prompt_token_ids"][:8], prompts()[2]["prompt_token_ids"][:5]
    chunked = LLM(str(ckpt), block_size=4, num_kv_blocks=64, kv_cache_dtype=kv_cache_dtype,
                  enable_prefix_caching=False, long_prefill_token_threshold=8)
    want = chunked.generate({"prompt_token_ids": prefix + suffix}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    cached = LLM(str(ckpt), block_size=4, num_kv_blocks=64, kv_cache_dtype=kv_cache_dtype)
    cached.generate({"prompt_token_ids": prefix + [7]}, GREEDY, use_tqdm=False)
    out = cached.generate({"prompt_token_ids": prefix + suffix}, GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 8 and out.outputs[0].token_ids == want


@pytest.mark.parametrize("kv_cache_dtype", DTYPES)
def test_preemption_recomputes_and_returns_everything(ckpt, kv_cache_dtype):
    # 10 blocks of 4 tokens: the longest request (30 + 8 tokens) needs all of them alone
    llm = LLM(str(ckpt), block_size=4, num_kv_blocks=10, kv_cache_dtype=kv_cache_dtype)
    outs = llm.generate(prompts(), GREEDY, use_tqdm=False)
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and all(len(o.outputs[0].token_ids) == 8 for o in outs)
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_quantized_cache_options_are_checked(ckpt):
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        LLM(str(ckpt), kv_cache_dtype="int3")
    with pytest.raises(ValueError, match="needs cache_mode 'paged'"):
        LLM(str(ckpt), kv_cache_dtype="int8", cache_mode="contiguous")
    with pytest.raises(ValueError, match="not layers of this model"):
        LLM(str(ckpt), kv_cache_dtype="int8", kv_cache_dtype_skip_layers=[2])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_fp8_pages_decode_in_every_model_dtype_and_at_any_magnitude(dtype):
    # the e4m3 bits are placed in a wider float and scaled back by 2^120: the numbers must come out
    # whole in float16 too, and a block whose values reach 3e5 (a scale past 256) must stay finite
    x = torch.randn(2, 3, 8, 16)
    x[1] *= 3e5 if dtype != torch.float16 else 1.0
    codec = Fp8PerToken()
    q, meta = codec.encode(x)
    out = codec.decode(q, meta, dtype)
    ref = q.view(torch.float8_e4m3fn).float() * meta.float()[..., None]
    assert out.isfinite().all()
    torch.testing.assert_close(out.float(), ref, rtol={torch.float32: 1e-6}.get(dtype, 1e-2), atol=0)


@pytest.mark.parametrize("backend", [SdpaBackend(), NativeBackend()], ids=["sdpa", "native"])
def test_fp8_pages_of_large_values_attend_like_their_values(backend):
    # blocks whose largest value is ~1e6 have scales past 2^8: no step of the decode may overflow
    q, k, v, kv_cache, batch = make_case([1, 1], [9, 30], 2, 4, 2, 64, block_size=4)
    kv_cache *= 1e6 / kv_cache.abs().max()
    layer, pages = quantize_case(kv_cache, k, v, batch, "fp8", 4)
    q /= 1e6       # keep the scores where a softmax tells tokens apart
    ref = TextbookBackend().forward(q, k, v, FullPages(pages), batch, 0.125)
    out = backend.forward(q, k, v, layer, batch, 0.125)
    assert out.isfinite().all()
    torch.testing.assert_close(out, ref, atol=1e-5 * 1e6, rtol=1e-5)


@pytest.mark.parametrize("block_size", [16, 64])
def test_quantized_pages_pay_off_at_a_small_budget_on_the_demo_model(block_size):
    """64 MiB and the default max_num_seqs (256): nothing is set aside for the sequences that may run
    (a full-precision block each would take half of it at block size 16, all of it at 64)."""
    def tokens(kv_cache_dtype: str) -> int:
        llm = LLM(kv_cache_dtype=kv_cache_dtype, kv_cache_memory="64MiB", block_size=block_size)
        assert llm.engine.scheduler_config.max_num_seqs == 256
        return llm.stats()["kv_blocks_total"] * block_size

    full = tokens("auto")
    assert tokens("int8") >= 1.9 * full and tokens("fp8") >= 1.9 * full
    # int4: head_dim / 2 bytes of numbers and a float16 (scale, minimum) a token, keys and values alike
    assert tokens("int4") >= 3.5 * full
