"""The seeds' formula: bytes = tokens x layers x 2 (K and V) x kv_heads x head_dim x bytes per number."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.config import ModelConfig


@dataclass(frozen=True)
class KVSpec:
    """Size of the KV cache of one model, per token and per block."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def from_model(cls, cfg: ModelConfig, dtype: torch.dtype) -> KVSpec:
        return cls(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype)

    @property
    def bytes_per_number(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.bytes_per_number

    def bytes_for(self, num_tokens: int) -> int:
        return num_tokens * self.bytes_per_token

    def bytes_per_block(self, block_size: int) -> int:
        return block_size * self.bytes_per_token

    def num_blocks_for(self, memory_bytes: int, block_size: int) -> int:
        """How many whole blocks fit in `memory_bytes`."""
        return memory_bytes // self.bytes_per_block(block_size)
