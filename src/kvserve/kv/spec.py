"""The KV cache arithmetic: bytes = tokens x layers x 2 (K and V) x kv_heads x head_dim x bytes per number.

With a quantized cache the bytes per number shrink and the scales are added: they are counted per
block, so bytes per token are a block's bytes over its tokens. Where sparse attention is on, each block also
holds its keys' summaries (kv/summaries.py): per layer and KV head a minimum and a maximum of head_dim numbers
in the model's dtype.
"""
from __future__ import annotations

from dataclasses import dataclass

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
    summaries: bool = False               # the blocks' key summaries are kept (sparse attention)

    def __post_init__(self):
        object.__setattr__(self, "kv_cache_dtype", resolve_kv_cache_dtype(self.kv_cache_dtype, self.dtype))
        bad = [i for i in self.skip_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"kv_cache_dtype_skip_layers {bad} are not layers of this model "
                             f"(0..{self.num_layers - 1})")

    @classmethod
    def from_model(cls, cfg: ModelConfig, dtype: torch.dtype, block_size: int = 16, kv_cache_dtype: str = "auto",
                   skip_layers: tuple[int, ...] = (), summaries: bool = False) -> KVSpec:
        return cls(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype, block_size, kv_cache_dtype,
                   tuple(skip_layers), summaries)

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
        """What a block holds: its pages (page_bytes_per_block) and its summaries."""
        return self.page_bytes_per_block + self.summary_bytes_per_block

    @property
    def summary_bytes_per_block(self) -> int:
        """One block's key summaries in every layer (none where they are not kept)."""
        return self.num_layers * self.num_kv_heads * 2 * self.head_dim * self.bytes_per_number if self.summaries else 0

    @property
    def page_bytes_per_block(self) -> int:
        """One block's pages in every layer, quantized ones with their scales: a block's bytes as KVStorage.read_blocks
        gives them and a second tier stores them (the summaries are made again from them)."""
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

    def bytes_for(self, num_tokens: int) -> float:
        return num_tokens * self.bytes_per_token

    def bytes_held(self, num_tokens: int) -> int:
        """Bytes a sequence of num_tokens cached tokens holds in a paged pool: its blocks."""
        return -(-num_tokens // self.block_size) * self.bytes_per_block

    def num_blocks_for(self, memory_bytes: int) -> int:
        """How many whole blocks fit in `memory_bytes`."""
        return memory_bytes // self.bytes_per_block
