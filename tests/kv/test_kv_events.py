"""KV cache events (kv_events_endpoint): every message decodes with a schema written from vLLM's documented
format, a subscriber's stored-minus-removed is what the pool and the tier hold after each request, missed
messages come back from the replay socket, and an event past the queue is dropped and counted."""
from __future__ import annotations

import threading
import time

import msgspec
import pytest
import torch
import zmq
from prometheus_client import CollectorRegistry, generate_latest

from kvserve import LLM, SamplingParams
from kvserve.bench.serve import free_port
from kvserve.config import EngineConfig
from kvserve.kv.blocks import block_key
from kvserve.kv import events as events_module
from kvserve.kv.events import KVEventPublisher, KVEventsConfig
from kvserve.server.metrics import EngineCollector

BS = 4
GREEDY = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)


# ---- the subscriber's schema, from vLLM's documented format (its kv_events subscriber example) ----------------

class Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list


class Event(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(Event):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list | None = None
    group_idx: int | None = None


class BlockRemoved(Event):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(Event):
    pass


class EventBatch(Batch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


DECODER = msgspec.msgpack.Decoder(EventBatch)


def u64(block_hash: bytes) -> int:
    """vLLM's int block hash: the chained hash's bytes read big-endian, to 64 bits (a layer group's suffix
    aside, which the event carries as group_idx)."""
    return int.from_bytes(block_hash[:16], "big") & (2**64 - 1)


class Subscriber:
    """A SUB socket and a DEALER socket for replay, applying what it receives: which (group, hash) blocks each
    medium holds, from the events alone."""

    def __init__(self, endpoint: str, replay: str | None = None, topic: str = ""):
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.sub.connect(endpoint)
        self.replay = None
        if replay is not None:
            self.replay = self.ctx.socket(zmq.DEALER)      # several replies to one request: not REQ's one
            self.replay.connect(replay)
        self.held: dict[str, set[tuple[int, int]]] = {}
        self.next_seq, self.received = 0, False
        self.stored_events: list[BlockStored] = []
        self.replayed = 0

    def drain(self) -> None:
        """Apply every message waiting (a gap in the sequence numbers asks the replay socket first)."""
        while self.sub.poll(200):
            topic, seq_bytes, payload = self.sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if self.replay is None and not self.received:
                self.next_seq = seq           # no replay: it starts from what it first receives
            self.received = True
            if seq > self.next_seq:
                self.ask_replay(seq)
            if seq == self.next_seq:
                self.apply(DECODER.decode(payload))
                self.next_seq += 1

    def ask_replay(self, until: int) -> None:
        assert self.replay is not None, f"messages {self.next_seq}..{until - 1} were missed and nothing replays them"
        self.replay.send_multipart((b"", self.next_seq.to_bytes(8, "big")))
        while True:
            empty, seq_bytes, payload = self.replay.recv_multipart()
            assert empty == b""
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if seq == -1:
                assert payload == b""
                break
            if seq == self.next_seq and seq < until:
                self.apply(DECODER.decode(payload))
                self.next_seq += 1
                self.replayed += 1

    def apply(self, batch: EventBatch) -> None:
        assert batch.ts > 0
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                self.held.clear()
            elif isinstance(event, BlockStored):
                assert len(event.token_ids) == event.block_size * len(event.block_hashes)
                self.stored_events.append(event)
                blocks = self.held.setdefault(event.medium, set())
                for h in event.block_hashes:
                    assert (event.group_idx, h) not in blocks, "a block stored twice in one medium"
                    blocks.add((event.group_idx, h))
            else:
                blocks = self.held.setdefault(event.medium, set())
                for h in event.block_hashes:
                    blocks.remove((event.group_idx, h))

    def close(self) -> None:
        for socket in (self.sub, self.replay):
            if socket is not None:
                socket.close(linger=0)
        self.ctx.term()


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def ckpt(checkpoint):
    return checkpoint("llama", max_position_embeddings=256)


def endpoints() -> tuple[str, str]:
    return f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"


def pool_blocks(llm: LLM) -> set[tuple[int, int]]:
    return {(key.group, u64(key.hash)) for key in llm.engine.kv.pool.keys if key is not None}


def tier_blocks(llm: LLM) -> set[tuple[int, int]]:
    from kvserve.kv.blocks import BlockKey

    return {(BlockKey.group_of(h), u64(h)) for h in llm.engine.connector.tier._index}


def connected(sub: Subscriber, llm: LLM) -> None:
    """Wait until the SUB socket receives (ZeroMQ's slow joiner): the messages before it come from replay."""
    deadline = time.monotonic() + 30
    while not sub.sub.poll(0):
        assert time.monotonic() < deadline, "the subscriber never received a message"
        llm.engine.kv_events.record(events_module.BlockRemoved([], "probe"))     # changes nothing held
        llm.engine.kv_events.flush()
        time.sleep(0.05)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_stored_minus_removed_is_what_the_pool_and_the_tier_hold(ckpt, checkpoint, tmp_path, arch):
    """After each request (a pool of 10 blocks: prefixes evicted to the disk tier and loaded back), the
    subscriber's blocks per medium are the pool's and the tier's; a hybrid cache's groups apart (gemma3: a
    sliding window of 8 tokens)."""
    model = ckpt if arch == "llama" else checkpoint("gemma3", sliding_window=8, head_dim=16,
                                                    num_hidden_layers=2, sliding_window_pattern=2,
                                                    max_position_embeddings=256)
    pub, replay = endpoints()
    llm = LLM(str(model), dtype="float32", block_size=BS, num_kv_blocks=10 if arch == "llama" else 16,
              kv_offload=f"disk:{tmp_path / 'tier'}", kv_offload_size="1MiB", preemption_mode="recompute",
              kv_events_endpoint=pub, kv_events_replay_endpoint=replay, kv_events_topic="kv")
    sub = Subscriber(pub, replay, "kv")
    try:
        connected(sub, llm)
        prompts = [ids(13, 1), ids(13, 2), ids(13, 1) + ids(4, 3), ids(9, 4), ids(13, 2)]
        for prompt in prompts:
            llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)
            llm.engine.connector.tier.flush()
            llm.engine.kv_events.flush()
            sub.drain()
            assert sub.held.get("CPU", set()) == pool_blocks(llm)
            assert sub.held.get("DISK", set()) == tier_blocks(llm)
        assert tier_blocks(llm) and llm.stats()["kv_offload_loads"] > 0
        groups = {g for g, _ in pool_blocks(llm) | tier_blocks(llm)}
        assert groups == ({0} if arch == "llama" else {0, 1})
        chained = [e for e in sub.stored_events if e.medium == "CPU" and len(e.block_hashes) > 1]
        assert chained and all(e.block_size == BS for e in sub.stored_events)
        assert llm.stats()["kv_events_dropped"] == 0
    finally:
        sub.close()
        llm.engine.close()


def test_a_block_hash_chains_its_prefix_and_salt(ckpt):
    """The hashes are the prefix cache's: the same tokens after another prefix or under a salt are other
    blocks, and each stored block names its parent."""
    pub, _ = endpoints()
    llm = LLM(str(ckpt), block_size=BS, num_kv_blocks=32, kv_events_endpoint=pub)
    sub = Subscriber(pub)
    try:
        connected(sub, llm)
        tokens = ids(8, 5)
        llm.generate([{"prompt_token_ids": tokens + [7]}, {"prompt_token_ids": tokens + [7], "cache_salt": "a"}],
                     GREEDY, use_tqdm=False)
        llm.engine.kv_events.flush()
        sub.drain()
        stored = [e for e in sub.stored_events if e.token_ids[:BS] == tokens[:BS]]
        assert [e.parent_block_hash for e in stored] == [None, None]
        for event, salt in zip(stored, (None, "a")):
            first = block_key(None, tuple(tokens[:BS]), salt)
            second = block_key(first.hash, tuple(tokens[BS:2 * BS]), salt)
            assert event.block_hashes == [u64(first.hash), u64(second.hash)]
            assert event.token_ids == tokens and event.group_idx == 0 and event.medium == "CPU"
    finally:
        sub.close()
        llm.engine.close()


def test_replay_returns_what_a_subscriber_missed(ckpt):
    """A subscriber that joins late gets the earlier batches from the replay socket, in order, then the end."""
    pub, replay = endpoints()
    llm = LLM(str(ckpt), block_size=BS, num_kv_blocks=32, kv_events_endpoint=pub, kv_events_replay_endpoint=replay)
    try:
        llm.generate([{"prompt_token_ids": ids(17, 6)}], GREEDY, use_tqdm=False)     # before anyone listens
        llm.engine.kv_events.flush()
        sub = Subscriber(pub, replay)
        try:
            connected(sub, llm)
            llm.generate([{"prompt_token_ids": ids(17, 7)}], GREEDY, use_tqdm=False)
            llm.engine.kv_events.flush()
            sub.drain()
            assert sub.replayed > 0 and sub.held["CPU"] == pool_blocks(llm)
        finally:
            sub.close()
    finally:
        llm.engine.close()


def test_events_past_the_queue_are_dropped_and_counted(ckpt, monkeypatch):
    """A publisher thread held up: the queue takes max_queue_size events, the rest are dropped (recording never
    waits), and /metrics counts them."""
    pub, _ = endpoints()
    gate = threading.Event()
    send = KVEventPublisher._send

    def held(self, payload, n):
        gate.wait()
        send(self, payload, n)

    monkeypatch.setattr(KVEventPublisher, "_send", held)
    publisher = KVEventPublisher(KVEventsConfig(pub, max_queue_size=2))
    try:
        for _ in range(10):
            publisher.record(events_module.AllBlocksCleared())
        gate.set()
        publisher.flush()
        stats = publisher.stats()
        # the publisher's own first event (AllBlocksCleared) and ten more
        assert stats["kv_events_dropped"] >= 8 and stats["kv_events_dropped"] + stats["kv_events_published"] == 11
    finally:
        gate.set()
        publisher.close()
    llm = LLM(str(ckpt), block_size=BS, num_kv_blocks=8, kv_events_endpoint=endpoints()[0])
    llm.generate([{"prompt_token_ids": ids(9, 8)}], GREEDY, use_tqdm=False)
    llm.engine.kv_events.flush()
    registry = CollectorRegistry()
    registry.register(EngineCollector(llm.stats, "tiny"))
    text = generate_latest(registry).decode()
    assert 'kvserve:kv_events_dropped_total{model_name="tiny"} 0.0' in text
    assert f'kvserve:kv_events_published_total{{model_name="tiny"}} {float(llm.stats()["kv_events_published"])}' \
        in text and llm.stats()["kv_events_published"] > 0
    llm.engine.close()


@pytest.mark.parametrize("kwargs, field", [({"kv_events_endpoint": "localhost:5557"}, "kv_events_endpoint"),
                                           ({"kv_events_replay_endpoint": "tcp://*:5558"}, "kv_events_endpoint"),
                                           ({"kv_events_endpoint": "tcp://*:1", "kv_events_hwm": 0}, "kv_events_hwm"),
                                           ({"kv_events_endpoint": "tcp://*:1", "cache_mode": "none"},
                                            "kv_events_endpoint")])
def test_bad_settings_name_their_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**kwargs)


def test_an_address_in_use_is_refused_at_start_up(ckpt):
    pub, _ = endpoints()
    first = LLM(str(ckpt), block_size=BS, num_kv_blocks=8, kv_events_endpoint=pub)
    with pytest.raises(ValueError, match="kv_events: cannot bind"):
        LLM(str(ckpt), block_size=BS, num_kv_blocks=8, kv_events_endpoint=pub)
    first.engine.close()


def test_engine_flags():
    from kvserve.cli import build_parser, engine_kwargs

    args = build_parser().parse_args(["serve", "--kv-events-endpoint", "tcp://*:5557", "--kv-events-replay-endpoint",
                                      "tcp://*:5558", "--kv-events-topic", "kv", "--kv-events-hwm", "10"])
    kwargs = engine_kwargs(args)
    assert (kwargs["kv_events_endpoint"], kwargs["kv_events_replay_endpoint"], kwargs["kv_events_topic"],
            kwargs["kv_events_hwm"], kwargs["kv_events_buffer_steps"]) == ("tcp://*:5557", "tcp://*:5558", "kv", 10,
                                                                          10_000)
