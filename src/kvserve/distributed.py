"""Tensor parallelism: how one rank's shard of a model is cut out of the whole, and its collectives.

Sharding follows vLLM's. Attention heads split across ranks: q/k/v and gate/up are column-parallel (each
rank computes its heads' and its share of the intermediate's outputs), o_proj and down_proj row-parallel
(each rank multiplies its share of the inputs; one all-reduce sums them). The embedding and lm_head are
vocab-parallel: each rank holds ceil(vocab / N) rows (the last padded with zeros); an embedding all-reduces
the rows of the ranks that hold each token, and the logits are gathered to rank 0, which samples. A model
with fewer KV heads than ranks replicates each KV head across the N / kv_heads ranks whose query heads use it.

Each rank's KV pool holds its own KV heads' pages under the same block ids, so that rank 0's block tables
place every rank's tokens. The collectives run over a torch.distributed process group of their own (gloo on
the CPU, NCCL on CUDA), made from a TCPStore rendezvous: no process-wide default group, so that several
engines can live in one process.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kvserve.config import ModelConfig

# how long a collective waits for the other ranks (a dead rank fails it at once: its connections close)
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)


def check_tensor_parallel(cfg: ModelConfig, size: int) -> None:
    """ValueError naming the field where `cfg`'s heads or intermediate size do not split across `size` ranks."""
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


def kv_heads_per_rank(cfg: ModelConfig, size: int) -> int:
    """KV heads each of `size` ranks holds: its share, or one (replicated) where there are fewer than ranks."""
    return max(1, cfg.num_kv_heads // size)


def shard_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The shape of one rank's shard (the same on every rank): its heads, its share of the intermediate size
    and of the vocabulary (ceil(vocab / size) rows, the last rank's padded)."""
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // size, num_kv_heads=kv_heads_per_rank(cfg, size),
                               intermediate_size=cfg.intermediate_size // size,
                               vocab_size=-(-cfg.vocab_size // size))


@dataclass
class TensorParallel:
    """One rank of a tensor-parallel group: its place, its process group, and the shard of a model it holds."""

    rank: int
    size: int
    group: dist.ProcessGroup
    num_all_reduces: int = 0          # all-reduces this rank has run (two per layer and one per embedding)
    comm_seconds: float = 0.0         # time in collectives (waiting for slower ranks included): `bench tp`

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place."""
        start = time.perf_counter()
        self.group.allreduce([x]).wait()
        self.comm_seconds += time.perf_counter() - start
        self.num_all_reduces += 1
        return x

    def gather_logits(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """The ranks' vocabulary shards [n, ceil(vocab / N)] of the logits joined into [n, vocab] on rank 0; None
        on the others."""
        opts = dist.GatherOptions()
        opts.rootRank = 0
        logits = logits.contiguous()
        parts = [torch.empty_like(logits) for _ in range(self.size)] if self.rank == 0 else []
        start = time.perf_counter()
        self.group.gather([parts] if self.rank == 0 else [], [logits], opts).wait()
        self.comm_seconds += time.perf_counter() - start
        return torch.cat(parts, dim=-1)[:, :vocab_size] if self.rank == 0 else None

    def gather_mass(self, mass: dict[int, torch.Tensor], reduces: dict[int, str],
                    cfg: ModelConfig) -> dict[int, torch.Tensor] | None:
        """The ranks' attention mass (row -> [layers * their KV heads, context], what h2o and snapkv score tokens
        by) joined on rank 0 into every KV head's, [layers * KV heads, context] as one rank computes it: a KV head
        replicated on several ranks combines their query heads' shares by the row's reduce ("sum" or "max").
        None on the other ranks."""
        rows = sorted(mass)
        flat = torch.cat([mass[r].flatten() for r in rows]) if rows else torch.empty(0)
        opts = dist.GatherOptions()
        opts.rootRank = 0
        parts = [torch.empty_like(flat) for _ in range(self.size)] if self.rank == 0 else []
        start = time.perf_counter()
        self.group.gather([parts] if self.rank == 0 else [], [flat], opts).wait()
        self.comm_seconds += time.perf_counter() - start
        if self.rank > 0:
            return None
        per_rank = kv_heads_per_rank(cfg, self.size)
        replicas = max(1, self.size // cfg.num_kv_heads)         # ranks holding each KV head
        joined, offset = {}, 0
        for r in rows:
            shape, n = mass[r].shape, mass[r].numel()
            layers = shape[0] // per_rank                          # those that gather mass (AttentionBatch.mass_layers)
            ranks = torch.stack([p[offset:offset + n].view(layers, per_rank, shape[1]) for p in parts])
            offset += n
            ranks = ranks.view(-1, replicas, layers, per_rank, shape[1])    # [KV head groups, replicas, ...]
            combined = ranks.amax(1) if reduces[r] == "max" else ranks.sum(1)
            joined[r] = combined.permute(1, 0, 2, 3).reshape(-1, shape[1])    # layer-major, as one rank's
        return joined

    # ---- the shard ----------------------------------------------------------------------------

    def local_kv_heads(self, cfg: ModelConfig) -> tuple[int, int]:
        """(first, count) of the global KV heads this rank holds: its share, or the one head its query heads
        use where there are fewer KV heads than ranks (replicated)."""
        kvh, count = cfg.num_kv_heads, kv_heads_per_rank(cfg, self.size)
        return (self.rank * count if kvh >= self.size else self.rank // (self.size // kvh)), count

    def shard(self, name: str, shard: int | None, tensor: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
        """This rank's part of checkpoint tensor `tensor` for parameter `name` (shard: its index within a merged
        parameter, q/k/v or gate/up; None for a whole tensor, a checkpoint's fused qkv_proj or gate_up_proj
        included)."""
        module, kind = name.split(".")[-2:]
        if module == "qkv_proj":
            sizes = [cfg.q_size, cfg.kv_size, cfg.kv_size]
            parts = range(3) if shard is None else [shard]
            pieces = tensor.split(sizes) if shard is None else [tensor]
            return torch.cat([self._qkv_rows(p, piece, cfg) for p, piece in zip(parts, pieces)])
        if module == "gate_up_proj":
            pieces = tensor.chunk(2) if shard is None else [tensor]
            return torch.cat([self._split(piece, 0) for piece in pieces])
        if module in ("o_proj", "down_proj"):
            if kind == "bias":       # added once, after the all-reduce sums the ranks' products: by rank 0
                return tensor if self.rank == 0 else torch.zeros_like(tensor)
            return self._split(tensor, 1)
        if module in ("embed_tokens", "lm_head"):
            rows = shard_config(cfg, self.size).vocab_size
            part = tensor[self.rank * rows:(self.rank + 1) * rows]
            return torch.cat((part, part.new_zeros(rows - len(part), *part.shape[1:])))
        return tensor

    def _qkv_rows(self, part: int, tensor: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
        """This rank's heads of q (part 0), k (1) or v (2)."""
        if part == 0:
            return self._split(tensor, 0)
        first, count = self.local_kv_heads(cfg)
        return tensor[first * cfg.head_dim:(first + count) * cfg.head_dim]

    def _split(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        return tensor.chunk(self.size, dim)[self.rank]


def init_group(rank: int, size: int, host: str, port: int, device: torch.device,
               store: dist.Store | None = None) -> TensorParallel:
    """Join the group of `size` ranks whose store rank 0 serves at host:port (rank 0 passes its own `store`):
    NCCL on CUDA, gloo on the CPU. Returns once every rank has joined (or raises after COLLECTIVE_TIMEOUT)."""
    if store is None:
        store = dist.TCPStore(host, port, size, is_master=False, timeout=COLLECTIVE_TIMEOUT)
    if device.type == "cuda":
        group = dist.ProcessGroupNCCL(store, rank, size, dist.ProcessGroupNCCL.Options())
    else:
        group = dist.ProcessGroupGloo(store, rank, size, COLLECTIVE_TIMEOUT)
    return TensorParallel(rank, size, group)


def pin_cpu_threads(rank: int, size: int) -> None:
    """Give a CPU rank its own 1/size of this process's cores (their affinity and torch's threads), so that
    the ranks' GEMMs do not fight over the same cores."""
    cores = sorted(os.sched_getaffinity(0))
    per_rank = len(cores) // size
    if per_rank >= 1:
        os.sched_setaffinity(0, cores[rank * per_rank:(rank + 1) * per_rank])
    torch.set_num_threads(max(1, per_rank))
