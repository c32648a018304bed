"""The tier that `kv_offload` names, built for an engine's blocks."""
from __future__ import annotations

import torch

from kvserve.kv.events import KVEventPublisher, NoEvents
from kvserve.kv.tiers.base import OffloadSpec, Tier, TierCompat
from kvserve.kv.tiers.disk import DiskTier
from kvserve.kv.tiers.host import HostTier
from kvserve.kv.tiers.redis import RedisTier


def create_tier(spec: OffloadSpec, capacity: int, compat: TierCompat, block_bytes: int, device: torch.device,
                events: KVEventPublisher | NoEvents) -> Tier:
    """Host memory ('cpu', for a CUDA pool alone: a CPU pool is in host memory already), files ('disk:PATH')
    or a Redis server ('redis://...'), of `capacity` bytes of blocks of `block_bytes`, recording what it holds
    as KV events of its medium."""
    sink = events.sink({"cpu": HostTier, "disk": DiskTier, "redis": RedisTier}[spec.kind].medium, compat.block_size)
    if spec.kind == "cpu":
        if device.type != "cuda":
            raise ValueError(f"kv_offload 'cpu' keeps blocks in host memory, where this engine's KV pool already "
                             f"is (device {device.type}): use kv_offload='disk:PATH' for a second tier")
        return HostTier(capacity, block_bytes, pin_memory=True, events=sink)
    if spec.kind == "disk":
        return DiskTier(spec.path, capacity, compat, block_bytes, events=sink)
    return RedisTier(spec.url, capacity, compat, block_bytes, events=sink)
