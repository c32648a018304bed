"""Ranks that torchrun (or another env:// launcher: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) started.

Nothing is spawned then: the launcher's ranks 1..N-1 run `kvserve` too and become the workers (torchrun_worker),
rank 0 is the engine, and their messages go through torchrun's TCPStore (StoreConnection) instead of pipes. A
dead rank is seen by the collective it fails, and torchrun stops the others.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from kvserve.parallel.channel import StoreConnection, loads, wait_get
from kvserve.parallel.group import COLLECTIVE_TIMEOUT
from kvserve.parallel.worker import worker_main


def torchrun_env() -> tuple[int, str, int] | None:
    """(rank, MASTER_ADDR, MASTER_PORT) where torchrun (or another env:// launcher) started this process with more
    than one rank, else None."""
    env = os.environ
    if int(env.get("WORLD_SIZE", "1")) < 2 or "RANK" not in env or "MASTER_ADDR" not in env:
        return None
    return int(env["RANK"]), env["MASTER_ADDR"], int(env["MASTER_PORT"])


def torchrun_store(host: str, port: int, size: int) -> dist.Store:
    """Our keys in torchrun's store: its agent serves it (TORCHELASTIC_USE_AGENT_STORE), else rank 0 does."""
    env = os.environ
    if int(env["WORLD_SIZE"]) != size:
        raise ValueError(f"tensor_parallel_size {size} must equal torchrun's WORLD_SIZE ({env['WORLD_SIZE']}): "
                         f"every launched rank holds a shard")
    host_it = int(env["RANK"]) == 0 and env.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    store = dist.TCPStore(host, port, size, is_master=host_it, timeout=COLLECTIVE_TIMEOUT, wait_for_workers=False)
    return dist.PrefixStore("kvserve", store)


def torchrun_worker() -> None:
    """Rank 1..N-1 under torchrun: wait for rank 0's engine to say what to load, then serve it as a spawned worker
    would."""
    rank, host, port = torchrun_env()
    size = int(os.environ["WORLD_SIZE"])
    store = torchrun_store(host, port, size)
    conn = StoreConnection(store, rank, rank)
    args = loads(wait_get(store, "args"), torch.device("cpu"))
    worker_main(rank, size, store, args, conn)


class TorchrunRank:
    """A rank torchrun started: not this process's child, so alive as far as it can tell (its death fails the
    next collective instead), and not one it can stop (torchrun stops its ranks)."""

    exitcode = None

    def __init__(self, rank: int):
        self.pid = None
        self.rank = rank

    def is_alive(self) -> bool:
        return True

    def join(self, timeout: float | None = None) -> None:
        pass

    terminate = kill = join
