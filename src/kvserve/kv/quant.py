"""Quantized KV pages: the codecs of `kv_cache_dtype` (kv/pages.py holds their pages).

A codec turns full-precision pages [kv_heads, n, block_size, head_dim] of K or of V into stored
numbers and their scales ("meta"), both with the block axis second so that a block table indexes
them alike. Every codec's scales cover one token (int4's too, for keys as for values), so a token
is quantized as it is written and a block still filling needs nothing kept exact beside its pages.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from kvserve.config import KV_CACHE_DTYPES, QUANTIZED_KV_CACHE_DTYPES, parse_dtype

FP8_MAX = 448.0          # largest finite float8_e4m3fn
# floor of a scale (float16's smallest normal number), so that an all-zero group decodes to zeros
TINY = torch.finfo(torch.float16).tiny


def _words(t: torch.Tensor, axis: int) -> torch.Tensor:
    """t with everything after `axis` as one row of the widest words that fit it.

    Indexing moves rows of 8-byte words where their size allows: the CPU's index kernels copy
    element by element, so 1- and 2-byte numbers move several times slower than the same bytes as int64.
    """
    rows = t.flatten(axis + 1) if t.dim() > axis + 1 else t.unsqueeze(-1)
    width = next(w for w in (8, 4, 2, 1) if rows.shape[-1] * t.itemsize % w == 0)
    return rows.view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[width])


def split_channels(x: torch.Tensor) -> torch.Tensor:
    """[..., D] with the even channels first, then the odd ones."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


def merge_channels(x: torch.Tensor) -> torch.Tensor:
    """The inverse of split_channels."""
    return x.unflatten(-1, (2, -1)).transpose(-1, -2).flatten(-2)


def take_blocks(t: torch.Tensor, ids: torch.Tensor, axis: int) -> torch.Tensor:
    """t indexed by block ids along `axis` (everything after it moves as one row per block)."""
    index = (slice(None),) * axis + (ids,)
    return _words(t, axis)[index].view(t.dtype).reshape(*t.shape[:axis], *ids.shape, *t.shape[axis + 1:])


def hadamard_block(head_dim: int) -> int:
    """The size of rotate_keys_'s Hadamard blocks: the largest power of two dividing head_dim."""
    return head_dim & -head_dim


def rotate_keys_(x: torch.Tensor) -> None:
    """x [..., D] times the orthonormal block-diagonal Hadamard matrix H of blocks hadamard_block(D) (Sylvester's,
    over sqrt(block)), in place (in float32, then rounded to x's dtype). H is symmetric and orthonormal, so it is
    its own inverse, and rotating both q and k leaves every score q . k as it was.

    By the fast Walsh-Hadamard transform's butterflies (span 1, 2, 4, ...: the numbers span apart in each run of
    2 span become their sum and their difference), then the scale: each number's sums in one order, which
    csrc/kv_codecs.c repeats bit for bit (a matrix product's order is its library's)."""
    d = x.shape[-1]
    n = hadamard_block(d)
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device).copy_(x).view(-1, d)
    spare = torch.empty_like(y)
    span = 1
    while span < n:
        src, dst = (t.view(-1, d // (2 * span), 2, span) for t in (y, spare))
        torch.add(src[:, :, 0], src[:, :, 1], out=dst[:, :, 0])
        torch.sub(src[:, :, 0], src[:, :, 1], out=dst[:, :, 1])
        y, spare = spare, y
        span *= 2
    x.copy_(y.mul_(1 / math.sqrt(n)).view(x.shape))


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """x summed over its last axis in one fixed order, which csrc/kv_codecs.c repeats bit for bit (torch.sum's
    order is its own, by vector width): the second half added to the first (an odd one out kept last) until one
    number is left."""
    while x.shape[-1] > 1:
        n, half = x.shape[-1], x.shape[-1] // 2
        head = x[..., :half] + x[..., half:2 * half]
        x = head if n % 2 == 0 else torch.cat((head, x[..., 2 * half:]), -1)
    return x[..., 0]


@dataclass
class Affine:
    """decode() = numbers() * scale + offset, in float32, one of each per token [KVH, *ids, BS].
    Attention applies them to its scores and probabilities instead of to every number."""

    scale: torch.Tensor
    offset: torch.Tensor | None = None


class Codec:
    """Quantizes K or V pages [KVH, n, BS, D]; `meta` holds the scales, [KVH, n, ...]."""

    storage_dtype: torch.dtype = torch.int8
    meta_dtype: torch.dtype = torch.float16
    pack = 1                 # numbers per stored element along head_dim
    splits_channels = False  # numbers() holds the even channels, then the odd
    rotates_keys = False     # keys (and queries) pass through rotate_keys_ before they meet the cache

    def meta_shape(self, block_size: int, head_dim: int) -> tuple[int, ...]:
        """Shape of one (head, block)'s scales."""
        raise NotImplementedError

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def decode(self, q: torch.Tensor, meta: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Pages in `dtype` from stored numbers and scales gathered alike ([KVH, *ids, ...]); the
        stored numbers are exact in any float dtype, so a bf16 model decodes in bf16 directly."""
        return self.numbers(q, dtype) * self.affine(meta, q.shape[-2]).scale.to(dtype)[..., None]

    def numbers(self, q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The stored numbers as floats (exactly), without their scales."""
        raise NotImplementedError

    def affine(self, meta: torch.Tensor, block_size: int) -> Affine:
        """The scales of gathered meta such that decode() = numbers() * scale + offset."""
        raise NotImplementedError

    def page_bytes(self, block_size: int, head_dim: int) -> int:
        """Bytes of the numbers of one (head, block), without their scales."""
        return block_size * head_dim // self.pack * self.storage_dtype.itemsize

    def bytes_per_block(self, block_size: int, head_dim: int) -> int:
        """Bytes of one (head, block): numbers and scales."""
        numbers = self.page_bytes(block_size, head_dim)
        meta = self.meta_dtype.itemsize
        for n in self.meta_shape(block_size, head_dim):
            meta *= n
        return numbers + meta


class Int8PerToken(Codec):
    """Symmetric int8, one scale per token and head."""

    def meta_shape(self, block_size, head_dim):
        return (block_size,)

    def encode(self, x):
        scale = (x.abs().amax(-1) / 127).clamp_min(TINY).to(self.meta_dtype)
        q = (x / scale.float()[..., None]).round_().clamp_(-127, 127).to(torch.int8)
        return q, scale

    def numbers(self, q, dtype):
        return q.to(dtype)

    def affine(self, meta, block_size):
        return Affine(meta.float())


class Fp8PerToken(Codec):
    """float8_e4m3fn numbers with one float16 scale per token and head, set from the token's largest
    magnitude as it is written: no calibration pass, and no number saturates.

    Stored as their bytes (uint8): index_copy and gathers do not take float8 on every device.
    """

    storage_dtype = torch.uint8

    def meta_shape(self, block_size, head_dim):
        return (block_size,)

    def encode(self, x):
        scale = (x.abs().amax(-1) / FP8_MAX).clamp_min(TINY).to(self.meta_dtype)
        q = (x / scale.float()[..., None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return q.view(torch.uint8), scale

    def numbers(self, q, dtype):
        # float8 -> float conversion is slow on the CPU. An e4m3 byte's bits placed in a bfloat16's
        # exponent and mantissa fields give the same number times 2^-120 (subnormals included), and
        # times 2^120 (exact) it is the number itself, which every float dtype holds. Sign-extending
        # the byte and shifting it by 4 puts its sign in bit 15; the mask 0x87F0 clears the copies
        # of it in bits 11-14.
        x = q.view(torch.int8).to(torch.int16)
        x <<= 4
        x &= -0x7810
        return x.view(torch.bfloat16).mul_(2.0 ** 120).to(dtype)

    def affine(self, meta, block_size):
        return Affine(meta.float())


@functools.cache
def _on_device(values: tuple, device: torch.device) -> torch.Tensor:
    """A tensor of constants, made once per device: not inside a CUDA graph capture, which cannot copy
    from the host."""
    return torch.tensor(values, device=device)


def int4_levels(x: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """x [..., D] as the nearest of the 16 levels minimum + i * scale (i = 0..15), as floats i; scale and
    minimum are [...] (float16) and may lead with more axes than x (they broadcast)."""
    return (x - minimum.float()[..., None]).div_(scale.float()[..., None]).round_().clamp_(0, 15)


class Int4(Codec):
    """Asymmetric 4-bit quantization, two numbers per byte (even channel in the low nibble), with a
    float16 (scale, minimum) per token and head over its head_dim channels, for keys as for values.

    KIVI groups keys per channel over a block's tokens (their outliers sit in fixed channels), but
    then a block can only be quantized once it is full, and its (scale, minimum) per channel cost
    4 x head_dim / block_size bytes a token: at the default block size 16 as much as half the
    keys' own numbers. Per token, a token costs head_dim + 8 bytes (K and V) whatever the block
    size, and is quantized as it is written (docs/performance.md: the perplexity barely moves).
    meta is (scale, minimum) [2, block_size].

    Per token, a key's few outlier channels would set its range and leave 16 levels too coarse for the
    rest: keys are stored rotated by a block Hadamard matrix (rotate_keys_, as QuaRot does), which spreads
    an outlier over its block, and the queries meet them rotated alike (rotates_keys).

    A row's min and max are one or two of its head_dim numbers, and the grid that puts them on its end
    levels is seldom the one that serves the whole row best: encode tries it and grids with the lowest
    level, the highest or both moved a little inward (a finer step for the rest), and keeps, per token and
    head, the one that reconstructs the row with the least squared error (after the float16 rounding of
    its scale and minimum). Least-squares grids shrink what comes back toward the middle of the range,
    and keys shrunk alike would scale every score down and flatten attention: the kept grid is stretched
    about zero (scale and minimum times x . x / (back . x)) so that the row comes back unshrunk along
    itself, its numbers unchanged. The format and its readers stay as they were: only the (scale,
    minimum) written, and the numbers they choose, change (docs/performance.md: perplexity, passkey).
    """

    storage_dtype = torch.uint8
    pack = 2
    splits_channels = True
    rotates_keys = True
    # fit's candidate grids: how far each moves its lowest and its highest level inward, in steps of the
    # min-max grid; less than half a step, so that a row's end numbers come back about as close as under it
    inward_steps = ((0.0, 0.0), (0.45, 0.0), (0.0, 0.45), (0.45, 0.45))

    def meta_shape(self, block_size, head_dim):
        return (2, block_size)

    def encode(self, x):
        q, scale, minimum = self.fit(x)
        q = q.to(torch.uint8)
        return q[..., 0::2] | (q[..., 1::2] << 4), torch.stack((scale, minimum), -2)

    def fit(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each row of x [..., D] as its numbers 0..15 (floats, [..., D]) and float16 (scale, minimum) [...]:
        of its candidate grids, the one that reconstructs it with the least squared error, stretched so that
        it comes back unshrunk along itself (see the class). Its sums over a row are row_sum's, so that
        csrc/kv_codecs.c chooses the same grid, bit for bit."""
        lo, hi = x.amin(-1), x.amax(-1)
        step = (hi - lo) / 15
        inward = _on_device(self.inward_steps, x.device).view(-1, 2, *(1,) * lo.dim())
        low, high = lo + inward[:, 0] * step, hi - inward[:, 1] * step          # [grids, ...]
        scale = ((high - low) / 15).clamp_min(TINY).to(self.meta_dtype)
        minimum = low.to(self.meta_dtype)
        q = int4_levels(x, scale, minimum)
        back = torch.addcmul(minimum.float()[..., None], q, scale.float()[..., None])
        best = row_sum(back.sub_(x).square_()).argmin(0, keepdim=True)   # the first of equals: the min-max grid
        scale, minimum = scale.gather(0, best)[0].float(), minimum.gather(0, best)[0].float()
        q = q.gather(0, best[..., None].expand(1, *x.shape))[0]
        along = scale * row_sum(q * x) + minimum * row_sum(x)               # back . x
        stretch = torch.where(along > 0, row_sum(x * x) / along, 1.0)
        return q, (scale * stretch).clamp_min(TINY).to(self.meta_dtype), (minimum * stretch).to(self.meta_dtype)

    def decode(self, q, meta, dtype=torch.float32):
        numbers = torch.stack((q & 15, q >> 4), -1).flatten(-2).to(dtype)
        return numbers * meta[..., 0, :, None].to(dtype) + meta[..., 1, :, None].to(dtype)

    def numbers(self, q, dtype):
        # the low nibbles (even channels), then the high ones (odd): no interleaving pass
        half = q.shape[-1]
        out = torch.empty(*q.shape[:-1], 2 * half, dtype=dtype, device=q.device)
        out[..., :half] = q & 15
        out[..., half:] = q >> 4
        return out

    def affine(self, meta, block_size):
        return Affine(*meta.float().unbind(-2))


def resolve_kv_cache_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> str:
    """The kv_cache_dtype of pages beside a model computing in `dtype`: `auto` where it names that dtype
    (bfloat16, bf16, float16, fp16: full-precision pages hold the model's numbers), a quantized one
    as it is. ValueError for a name of another dtype, or no kv_cache_dtype at all."""
    if kv_cache_dtype == "auto" or kv_cache_dtype in QUANTIZED_KV_CACHE_DTYPES:
        return kv_cache_dtype
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    named, model = (str(t).removeprefix("torch.") for t in (parse_dtype(kv_cache_dtype), dtype))
    if named != model:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} asks for {named} pages, but full-precision pages "
                         f"hold the model's numbers ({model}): use auto, a quantized kv_cache_dtype "
                         f"({', '.join(QUANTIZED_KV_CACHE_DTYPES)}) or dtype {kv_cache_dtype!r}")
    return "auto"


def codecs(kv_cache_dtype: str) -> tuple[Codec, Codec] | None:
    """The (K, V) codecs of a `kv_cache_dtype`; None for `auto` (the model's dtype)."""
    if kv_cache_dtype == "auto":
        return None
    if kv_cache_dtype == "int8":
        return Int8PerToken(), Int8PerToken()
    if kv_cache_dtype == "fp8":
        return Fp8PerToken(), Fp8PerToken()
    if kv_cache_dtype == "int4":
        return Int4(), Int4()
    raise ValueError(f"kv_cache_dtype must be one of auto, {', '.join(QUANTIZED_KV_CACHE_DTYPES)}, "
                     f"got {kv_cache_dtype!r}")
