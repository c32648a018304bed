"""RedisTier: the second KV tier on a Redis server that several engines (processes, machines) share.

Each block is one Redis value under `kvserve:<compat digest>:<block hash>`, in the stored form of
kv/tiers/blockformat.py: header, bytes and checksum in one value, so that a reader finds the whole block or
nothing (one SET is atomic; an LRU eviction takes the whole value). The compat digest names everything that
makes two engines' blocks interchangeable (model, dtype, page codec, block size, layer groups, rank layout);
the header names the block's key (its salt as a digest), checked on every read with the checksum: a block
that fails is deleted, counted and computed again.

The tier is written through: the connector hands it each full block once a step computes it, and a
background writer sends them in pipelines from a bounded queue (full: the block is skipped, never waited
for). Reads of a prefix's blocks go in one pipeline on the connector's reader thread. Redis down, slow or
full costs hit rate, never a request: a failed command is counted, the tier answers "not here" for
`retry_seconds`, then tries again (redis-py reconnects).

What the tier knows it holds (blocks it wrote or read) is its index, the source of its KV events; a block
Redis evicted leaves the index when a read finds it gone.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict

import redis
import torch

from kvserve.kv.blocks import BlockKey
from kvserve.kv.events import EventSink
from kvserve.kv.tiers.base import TierCompat
from kvserve.kv.tiers.blockformat import BlockFormat, CorruptBlock
from kvserve.kv.tiers.queued import QueuedTier

log = logging.getLogger(__name__)

WRITE_QUEUE_BYTES = 256 * 2**20
RETRY_SECONDS = 1.0               # after a failure, how long the tier counts as unreachable
SOCKET_TIMEOUT = 2.0              # seconds a command may take before it counts as a failure
SEEN_BLOCKS = 65536               # blocks another engine wrote, remembered once found (no question asked again)
_FAILURES = (redis.ConnectionError, redis.TimeoutError, redis.ResponseError)


class RedisTier(QueuedTier):
    """Blocks in the Redis server at `url`, shared by every engine with the same compat key. `capacity`
    bounds what this engine counts as its own (its index); Redis's maxmemory and eviction policy bound
    what the server keeps."""

    medium = "REDIS"
    persistent = True
    write_through = True
    write_batch = 16              # blocks one pipeline of the writer sends at most

    def __init__(self, url: str, capacity: int, compat: TierCompat, block_bytes: int,
                 queue_bytes: int | None = None, events: EventSink | None = None,
                 retry_seconds: float = RETRY_SECONDS, socket_timeout: float = SOCKET_TIMEOUT):
        super().__init__(capacity, block_bytes, queue_bytes or WRITE_QUEUE_BYTES, events, "kvserve-kv-offload-redis")
        self.url, self.compat = url, compat
        self.format = BlockFormat(compat.digest, block_bytes)
        if self.format.size(BlockKey(b"", None, (0,) * compat.block_size, None)) > capacity:
            raise ValueError(f"kv_offload_size of {capacity} bytes holds no KV block ({block_bytes} bytes and its "
                             f"header)")
        self.retry_seconds = retry_seconds
        self.prefix = f"kvserve:{compat.digest}:".encode()
        self.client = redis.Redis.from_url(url, socket_timeout=socket_timeout, socket_connect_timeout=socket_timeout)
        self._seen: OrderedDict[bytes, None] = OrderedDict()   # found in Redis, not (yet) read by this engine
        self._down_until = 0.0
        try:
            self.client.ping()
            log.info("kv_offload: Redis at %s, blocks under %s*", url, self.prefix.decode())
        except _FAILURES as e:
            self._failed("connect", e)
        self._writer.start()

    def _key(self, block_hash: bytes) -> bytes:
        return self.prefix + block_hash.hex().encode()

    # ---- reachability -------------------------------------------------------------------------

    def _up(self) -> bool:
        return time.monotonic() >= self._down_until

    _accepts = _up           # blocks are queued while Redis counts as reachable

    def _failed(self, what: str, error: Exception) -> None:
        """Count a failed command; the tier is out for retry_seconds (the first failure of a run is logged)."""
        self.counters.errors += 1
        if self._up():
            log.warning("kv_offload: Redis at %s failed to %s (%s: %s); serving without it for %.1f s",
                        self.url, what, type(error).__name__, error, self.retry_seconds)
        self._down_until = time.monotonic() + self.retry_seconds

    # ---- what the tier holds ------------------------------------------------------------------

    def contains(self, block_hash: bytes) -> bool:
        """Also true for a block another engine wrote (asked of Redis, unless it is out)."""
        if self.has(block_hash) or block_hash in self._seen:
            return True
        if not self._up():
            return False
        try:
            found = bool(self.client.exists(self._key(block_hash)))
        except _FAILURES as e:
            self._failed("look a block up", e)
            return False
        if found:
            with self._lock:
                self._seen[block_hash] = None
                if len(self._seen) > SEEN_BLOCKS:
                    self._seen.popitem(last=False)
        return found

    def _add(self, key: BlockKey, size: int) -> None:
        """Index a block known to be in Redis (called holding the lock); the oldest leave the index past capacity."""
        self._seen.pop(key.hash, None)
        if key.hash in self._index:
            self._index.move_to_end(key.hash)
            return
        self._index[key.hash] = size
        self._used += size
        self._stored(key)
        while self._used > self.capacity:
            old, old_size = self._index.popitem(last=False)
            self._used -= old_size
            self.counters.evictions += 1
            self._removed(old)

    def _forget(self, block_hash: bytes) -> None:
        with self._lock:
            self._seen.pop(block_hash, None)
        super()._forget(block_hash)

    # ---- reads --------------------------------------------------------------------------------

    def get(self, key: BlockKey) -> torch.Tensor | None:
        got = self.get_prefix([key])
        return got[0] if got else None

    def get_prefix(self, keys: list[BlockKey]) -> list[torch.Tensor]:
        """The leading blocks of `keys` that Redis holds and that pass their checks, read in one pipeline
        (blocks still queued for the writer are served from the queue)."""
        with self._lock:
            pending = [self._pending.get(k.hash) for k in keys]
        if not keys or (pending[0] is None and not self._up()):
            return []
        values: list = [None] * len(keys)
        wanted = [i for i, p in enumerate(pending) if p is None]
        if wanted and self._up():
            try:
                pipe = self.client.pipeline(transaction=False)
                for i in wanted:
                    pipe.get(self._key(keys[i].hash))
                for i, value in zip(wanted, pipe.execute()):
                    values[i] = value
            except _FAILURES as e:
                self._failed("read blocks", e)
        out = []
        for key, queued, value in zip(keys, pending, values):
            data = self._served(key, queued, value)
            if data is None:
                break
            out.append(data)
        return out

    def _served(self, key: BlockKey, queued: tuple[BlockKey, torch.Tensor] | None, value: bytes | None):
        """The block's bytes from the writer's queue or a value read, checked; None where it cannot be served."""
        if queued is not None:
            return queued[1] if queued[0] == key else None
        if value is None:
            self._forget(key.hash)        # evicted by Redis, or never there
            return None
        try:
            data = self.format.decode(bytearray(value), key)
        except CorruptBlock as e:
            log.warning("kv_offload: deleting a corrupt block in Redis (%s)", e)
            self.counters.errors += 1
            self._forget(key.hash)
            try:
                self.client.delete(self._key(key.hash))
            except _FAILURES as e2:
                self._failed("delete a corrupt block", e2)
            return None
        if data is None:
            return None                   # another prefix's block under a colliding hash
        with self._lock:
            self._add(key, len(value))
        self.counters.bytes_read += len(value)
        return data

    # ---- writes -------------------------------------------------------------------------------

    def _store(self, blocks: list[tuple[BlockKey, torch.Tensor]]) -> None:
        """SET each block in one pipeline; each that Redis took joins the index."""
        results: list = [None] * len(blocks)
        if self._up():
            try:
                pipe = self.client.pipeline(transaction=False)
                for key, data in blocks:
                    pipe.set(self._key(key.hash), b"".join(self.format.encode(key, data)))
                results = pipe.execute(raise_on_error=False)
            except _FAILURES as e:
                self._failed("write blocks", e)
        with self._lock:
            for (key, _), result in zip(blocks, results):
                del self._pending[key.hash]
                if result is True:
                    size = self.format.size(key)
                    self._add(key, size)
                    self.counters.blocks_stored += 1
                    self.counters.bytes_written += size
                elif isinstance(result, Exception):    # a full Redis without eviction: OOM
                    self._failed("write a block", result)
                else:
                    self.counters.skipped += 1

    def file_bytes(self, key: BlockKey) -> int:
        return self.format.size(key)

    def probe(self, data: torch.Tensor) -> tuple[float, float]:
        """SET each row of `data` under a key of its own and GET it back (in a pipeline each, as blocks are
        written and read); the keys are deleted. Infinite times where Redis cannot be reached: never worth a
        swap."""
        keys = [self.prefix + f"probe-{i}".encode() for i in range(len(data))]
        try:
            start = time.perf_counter()
            pipe = self.client.pipeline(transaction=False)
            for key, row in zip(keys, data):
                pipe.set(key, row.numpy().tobytes(), ex=60)
            pipe.execute()
            stored = time.perf_counter()
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.get(key)
            pipe.execute()
            read = time.perf_counter()
            self.client.delete(*keys)
            return stored - start, read - stored
        except _FAILURES as e:
            self._failed("time a transfer", e)
            return float("inf"), float("inf")

    def close(self) -> None:
        super().close()
        self.client.close()
