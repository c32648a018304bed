"""KV cache events in vLLM's wire format: what each block store (the pool, the second tier) holds, published
over ZeroMQ for routers and indexers (vLLM's KVEventsConfig and ZmqEventPublisher).

A message on the PUB socket is three frames: the topic, a sequence number (8 bytes, big-endian) and a msgpack
`EventBatch`: `[ts, [event, ...], data_parallel_rank?]`, each event an array tagged with its type's name:
`["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name,
extra_keys, group_idx]`, `["BlockRemoved", block_hashes, medium, group_idx]`, `["AllBlocksCleared"]`. A
block hash is the prefix cache's chained hash (kv/blocks.py: over the parent's, the tokens and the cache
salt) as an unsigned 64-bit integer, its last 8 bytes read big-endian (vLLM's int block hashes); the layer
group of a hybrid cache is group_idx. A subscriber that applies stored minus removed, per medium, knows which
prefixes the engine holds where.

The replay socket (ROUTER) answers a request of a start sequence number (8 bytes, big-endian) with every
batch it still holds from there, as (sequence number, payload) messages, then (-1, b"") to end them.

Recording an event never blocks: the engine's thread (and a tier's writer thread) put events on a bounded
queue; past `max_queue_size` an event is dropped and counted. A publisher thread batches what is queued,
encodes it and sends it; a subscriber slower than the socket's high-water mark loses messages in ZeroMQ,
sees the gap in the sequence numbers and asks the replay socket for them.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass

import msgspec
import zmq

from kvserve.kv.blocks import BlockKey

log = logging.getLogger(__name__)

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
# events one batch takes from the queue at most: a batch stays a small message
MAX_BATCH_EVENTS = 1024


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """An event: positional fields after its tag (the class name), defaults at the end left out."""


class BlockStored(KVCacheEvent):
    """Blocks that a medium now holds, each the child of the one before (the first of parent_block_hash);
    token_ids are theirs, block_size each."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list | None = None
    group_idx: int | None = None


class BlockRemoved(KVCacheEvent):
    """Blocks that a medium no longer holds."""

    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    """Every block the engine held is gone (it starts afresh)."""


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


def external_hash(block_hash: bytes) -> int:
    """A block's hash as events carry it: the last 8 bytes of its chained hash, big-endian (a layer group's
    suffix left out: the group is group_idx)."""
    return int.from_bytes(block_hash[:BlockKey.HASH_BYTES][-8:], "big")


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig: where events are published (a PUB socket bound at `endpoint`, e.g.
    tcp://*:5557), where missed ones are asked for again (`replay_endpoint`), under which topic, how many
    batches the replay keeps, the PUB socket's high-water mark, and how many events may wait to be sent."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000

    def __post_init__(self):
        for name, value in (("endpoint", self.endpoint), ("replay_endpoint", self.replay_endpoint)):
            if value is not None and not value.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(f"kv_events_{name} must be a ZeroMQ address such as tcp://*:5557, got {value!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"kv_events_{name} must be >= 1, got {getattr(self, name)}")


class EventSink:
    """What one block store (a medium) records: its blocks stored and removed, as events of the publisher."""

    def __init__(self, publisher: KVEventPublisher, medium: str, block_size: int):
        self.publisher, self.medium, self.block_size = publisher, medium, block_size

    def stored(self, key: BlockKey) -> None:
        """The medium now holds the block of `key`."""
        parent = None if key.parent_hash is None else external_hash(key.parent_hash)
        self.publisher.record(BlockStored([external_hash(key.hash)], parent, list(key.token_ids), self.block_size,
                                          None, self.medium, None, None, key.group))

    def removed(self, block_hash: bytes) -> None:
        """The medium no longer holds the block of `block_hash`."""
        self.publisher.record(BlockRemoved([external_hash(block_hash)], self.medium, BlockKey.group_of(block_hash)))


class KVEventPublisher:
    """A PUB socket (and a ROUTER socket for replay) served by a thread of its own; `record` queues an event
    without waiting. Both sockets are bound: the engine is the end that routers connect to."""

    def __init__(self, config: KVEventsConfig):
        self.config = config
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay = None
        try:
            self._pub.bind(config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ValueError(f"kv_events: cannot bind {config.endpoint} / {config.replay_endpoint}: {e}") from e
        self.published = self.batches = self.dropped = 0
        self._next_seq = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvserve-kv-events", daemon=True)
        self._thread.start()
        self.record(AllBlocksCleared())       # a restarted engine's subscribers forget what it held before
        log.info("KV events: publishing on %s%s", config.endpoint,
                 f", replay on {config.replay_endpoint}" if config.replay_endpoint else "")

    def sink(self, medium: str, block_size: int) -> EventSink:
        """The recorder of one medium's blocks."""
        return EventSink(self, medium, block_size)

    def record(self, event: KVCacheEvent) -> None:
        """Queue an event for the publisher thread; dropped (and counted) when the queue is full."""
        try:
            self._queue.put_nowait(event)
        except queue.Full:
            self.dropped += 1

    def flush(self) -> None:
        """Return once every event recorded so far is sent (or dropped)."""
        self._queue.join()

    def stats(self) -> dict:
        return {"kv_events_published": self.published, "kv_events_batches": self.batches,
                "kv_events_dropped": self.dropped, "kv_events_queued": self._queue.qsize()}

    def close(self) -> None:
        """Send what is queued, stop the thread, close the sockets (their ports are free at once). Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()
        self._close_sockets()

    def _close_sockets(self) -> None:
        for socket in (self._pub, self._replay):
            if socket is not None:
                socket.close(linger=0)
        self._ctx.term()

    # ---- the publisher thread -------------------------------------------------------------

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        while True:
            if self._replay is not None:
                while self._replay.poll(0):
                    self._answer_replay()
            try:
                first = self._queue.get(timeout=0.05)
            except queue.Empty:
                if self._stop.is_set():
                    return
                continue
            events = [first]
            while len(events) < MAX_BATCH_EVENTS:
                try:
                    events.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            try:
                self._send(encoder.encode(EventBatch(time.time(), merge(events))), len(events))
            except zmq.ZMQError as e:
                log.warning("kv_events: a batch of %d events was not sent: %s", len(events), e)
                self.dropped += len(events)
            finally:
                for _ in events:
                    self._queue.task_done()

    def _send(self, payload: bytes, num_events: int) -> None:
        seq = self._next_seq
        self._next_seq += 1
        # kept for replay even if the PUB socket drops it for a slow subscriber
        self._buffer.append((seq, payload))
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
        self.published += num_events
        self.batches += 1

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("kv_events: a replay request of %d frames, not (identity, empty, 8-byte sequence number)",
                        len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_OF_REPLAY, b""))


class NoEvents:
    """No events are published (kv_events_endpoint unset): no sink, nothing counted."""

    def sink(self, medium: str, block_size: int) -> None:
        return None

    def flush(self) -> None:
        """Nothing is queued."""

    def stats(self) -> dict:
        return {}

    def close(self) -> None:
        """Nothing to stop."""


def create_publisher(config: KVEventsConfig | None) -> KVEventPublisher | NoEvents:
    """The publisher of `config`, or NoEvents without one."""
    return NoEvents() if config is None else KVEventPublisher(config)


def merge(events: list[KVCacheEvent]) -> list[KVCacheEvent]:
    """Consecutive events of one kind folded into one where vLLM's would be one: stored blocks that continue
    the last one's chain in the same medium and group, removed blocks of the same medium and group."""
    out: list[KVCacheEvent] = []
    for event in events:
        last = out[-1] if out else None
        if (isinstance(event, BlockStored) and isinstance(last, BlockStored) and event.medium == last.medium
                and event.group_idx == last.group_idx and event.parent_block_hash == last.block_hashes[-1]):
            last.block_hashes.extend(event.block_hashes)
            last.token_ids.extend(event.token_ids)
        elif (isinstance(event, BlockRemoved) and isinstance(last, BlockRemoved) and event.medium == last.medium
              and event.group_idx == last.group_idx):
            last.block_hashes.extend(event.block_hashes)
        else:
            out.append(event)
    return out
