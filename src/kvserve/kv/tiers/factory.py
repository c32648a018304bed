"""TierConfig: what builds an engine's second tier, on each of its ranks (under tensor parallelism every rank
keeps a tier of its own, of its own KV heads' pages)."""
from __future__ import annotations

from dataclasses import dataclass, replace

from kvserve.kv.tiers.base import OffloadSpec, Tier, TierCompat
from kvserve.kv.tiers.disk import DiskTier
from kvserve.kv.tiers.host import HostTier


@dataclass(frozen=True)
class TierConfig:
    """The tier of `spec` (kv_offload), `capacity` bytes of blocks of `block_bytes` each, for engines that share
    `compat` (its tp_size the engine's ranks): the same on every rank, but for the rank in its key."""

    spec: OffloadSpec
    capacity: int
    compat: TierCompat
    block_bytes: int

    def build(self, rank: int = 0) -> Tier:
        """Rank `rank`'s tier: its directory of `spec`'s root (a disk tier), or its own pinned host memory."""
        if self.spec.kind == "cpu":
            return HostTier(self.capacity, self.block_bytes, pin_memory=True)
        return DiskTier(self.spec.path, self.capacity, replace(self.compat, tp_rank=rank), self.block_bytes)
