"""TierConfig: what builds an engine's second tier, on each of its ranks (under tensor parallelism every rank
keeps a tier of its own, of its own KV heads' pages)."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kvserve.kv.events import EventSink
from kvserve.kv.tiers.base import OffloadSpec, Tier, TierCompat
from kvserve.kv.tiers.disk import DiskTier
from kvserve.kv.tiers.host import HostTier
from kvserve.kv.tiers.redis import RedisTier

TIERS: dict[str, type[Tier]] = {"cpu": HostTier, "disk": DiskTier, "redis": RedisTier}


@dataclass(frozen=True)
class TierConfig:
    """The tier of `spec` (kv_offload), `capacity` bytes of blocks of `block_bytes` each, for engines that share
    `compat` (its tp_size the engine's ranks): the same on every rank, but for the rank in its key."""

    spec: OffloadSpec
    capacity: int
    compat: TierCompat
    block_bytes: int

    @property
    def medium(self) -> str:
        """Where the tier keeps blocks, as KV events name it (CPU, DISK, REDIS)."""
        return TIERS[self.spec.kind].medium

    def check(self, device: torch.device) -> None:
        """ValueError for a tier that serves no purpose beside a pool on `device`: host memory beside a CPU pool."""
        if self.spec.kind == "cpu" and device.type != "cuda":
            raise ValueError(f"kv_offload 'cpu' keeps blocks in host memory, where this engine's KV pool already is "
                             f"(device {device.type}): use kv_offload='disk:PATH' for a second tier")

    def build(self, rank: int = 0, events: EventSink | None = None) -> Tier:
        """Rank `rank`'s tier, recording what it holds to `events` (rank 0's): its own pinned host memory, its
        directory under `spec`'s root (a disk tier), or its keys in the Redis server."""
        if self.spec.kind == "cpu":
            return HostTier(self.capacity, self.block_bytes, pin_memory=True, events=events)
        compat = replace(self.compat, tp_rank=rank)
        if self.spec.kind == "disk":
            return DiskTier(self.spec.path, self.capacity, compat, self.block_bytes, events=events)
        return RedisTier(self.spec.url, self.capacity, compat, self.block_bytes, events=events)
