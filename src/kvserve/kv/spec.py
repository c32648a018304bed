"""The KV cache arithmetic: bytes = tokens x layers x 2 (K and V) x kv_heads x head_dim x bytes per number.

With a quantized cache the bytes per number shrink and the scales are added: they are counted per
block (a codec's scales can cover a whole block), so bytes per token are a block's bytes over its
tokens. A codec that quantizes whole blocks (int4) keeps the block each sequence is filling exact,
in the model's dtype, in its own pages and in blocks it borrows from the same pool as it fills
(`borrowed_blocks`), returned once it is quantized.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from kvserve.config import ModelConfig
from kvserve.kv.quant import codecs, resolve_kv_cache_dtype


@dataclass(frozen=True)
class KVSpec:
    """Size of the KV cache of one model, per token and per block."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int = 16
    kv_cache_dtype: str = "auto"
    skip_layers: tuple[int, ...] = ()     # layers kept in `dtype` when kv_cache_dtype quantizes

    def __post_init__(self):
        object.__setattr__(self, "kv_cache_dtype", resolve_kv_cache_dtype(self.kv_cache_dtype, self.dtype))
        pair = codecs(self.kv_cache_dtype)
        bad = [i for i in self.skip_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"kv_cache_dtype_skip_layers {bad} are not layers of this model "
                             f"(0..{self.num_layers - 1})")
        page = pair[0].page_bytes(self.block_size, self.head_dim) if pair else 0
        if pair and not pair[0].per_token and page % self.bytes_per_number:
            raise ValueError(f"block_size {self.block_size}: kv_cache_dtype {self.kv_cache_dtype} keeps the blocks "
                             f"being filled exact in the pages, whose {page} bytes (block_size x head_dim "
                             f"{self.head_dim}) must hold whole {self.dtype} numbers")

    @classmethod
    def from_model(cls, cfg: ModelConfig, dtype: torch.dtype, block_size: int = 16, kv_cache_dtype: str = "auto",
                   skip_layers: tuple[int, ...] = ()) -> KVSpec:
        return cls(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype, block_size, kv_cache_dtype,
                   tuple(skip_layers))

    @property
    def bytes_per_number(self) -> int:
        return self.dtype.itemsize

    @property
    def quantized_layers(self) -> list[int]:
        if self.kv_cache_dtype == "auto":
            return []
        return [i for i in range(self.num_layers) if i not in self.skip_layers]

    @property
    def full_precision_block_bytes(self) -> int:
        """One layer's K and V of one block in the model's dtype."""
        return 2 * self.num_kv_heads * self.block_size * self.head_dim * self.bytes_per_number

    @property
    def bytes_per_block(self) -> int:
        quantized = self.quantized_layers
        total = (self.num_layers - len(quantized)) * self.full_precision_block_bytes
        if quantized:
            per_layer = sum(c.bytes_per_block(self.block_size, self.head_dim) for c in codecs(self.kv_cache_dtype))
            total += len(quantized) * self.num_kv_heads * per_layer
        return total

    @property
    def bytes_per_token(self) -> float:
        """Bytes of one cached token, its share of the block's scales included."""
        per_token = self.bytes_per_block / self.block_size
        return int(per_token) if per_token.is_integer() else per_token

    @cached_property
    def borrowed_blocks(self) -> tuple[int, ...] | None:
        """Blocks that a block holding t exact tokens (t < block_size) borrows, its own pages holding
        the first of them: a quantized block's pages hold fewer bytes than the same tokens in `dtype`.
        None where no block is held exact: no quantized layer, or codecs that quantize each token as it
        is written (int8, fp8)."""
        pair = codecs(self.kv_cache_dtype)
        if not self.quantized_layers or all(c.per_token for c in pair):
            return None
        page, row = pair[0].page_bytes(self.block_size, self.head_dim), self.head_dim * self.bytes_per_number
        return tuple(max(0, -(-t * row // page) - 1) for t in range(self.block_size))

    @property
    def residual_pieces(self) -> int:
        """The most blocks holding one block's exact tokens: itself and those it borrows (0: none)."""
        borrowed = self.borrowed_blocks
        return 0 if borrowed is None else 1 + borrowed[-1]

    @property
    def residual_blocks(self) -> int:
        """The most blocks one block borrows while it fills (0: none)."""
        return max(0, self.residual_pieces - 1)

    @property
    def mean_borrowed_blocks(self) -> float:
        """Blocks a sequence's last block borrows, averaged over how full it is (0 to block_size - 1
        tokens past the full blocks)."""
        borrowed = self.borrowed_blocks
        return 0.0 if borrowed is None else sum(borrowed) / self.block_size

    def bytes_for(self, num_tokens: int) -> float:
        return num_tokens * self.bytes_per_token

    def bytes_held(self, num_tokens: int) -> int:
        """Bytes a sequence of num_tokens cached tokens holds in a paged pool: its blocks, and those its
        last block borrows while it is part full."""
        borrowed = self.borrowed_blocks[num_tokens % self.block_size] if self.borrowed_blocks else 0
        return (-(-num_tokens // self.block_size) + borrowed) * self.bytes_per_block

    def num_blocks_for(self, memory_bytes: int) -> int:
        """How many whole blocks fit in `memory_bytes`."""
        return memory_bytes // self.bytes_per_block
