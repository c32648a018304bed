"""Quantized KV pages: the codecs of `kv_cache_dtype` and the layer cache that holds their pages.

A codec turns full-precision pages [kv_heads, n, block_size, head_dim] of K or of V into stored
numbers and their scales ("meta"), both with the block axis second so that a block table indexes
them alike. Codecs whose scales cover one token (int8, fp8) quantize each token as it is written.
A codec with scales over a block's tokens (int4's keys, per channel) quantizes a block once, when
it fills; until then its tokens are kept exact in the model's dtype, in the pages of the block
itself and of the blocks it borrows from the pool (its residual: KIVI's full-precision window).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

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


@dataclass
class Affine:
    """decode() = numbers() * scale + offset, in float32: one per token [KVH, *ids, BS], or with
    `per_channel` one per channel of each block [KVH, *ids, D] (in numbers()' order of channels).
    Attention applies them to its queries, scores and probabilities instead of to every number.
    The tensors are the codec's own (writable: blocks still filling get scale 1, offset 0)."""

    scale: torch.Tensor
    offset: torch.Tensor | None = None
    per_channel: bool = False


class Codec:
    """Quantizes K or V pages [KVH, n, BS, D]; `meta` holds the scales, [KVH, n, ...]."""

    storage_dtype: torch.dtype = torch.int8
    meta_dtype: torch.dtype = torch.float16
    pack = 1                 # numbers per stored element along head_dim
    splits_channels = False  # numbers() and per-channel scales hold the even channels, then the odd
    per_token = False        # a token's numbers and scales depend on that token alone: quantized as written

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

    per_token = True

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
    per_token = True

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


class Int4(Codec):
    """KIVI's asymmetric 4-bit quantization, two numbers per byte (even channel in the low nibble).

    `axis` is the one the group runs along: keys are grouped per channel over the block's tokens
    (axis -2: their outliers sit in fixed channels), values per token over the channels (axis -1).
    meta is (scale, minimum) stacked on the axis before the per-group one.
    """

    storage_dtype = torch.uint8
    pack = 2
    splits_channels = True

    def __init__(self, axis: int):
        self.axis = axis

    def meta_shape(self, block_size, head_dim):
        return (2, head_dim if self.axis == -2 else block_size)

    def encode(self, x):
        lo, hi = x.amin(self.axis), x.amax(self.axis)
        scale = ((hi - lo) / 15).clamp_min(TINY).to(self.meta_dtype)
        lo = lo.to(self.meta_dtype)
        q = ((x - self._expand(lo)) / self._expand(scale)).round_().clamp_(0, 15).to(torch.uint8)
        return q[..., 0::2] | (q[..., 1::2] << 4), torch.stack((scale, lo), -2)

    def decode(self, q, meta, dtype=torch.float32):
        numbers = torch.stack((q & 15, q >> 4), -1).flatten(-2).to(dtype)
        return numbers * self._expand(meta[..., 0, :], dtype) + self._expand(meta[..., 1, :], dtype)

    def numbers(self, q, dtype):
        # the low nibbles (even channels), then the high ones (odd): no interleaving pass
        half = q.shape[-1]
        out = torch.empty(*q.shape[:-1], 2 * half, dtype=dtype, device=q.device)
        out[..., :half] = q & 15
        out[..., half:] = q >> 4
        return out

    def affine(self, meta, block_size):
        if self.axis == -1:
            return Affine(*meta.float().unbind(-2))
        return Affine(*split_channels(meta.float()).unbind(-2), per_channel=True)

    def _expand(self, group: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Per-group values broadcast back over the group's axis."""
        return group.to(dtype).unsqueeze(self.axis)


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
        return Int4(axis=-2), Int4(axis=-1)
    raise ValueError(f"kv_cache_dtype must be one of auto, {', '.join(QUANTIZED_KV_CACHE_DTYPES)}, "
                     f"got {kv_cache_dtype!r}")


class QuantizedLayer:
    """One layer's quantized pages and their scales.

    With codecs that quantize whole blocks (int4), a block still filling holds its exact K/V in the
    model's dtype: for each K/V and head, its block_size x head_dim numbers lie end to end over the
    pages of the blocks in `residual_of[block]` (the block itself first, then those it borrows, then
    the block again where it has borrowed no more: places past its tokens; -1 once it is quantized),
    read and written through `residual`, the pages seen as numbers of the model's dtype [2, KVH,
    num_blocks * page_numbers]. residual_of is shared by every layer and kept by KVStorage. Codecs
    that quantize each token as it is written keep nothing exact (residual None).
    """

    def __init__(self, codecs: tuple[Codec, Codec], num_kv_heads: int, num_blocks: int, block_size: int,
                 head_dim: int, dtype: torch.dtype, residual_of: torch.Tensor):
        dev = residual_of.device
        self.k_codec, self.v_codec = k_codec, v_codec = codecs
        assert type(k_codec) is type(v_codec)        # K and V numbers share one tensor and decode alike
        # K and V numbers in one tensor, so that a gather indexes both at once; data[0], data[1] view it
        self.pages = torch.zeros(2, num_kv_heads, num_blocks, block_size, head_dim // k_codec.pack,
                                 dtype=k_codec.storage_dtype, device=dev)
        self.data = list(self.pages)
        self.meta = [torch.zeros(num_kv_heads, num_blocks, *c.meta_shape(block_size, head_dim),
                                 dtype=c.meta_dtype, device=dev) for c in codecs]
        self.residual_of = residual_of
        self.dtype = dtype
        self.shape = (2, num_kv_heads, num_blocks, block_size, head_dim)   # of the pages it stands for
        self.splits_channels = k_codec.splits_channels
        self.per_token = k_codec.per_token and v_codec.per_token
        self.page_numbers = k_codec.page_bytes(block_size, head_dim) // dtype.itemsize
        self.residual = None if self.per_token else \
            self.pages.view(torch.uint8).view(2, num_kv_heads, -1).view(dtype)

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        """Pages of blocks `ids` as [2, KVH, *ids.shape, BS, D] in the model's dtype: the exact
        tokens of blocks still filling, the dequantized ones of the rest; nothing else is decoded."""
        numbers = take_blocks(self.pages, ids, 2)
        k, v = (codec.decode(numbers[i], take_blocks(meta, ids, 1), self.dtype)
                for i, (codec, meta) in enumerate(zip((self.k_codec, self.v_codec), self.meta)))
        pages = torch.stack((k, v))
        self._put_filling(pages, self.filling(ids))
        return pages

    def filling(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Where the blocks still filling are in ids.flatten(), and the blocks holding their exact K/V
        ([n, pieces]): the same for every layer of a step (residual_of is shared), so a step can work
        it out once."""
        if self.residual is None:
            return ids.new_empty(0), self.residual_of[:0]
        pieces = self.residual_of[ids.flatten()]
        where = (pieces[:, 0] >= 0).nonzero().squeeze(1)
        return where, pieces[where]

    def gather_affine(self, ids: torch.Tensor, filling: tuple[torch.Tensor, torch.Tensor]
                      ) -> tuple[torch.Tensor, Affine, Affine]:
        """Blocks `ids` as numbers [2, KVH, *ids.shape, BS, D] in the model's dtype (channels as
        `splits_channels` says) and the K and V scales that make them gather(ids); blocks still
        filling (`filling(ids)`, which a step works out once) hold their exact tokens, with scale 1
        and offset 0."""
        bs = self.shape[3]
        k_affine = self.k_codec.affine(take_blocks(self.meta[0], ids, 1), bs)
        v_affine = self.v_codec.affine(take_blocks(self.meta[1], ids, 1), bs)
        pages = self.k_codec.numbers(take_blocks(self.pages, ids, 2), self.dtype)
        self._put_filling(pages, filling, self.splits_channels)
        if len(filling[0]):
            for affine in (k_affine, v_affine):
                affine.scale.flatten(1, -2).index_fill_(1, filling[0], 1.0)
                if affine.offset is not None:
                    affine.offset.flatten(1, -2).index_fill_(1, filling[0], 0.0)
        return pages, k_affine, v_affine

    def _put_filling(self, pages: torch.Tensor, filling: tuple[torch.Tensor, torch.Tensor], split: bool = False):
        """Overwrite the gathered pages [2, KVH, *ids.shape, BS, D] of blocks still filling with their
        exact tokens."""
        where, pieces = filling
        if len(where):
            exact = self.read_residual(pieces)
            if split:
                exact = split_channels(exact)
            _words(pages.flatten(2, -3), 2).index_copy_(2, where, _words(exact, 2))

    def read_residual(self, pieces: torch.Tensor) -> torch.Tensor:
        """The exact K/V [2, KVH, n, BS, D] of n blocks still filling, from their pieces [n, P] (the
        pieces may not reach a block's last place, which a block held exact never uses: read as 0)."""
        _, kvh, _, bs, d = self.shape
        numbers = take_blocks(self.residual.view(2, kvh, -1, self.page_numbers), pieces, 2).flatten(3)
        return F.pad(numbers, (0, bs * d - numbers.shape[-1])).unflatten(-1, (bs, d))

    def write_tokens(self, kv: torch.Tensor, slots: torch.Tensor) -> None:
        """Quantize the step's K and V [tokens, 2, KVH, D] into their slots (block * BS + offset), each
        token on its own: for codecs whose scales cover one token (`per_token`)."""
        _, kvh, nb, bs, _ = self.shape
        numbers, scales = self.k_codec.encode(kv.permute(1, 2, 0, 3).float())    # [2, KVH, n, D / pack], [2, KVH, n]
        self.pages.view(2, kvh, nb * bs, -1).index_copy_(2, slots, numbers)
        for meta, scale in zip(self.meta, scales):
            meta.view(kvh, nb * bs).index_copy_(1, slots, scale)

    def quantize(self, blocks: torch.Tensor, pages: torch.Tensor) -> None:
        """Encode full pages [2, KVH, n, BS, D] into blocks `blocks`."""
        for i, codec in enumerate((self.k_codec, self.v_codec)):
            q, meta = codec.encode(pages[i].float())
            self.data[i].index_copy_(1, blocks, q)
            self.meta[i].index_copy_(1, blocks, meta)

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        self.pages[:, :, dst] = self.pages[:, :, src]
        for t in self.meta:
            t[:, dst] = t[:, src]


@dataclass
class WritePlan:
    """Where one step's new K/V go in the quantized layers, worked out once for all of them.

    Codecs that quantize each token as it is written need only the step's slot_mapping (every field
    empty). Otherwise token indices are into the step's flat batch, and exact indices into a layer's
    `residual` numbers (head_dim of them a token).
    """

    exact: tuple[torch.Tensor, torch.Tensor]      # (tokens, residual numbers) of blocks left part full
    filled_blocks: torch.Tensor                   # blocks that fill, quantized from their exact tokens ...
    filled_pieces: torch.Tensor                   # ... held in these pieces [n, P] ...
    filled_new: tuple[torch.Tensor, torch.Tensor]  # ... and the step's (tokens, places in [n * BS])
    direct_tokens: torch.Tensor                   # whole blocks written by this step: quantized at once
    direct_blocks: torch.Tensor

    def write(self, layer: QuantizedLayer, kv: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store the step's K/V [tokens, 2, KVH, D] in a layer: each token at its slot where the codecs
        quantize tokens; else the tokens of blocks left part full join their exact ones, and the
        blocks that fill (from their exact tokens and the step's, or straight from the step) are
        quantized."""
        if layer.per_token:
            layer.write_tokens(kv, slot_mapping)
            return
        tokens, index = self.exact
        if len(tokens):
            layer.residual.index_copy_(2, index, kv[tokens].permute(1, 2, 0, 3).flatten(2))
        blocks, pages = [], []
        _, kvh, _, bs, d = layer.shape
        if len(self.filled_blocks):
            filled = layer.read_residual(self.filled_pieces).contiguous()     # [2, KVH, n, BS, D]
            tokens, places = self.filled_new
            filled.view(2, kvh, -1, d).index_copy_(2, places, kv[tokens].permute(1, 2, 0, 3))
            blocks.append(self.filled_blocks)
            pages.append(filled)
        if len(self.direct_blocks):
            blocks.append(self.direct_blocks)
            pages.append(kv[self.direct_tokens].unflatten(0, (-1, bs)).permute(2, 3, 0, 1, 4))
        if blocks:
            layer.quantize(torch.cat(blocks), torch.cat(pages, 2))
