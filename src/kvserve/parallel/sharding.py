"""How a model splits across N tensor-parallel ranks: the arithmetic the parallel layers (model/linear.py,
model/embed_head.py) cut their shards by, and the shapes that cannot split.

Sharding follows vLLM's. Attention heads split across ranks: q/k/v and gate/up are column-parallel (each rank
computes its heads' and its share of the intermediate's outputs), o_proj and down_proj row-parallel (each rank
multiplies its share of the inputs; one all-reduce sums them). The embedding and lm_head are vocab-parallel: each
rank holds ceil(vocab / N) rows (the last padded with zeros); an embedding all-reduces the rows of the ranks that
hold each token, and the logits are gathered to rank 0, which samples. A model with fewer KV heads than ranks
replicates each KV head across the N / kv_heads ranks whose query heads use it. Each rank's KV pool holds its own
KV heads' pages under the same block ids, so that rank 0's block tables place every rank's tokens.

Quantized weights are quantized by each rank from its shard, to the numbers one rank holds: int8's scale of an
output column is its whole row's (a row-parallel rank reads the whole tensor), int4's groups of INT4_GROUP inputs
must each lie within one rank's share of a row-parallel layer's inputs.
"""
from __future__ import annotations

import dataclasses

from kvserve.config import ModelConfig
from kvserve.model.layers import INT4_GROUP


def check_tensor_parallel(cfg: ModelConfig, size: int, quantization: str | None = None) -> None:
    """ValueError naming the field where `cfg`'s heads or intermediate size do not split across `size` ranks, or
    where an int4 group of a row-parallel layer's inputs would straddle two ranks."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    if cfg.num_heads % size:
        raise ValueError(f"tensor_parallel_size {size} must divide num_attention_heads ({cfg.num_heads})")
    kvh = cfg.num_kv_heads
    if kvh % size and size % kvh:
        raise ValueError(f"tensor_parallel_size {size} must divide num_key_value_heads ({kvh}), or be a multiple "
                         f"of it (each KV head is then replicated on {size} / {kvh} ranks)")
    if cfg.intermediate_size % size:
        raise ValueError(f"tensor_parallel_size {size} must divide intermediate_size ({cfg.intermediate_size})")
    if quantization != "int4" or size == 1:
        return
    for layer, inputs in (("o_proj", cfg.q_size), ("down_proj", cfg.intermediate_size)):
        if (inputs // size) % INT4_GROUP:
            raise ValueError(f"quantization 'int4' with tensor_parallel_size {size}: each rank's share of {layer}'s "
                             f"{inputs} inputs ({inputs // size}) must be a multiple of int4's groups of {INT4_GROUP}, "
                             f"else a group would straddle two ranks; use quantization 'int8', or a "
                             f"tensor_parallel_size that splits them so")


def kv_heads_per_rank(num_kv_heads: int, size: int) -> int:
    """KV heads each of `size` ranks holds: its share, or one (replicated) where there are fewer than ranks."""
    return max(1, num_kv_heads // size)


def local_kv_heads(num_kv_heads: int, rank: int, size: int) -> tuple[int, int]:
    """(first, count) of the KV heads rank `rank` of `size` holds: its share, or the one head its query heads use
    where there are fewer KV heads than ranks (replicated)."""
    count = kv_heads_per_rank(num_kv_heads, size)
    return (rank * count if num_kv_heads >= size else rank // (size // num_kv_heads)), count


def rows_per_rank(rows: int, size: int) -> int:
    """The rows of a column-parallel weight (the vocabulary's) each of `size` ranks holds: ceil(rows / size), the
    last rank's padded."""
    return -(-rows // size)


def shard_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The shape of one rank's shard (the same on every rank): its heads, its share of the intermediate size
    and of the vocabulary."""
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // size,
                               num_kv_heads=kv_heads_per_rank(cfg.num_kv_heads, size),
                               intermediate_size=cfg.intermediate_size // size,
                               vocab_size=rows_per_rank(cfg.vocab_size, size))
