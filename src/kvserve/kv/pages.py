"""One layer's K and V pages over the pool's block ids, in a PageFormat: the model's dtype, or quantized.

Attention backends read a layer's pages through this interface and ask its `format` what they hold, never
its class: full-precision pages are numbers to read as they are; quantized ones (kv/quant.py's codecs)
are stored numbers with each token's scales, which a backend decodes as it reads (or `gather` decodes).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from kvserve.kernels import fallback, function
from kvserve.kv.quant import Affine, Codec, codecs, take_blocks
from kvserve.kv.summaries import PageSummaries


@dataclass(frozen=True)
class PageFormat:
    """How a layer's pages hold K and V: `name` is the model's dtype's ("float32", "bfloat16") for full
    precision, else the kv_cache_dtype ("int8", "fp8", "int4") whose codecs quantize each token as it is
    written. `dtype` is the model's: what reading the pages gives."""

    name: str
    dtype: torch.dtype
    codecs: tuple[Codec, Codec] | None = None

    @classmethod
    def of(cls, kv_cache_dtype: str, dtype: torch.dtype) -> PageFormat:
        """The format of kv_cache_dtype's pages beside a model computing in `dtype` ("auto": the model's)."""
        if kv_cache_dtype == "auto":
            return cls(str(dtype).removeprefix("torch."), dtype)
        return cls(kv_cache_dtype, dtype, codecs(kv_cache_dtype))

    @property
    def quantized(self) -> bool:
        return self.codecs is not None

    @property
    def rotates_keys(self) -> bool:
        """Keys are stored turned by rotate_keys_ (the queries must turn alike, for unchanged scores)."""
        return self.quantized and self.codecs[0].rotates_keys

    @property
    def splits_channels(self) -> bool:
        """The stored numbers hold each head's even channels, then its odd ones."""
        return self.quantized and self.codecs[0].splits_channels


class LayerPages(ABC):
    """A layer's pages [2 (K, V), kv_heads, num_blocks, block_size, head_dim] in its `format`."""

    format: PageFormat
    shape: tuple[int, int, int, int, int]        # of the pages it stands for
    # K's and V's stored numbers [kv_heads, num_blocks, block_size, head_dim / numbers per element]
    data: list[torch.Tensor]
    # its blocks' key summaries (kv/summaries.py), kept by every write where the storage keeps them, else None
    summaries: PageSummaries | None = None

    @property
    def dtype(self) -> torch.dtype:
        """The model's dtype: what reading the pages gives."""
        return self.format.dtype

    @property
    @abstractmethod
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every tensor holding the pages: the stored numbers [2, ...] first, then their scales if any."""

    @abstractmethod
    def block_parts(self) -> list[tuple[torch.Tensor, int]]:
        """Every tensor holding blocks, with its block axis: what a block's bytes are (KVStorage.read_blocks)."""

    @abstractmethod
    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        """Pages of blocks `ids` as [2, KVH, *ids.shape, BS, D] in the model's dtype (decoded: only these)."""

    @abstractmethod
    def decoded_keys(self, ids: torch.Tensor) -> torch.Tensor:
        """Keys of blocks `ids` [KVH, n, BS, D] as attention reads them, in float32: what the summaries bound."""

    @abstractmethod
    def write_tokens(self, kv: torch.Tensor, slots: torch.Tensor) -> None:
        """Store tokens' K and V [tokens, 2, KVH, D] at their slots (block * BS + offset), and their keys'
        summaries."""

    @abstractmethod
    def write_pages(self, blocks: torch.Tensor, pages: torch.Tensor) -> None:
        """Store whole pages [2, KVH, n, BS, D] (the model's dtype) into blocks `blocks`, and their summaries."""

    @abstractmethod
    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy whole blocks src -> dst (the storage copies their summaries)."""

    def summarize_tokens(self, keys: torch.Tensor, slots: torch.Tensor) -> None:
        """Take tokens' keys [tokens, KVH, D] (as attention reads them) written at `slots` into the summaries."""
        if self.summaries is not None:
            self.summaries.add_tokens(keys, slots)

    def summarize_blocks(self, blocks: torch.Tensor) -> None:
        """The summaries of whole blocks, from their pages (written whole)."""
        if self.summaries is not None:
            self.summaries.set_blocks(blocks, self.decoded_keys(blocks))


class FullPages(LayerPages):
    """Pages in the model's dtype: `pages` itself (a view of the storage's one tensor of every such layer)."""

    def __init__(self, pages: torch.Tensor):
        self.pages = pages
        self.format = PageFormat.of("auto", pages.dtype)
        self.shape = tuple(pages.shape)
        self.data = [pages[0], pages[1]]

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.pages,)

    def block_parts(self) -> list[tuple[torch.Tensor, int]]:
        return [(self.pages, 2)]

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        return take_blocks(self.pages, ids, 2)

    def decoded_keys(self, ids: torch.Tensor) -> torch.Tensor:
        return take_blocks(self.pages[0], ids, 1).float()

    def write_tokens(self, kv: torch.Tensor, slots: torch.Tensor) -> None:
        self._store(kv, slots)
        self.summarize_tokens(kv[:, 0], slots)

    def _store(self, kv: torch.Tensor, slots: torch.Tensor) -> None:
        """On the CPU by a C loop of row copies (fewer passes than index_copy_), from rows in which each token's
        K/V heads are adjacent (a step's are views of its qkv rows; others, such as an eviction's gathered
        tokens, are copied so)."""
        pages = self.pages
        tokens, _, kvh, d = kv.shape
        fn = function("store_kv") if pages.device.type == "cpu" else None
        if fn is None or kv.dtype != pages.dtype or not pages.is_contiguous():
            if pages.device.type == "cpu":
                fallback("store_kv", "the kernels are not built" if fn is None else
                         "the pages are not contiguous, or not of the K/V's dtype")
            pages.view(2, pages.shape[1], -1, pages.shape[-1]).index_copy_(2, slots, kv.permute(1, 2, 0, 3))
            return
        if not (kv.stride(3) == 1 and kv.stride(2) == d and kv.stride(1) == kvh * d):
            kv = kv.contiguous()
        slots = slots.to(torch.int64).contiguous()
        fn(kv.data_ptr(), kv.stride(0), tokens, kvh, d, slots.data_ptr(), pages.data_ptr(), pages.shape[2],
           pages.shape[3], kv.element_size())

    def write_pages(self, blocks: torch.Tensor, pages: torch.Tensor) -> None:
        self.pages[:, :, blocks] = pages
        self.summarize_blocks(blocks)

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        self.pages[:, :, dst] = self.pages[:, :, src]


class QuantizedPages(LayerPages):
    """One layer's quantized pages and their scales; each token is quantized as it is written."""

    def __init__(self, fmt: PageFormat, num_kv_heads: int, num_blocks: int, block_size: int, head_dim: int,
                 device: torch.device):
        self.format = fmt
        self.k_codec, self.v_codec = k_codec, v_codec = fmt.codecs
        assert type(k_codec) is type(v_codec)        # K and V numbers share one tensor and decode alike
        # K and V numbers in one tensor, so that a gather indexes both at once; data[0], data[1] view it
        self.pages = torch.zeros(2, num_kv_heads, num_blocks, block_size, head_dim // k_codec.pack,
                                 dtype=k_codec.storage_dtype, device=device)
        self.data = list(self.pages)
        self.meta = [torch.zeros(num_kv_heads, num_blocks, *c.meta_shape(block_size, head_dim),
                                 dtype=c.meta_dtype, device=device) for c in fmt.codecs]
        self.shape = (2, num_kv_heads, num_blocks, block_size, head_dim)

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.pages, *self.meta)

    def block_parts(self) -> list[tuple[torch.Tensor, int]]:
        return [(self.pages, 2), (self.meta[0], 1), (self.meta[1], 1)]

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        numbers = take_blocks(self.pages, ids, 2)
        return torch.stack([codec.decode(numbers[i], take_blocks(meta, ids, 1), self.dtype)
                            for i, (codec, meta) in enumerate(zip((self.k_codec, self.v_codec), self.meta))])

    def gather_affine(self, ids: torch.Tensor) -> tuple[torch.Tensor, Affine, Affine]:
        """Blocks `ids` as numbers [2, KVH, *ids.shape, BS, D] in the model's dtype (channels as the format's
        `splits_channels` says) and the K and V scales that make them gather(ids)."""
        bs = self.shape[3]
        k_affine = self.k_codec.affine(take_blocks(self.meta[0], ids, 1), bs)
        v_affine = self.v_codec.affine(take_blocks(self.meta[1], ids, 1), bs)
        return self.k_codec.numbers(take_blocks(self.pages, ids, 2), self.dtype), k_affine, v_affine

    def decoded_keys(self, ids: torch.Tensor) -> torch.Tensor:
        return self.k_codec.decode(take_blocks(self.data[0], ids, 1), take_blocks(self.meta[0], ids, 1),
                                   torch.float32)

    def write_tokens(self, kv: torch.Tensor, slots: torch.Tensor) -> None:
        """Each token quantized on its own."""
        _, kvh, nb, bs, _ = self.shape
        # [2, KVH, n, D / pack] numbers, [2, KVH, n, ...] scales
        numbers, scales = self.k_codec.encode(kv.permute(1, 2, 0, 3).float())
        self.pages.view(2, kvh, nb * bs, -1).index_copy_(2, slots, numbers)
        rows = self.meta[0][0, 0].numel() // bs      # scales a token has: int4's scale and minimum, else one
        # where they are in a head's meta [num_blocks, rows, BS] seen flat: row by row, as encode stacks them
        at = (slots // bs * rows * bs + slots % bs) + bs * torch.arange(rows, device=slots.device)[:, None]
        for meta, scale in zip(self.meta, scales):
            meta.view(kvh, -1).index_copy_(1, at.flatten(), scale.reshape(kvh, -1))
        if self.summaries is not None:      # the keys as they decode: [KVH, tokens, D]
            self.summarize_tokens(self.k_codec.decode(numbers[0], scales[0], torch.float32).transpose(0, 1), slots)

    def write_pages(self, blocks: torch.Tensor, pages: torch.Tensor) -> None:
        """Encode full pages [2, KVH, n, BS, D] into blocks `blocks`."""
        for i, codec in enumerate((self.k_codec, self.v_codec)):
            q, meta = codec.encode(pages[i].float())
            self.data[i].index_copy_(1, blocks, q)
            self.meta[i].index_copy_(1, blocks, meta)
        self.summarize_blocks(blocks)

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        self.pages[:, :, dst] = self.pages[:, :, src]
        for t in self.meta:
            t[:, dst] = t[:, src]
