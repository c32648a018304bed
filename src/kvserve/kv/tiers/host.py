"""HostTier: the second KV tier in host memory, for a CUDA pool."""
from __future__ import annotations

import threading
import time
from collections import OrderedDict

import torch

from kvserve.kv.blocks import BlockKey
from kvserve.kv.events import EventSink
from kvserve.kv.tiers.base import Tier, TierCounters, synchronize


class HostTier(Tier):
    """Blocks in one preallocated host-memory slab of `capacity // block_bytes` slots (pinned, for a CUDA
    pool: copies in and out run at full speed), least recently used first out. A lock keeps a slot from
    being reused while the reader thread copies it out."""

    wants_host_memory = False
    medium = "CPU"

    def __init__(self, capacity: int, block_bytes: int, pin_memory: bool = False, events: EventSink | None = None):
        slots = capacity // block_bytes
        if slots < 1:
            raise ValueError(f"kv_offload_size of {capacity} bytes holds no KV block ({block_bytes} bytes)")
        self.capacity, self.block_bytes = capacity, block_bytes
        self.slab = torch.empty(slots, block_bytes, dtype=torch.uint8, pin_memory=pin_memory)
        self._index: OrderedDict[bytes, tuple[int, BlockKey]] = OrderedDict()
        self._free = list(range(slots - 1, -1, -1))
        self.counters = TierCounters()
        self.events = events
        self._lock = threading.Lock()

    def has(self, block_hash: bytes) -> bool:
        return block_hash in self._index

    def touch(self, block_hash: bytes) -> None:
        with self._lock:
            if block_hash in self._index:
                self._index.move_to_end(block_hash)

    def room(self) -> int:
        return len(self.slab)

    def put(self, key: BlockKey, data: torch.Tensor, wait: bool = False) -> bool:
        """Copy a block's bytes into a slot (the least recently used one's when none is free)."""
        with self._lock:
            return self._put(key, data)

    def _put(self, key: BlockKey, data: torch.Tensor) -> bool:
        if key.hash in self._index:
            self._index.move_to_end(key.hash)
            return True
        if not self._free:
            old, (slot, _) = self._index.popitem(last=False)
            self._free.append(slot)
            self.counters.evictions += 1
            self._removed(old)
        slot = self._free.pop()
        self.slab[slot].copy_(data)
        self._index[key.hash] = (slot, key)
        self._stored(key)
        self.counters.blocks_stored += 1
        self.counters.bytes_written += self.block_bytes
        return True

    def get(self, key: BlockKey) -> torch.Tensor | None:
        """A copy of the block's bytes if the tier holds exactly `key` (a later put may reuse its slot)."""
        with self._lock:
            entry = self._index.get(key.hash)
            if entry is None or entry[1] != key:
                return None
            self._index.move_to_end(key.hash)
            self.counters.bytes_read += self.block_bytes
            return self.slab[entry[0]].clone()

    def probe(self, data: torch.Tensor) -> tuple[float, float]:
        """Copy `data` into host memory like the slab's, and back where it came from."""
        host = torch.empty(data.shape, dtype=torch.uint8, pin_memory=self.slab.is_pinned())
        start = time.perf_counter()
        host.copy_(data)
        synchronize(data.device)
        stored = time.perf_counter()
        data.copy_(host)
        synchronize(data.device)
        return stored - start, time.perf_counter() - stored

    @property
    def used_bytes(self) -> int:
        return len(self._index) * self.block_bytes

    @property
    def num_blocks(self) -> int:
        return len(self._index)
