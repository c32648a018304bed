"""A tensor-parallel group: its ranks' process group and the collectives the parallel layers run over it.

The collectives run over a torch.distributed process group of the engine's own (gloo on the CPU, NCCL on CUDA),
made from a TCPStore rendezvous: no process-wide default group, so that several engines can live in one process.
"""
from __future__ import annotations

import datetime
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kvserve.config import ModelConfig
from kvserve.parallel.sharding import kv_heads_per_rank

# how long joining the group, or a collective, waits for the other ranks (a dead rank fails it at once: its
# connections close); rank 0 waits longer in a step's collectives, past the step's bound (parallel/watchdog.py)
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)


@dataclass
class TensorParallel:
    """One rank of a tensor-parallel group: its place and its process group."""

    rank: int
    size: int
    group: dist.ProcessGroup
    num_all_reduces: int = 0          # all-reduces this rank has run (two per layer and one per embedding)
    comm_seconds: float = 0.0         # time in collectives (waiting for slower ranks included): `bench tp`
    timeout: datetime.timedelta = COLLECTIVE_TIMEOUT

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
        logits = logits.contiguous()
        parts = self._gather(logits)
        return torch.cat(parts, dim=-1)[:, :vocab_size] if self.rank == 0 else None

    def gather_mass(self, mass: dict[int, torch.Tensor], reduces: dict[int, str],
                    cfg: ModelConfig) -> dict[int, torch.Tensor] | None:
        """The ranks' attention mass (row -> [layers * their KV heads, context], what h2o and snapkv score tokens
        by) joined on rank 0 into every KV head's, [layers * KV heads, context] as one rank computes it: a KV head
        replicated on several ranks combines their query heads' shares by the row's reduce ("sum" or "max").
        None on the other ranks."""
        rows = sorted(mass)
        flat = torch.cat([mass[r].flatten() for r in rows]) if rows else torch.empty(0)
        parts = self._gather(flat)
        if self.rank > 0:
            return None
        per_rank = kv_heads_per_rank(cfg.num_kv_heads, self.size)
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

    def _gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's x (of one shape) on rank 0, in rank order; [] on the others."""
        opts = dist.GatherOptions()
        opts.rootRank = 0
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else []
        start = time.perf_counter()
        self.group.gather([parts] if self.rank == 0 else [], [x], opts).wait()
        self.comm_seconds += time.perf_counter() - start
        return parts

    def wait_at_least(self, seconds: float) -> None:
        """Let this rank's collectives wait `seconds` at least for the others (never less than
        COLLECTIVE_TIMEOUT): rank 0's outlast the step's bound, so that a rank that hangs is caught by the bound,
        not by a collective's timeout."""
        timeout = max(COLLECTIVE_TIMEOUT, datetime.timedelta(seconds=seconds))
        if timeout > self.timeout:
            self.group._set_default_timeout(timeout)
            self.timeout = timeout


def place(tp: TensorParallel | None) -> tuple[int, int]:
    """(rank, size) of `tp`; (0, 1) without a group: the only rank."""
    return (0, 1) if tp is None else (tp.rank, tp.size)


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
