"""QueuedTier: a tier written by a background thread from a bounded queue, with an index of what it holds.

`put` never waits (unless asked): a block joins the writer's queue, or is skipped when the queue is full. The
index holds each stored block's hash and bytes, least recently used first, and a block is served from the queue
until it is stored. The disk and Redis tiers are QueuedTiers; each stores blocks its own way (`_store`).
"""
from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict

import torch

from kvserve.kv.blocks import BlockKey
from kvserve.kv.events import EventSink
from kvserve.kv.tiers.base import Tier, TierCounters

log = logging.getLogger(__name__)

class QueuedTier(Tier):
    """`queue_bytes` bounds the blocks waiting for the writer; its thread stores up to `write_batch` at a time."""

    write_batch = 1

    def __init__(self, capacity: int, block_bytes: int, queue_bytes: int, events: EventSink | None,
                 thread_name: str):
        self.capacity, self.block_bytes, self.events = capacity, block_bytes, events
        self.counters = TierCounters()
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()     # block hash -> stored bytes, oldest use first
        self._used = 0
        self._pending: dict[bytes, tuple[BlockKey, torch.Tensor]] = {}   # queued, not yet stored
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, queue_bytes // block_bytes))
        self._writer = threading.Thread(target=self._write_loop, name=thread_name, daemon=True)

    def _store(self, blocks: list[tuple[BlockKey, torch.Tensor]]) -> None:
        """Store queued blocks; each leaves `_pending` (holding the lock), and joins the index if it is stored."""
        raise NotImplementedError

    def _accepts(self) -> bool:
        """Whether `put` queues a block now (else it is skipped)."""
        return True

    # ---- what it holds ------------------------------------------------------------------------

    def has(self, block_hash: bytes) -> bool:
        with self._lock:
            return block_hash in self._pending or block_hash in self._index

    def touch(self, block_hash: bytes) -> None:
        with self._lock:
            if block_hash in self._index:
                self._index.move_to_end(block_hash)

    def _forget(self, block_hash: bytes) -> None:
        """Drop a block from the index (gone, or found corrupt)."""
        with self._lock:
            size = self._index.pop(block_hash, None)
            if size is not None:
                self._used -= size
                self._removed(block_hash)

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def num_blocks(self) -> int:
        return len(self._index)

    # ---- writes -------------------------------------------------------------------------------

    def room(self) -> int:
        return self._queue.maxsize - self._queue.qsize()

    def put(self, key: BlockKey, data: torch.Tensor, wait: bool = False) -> bool:
        """Queue a block (host-memory bytes, not to be changed after) for the writer; False when the queue is full
        (unless `wait`) or the tier takes none now, and the block is skipped."""
        with self._lock:
            if key.hash in self._pending or key.hash in self._index:
                return True
            if not self._accepts():
                self.counters.skipped += 1
                return False
            self._pending[key.hash] = (key, data)
        try:
            self._queue.put((key, data), block=wait)
        except queue.Full:
            with self._lock:
                del self._pending[key.hash]
            self.counters.skipped += 1
            return False
        return True

    def _write_loop(self) -> None:
        while True:
            batch = [self._queue.get()]
            while len(batch) < self.write_batch and batch[-1] is not None:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            blocks = [item for item in batch if item is not None]
            try:
                if blocks:
                    self._store(blocks)
            except Exception:  # noqa: BLE001  (the writer goes on: a failed write costs hits, never a flush)
                log.exception("kv_offload: the writer failed to store %d blocks", len(blocks))
                with self._lock:
                    for key, _ in blocks:
                        self._pending.pop(key.hash, None)
                self.counters.errors += len(blocks)
            finally:
                for _ in batch:
                    self._queue.task_done()
            if batch[-1] is None:
                return

    def flush(self) -> None:
        self._queue.join()

    def close(self) -> None:
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join()
