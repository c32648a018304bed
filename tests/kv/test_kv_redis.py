"""The Redis tier (kv_offload=redis://...) against a real redis-server: engines in separate processes share a
prefix through it with the outputs of one engine, and a corrupt block, a killed server and a full one each
cost hit rate, never a request."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig
from kvserve.kv.tiers import RedisTier, TierCompat
from redis_helper import start_redis

BS = 4
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(checkpoint):
    return checkpoint("llama", max_position_embeddings=256)


@pytest.fixture
def redis_url(redis_server):
    redis_server.client().flushall()
    return redis_server.url


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


SYSTEM = ids(32, 0)                       # 8 full blocks every question shares
QUESTIONS = [ids(6, s) for s in range(1, 5)]


def prompts(*token_lists) -> list[dict]:
    return [{"prompt_token_ids": t} for t in token_lists]


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def reference(ckpt, token_lists) -> list[list[int]]:
    llm = LLM(str(ckpt), block_size=BS, num_kv_blocks=64, enable_prefix_caching=False)
    return tokens(llm.generate(prompts(*token_lists), GREEDY, use_tqdm=False))


def shared(ckpt, url: str, **kw) -> LLM:
    kw = {"block_size": BS, "num_kv_blocks": 24, "preemption_mode": "recompute", **kw}
    return LLM(str(ckpt), kv_offload=url, kv_offload_size="1MiB", **kw)


ENGINE_PROCESS = """
import json, sys
from kvserve import LLM, SamplingParams
ckpt, url, token_lists = json.loads(sys.argv[1])
llm = LLM(ckpt, block_size=4, num_kv_blocks=24, preemption_mode="recompute", kv_offload=url, kv_offload_size="1MiB")
outs = llm.generate([{"prompt_token_ids": t} for t in token_lists],
                    SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)
llm.engine.close()
print(json.dumps({"tokens": [o.outputs[0].token_ids for o in outs], "stats": llm.stats()}, default=str))
"""


def run_engine_process(ckpt, url: str, token_lists) -> dict:
    """An engine in a process of its own: its greedy tokens and its stats once it closed."""
    done = subprocess.run([sys.executable, "-c", ENGINE_PROCESS, json.dumps([str(ckpt), url, token_lists])],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_two_engine_processes_share_a_prefix(ckpt, redis_url):
    """The second process loads the system prompt's blocks that the first computed, and both answer as one
    engine without a cache does."""
    first, second = [SYSTEM + QUESTIONS[0]], [SYSTEM + QUESTIONS[1]]
    a = run_engine_process(ckpt, redis_url, first)
    assert a["stats"]["kv_offload_blocks_stored"] >= len(SYSTEM) // BS and a["stats"]["kv_offload_hit_tokens"] == 0
    b = run_engine_process(ckpt, redis_url, second)
    assert b["stats"]["kv_offload_hit_tokens"] == len(SYSTEM)
    assert b["stats"]["kv_offload_loads"] == len(SYSTEM) // BS
    assert b["stats"]["prefix_cache_hits"] == 0          # nothing came from its own pool
    assert a["tokens"] + b["tokens"] == reference(ckpt, first + second)


def test_a_block_is_written_through_before_the_pool_evicts_it(ckpt, redis_url):
    """A full block reaches Redis once a step computed it, while the pool still holds it."""
    llm = shared(ckpt, redis_url, num_kv_blocks=64)
    llm.generate(prompts(SYSTEM + QUESTIONS[0]), GREEDY, use_tqdm=False)
    llm.engine.connector.tier.flush()
    stats = llm.stats()
    assert stats["kv_offload_blocks"] == stats["kv_offload_blocks_stored"] >= len(SYSTEM) // BS
    assert llm.engine.kv.pool.num_cached == stats["kv_offload_blocks"]       # evicted none: all written through
    other = shared(ckpt, redis_url, num_kv_blocks=64)
    assert tokens(other.generate(prompts(SYSTEM + QUESTIONS[1]), GREEDY, use_tqdm=False)) == \
        reference(ckpt, [SYSTEM + QUESTIONS[1]])
    assert other.stats()["kv_offload_hit_tokens"] == len(SYSTEM)


def test_a_corrupt_block_is_dropped_counted_and_recomputed(ckpt, redis_url, redis_server):
    writer = shared(ckpt, redis_url)
    writer.generate(prompts(SYSTEM + QUESTIONS[0]), GREEDY, use_tqdm=False)
    writer.engine.connector.tier.flush()
    client = redis_server.client()
    keys = sorted(client.keys("kvserve:*"))
    victim = keys[len(keys) // 2]
    value = bytearray(client.get(victim))
    value[-10] ^= 0xFF                      # one byte of the pages flipped
    client.set(victim, bytes(value))
    reader = shared(ckpt, redis_url)
    assert tokens(reader.generate(prompts(SYSTEM + QUESTIONS[1]), GREEDY, use_tqdm=False)) == \
        reference(ckpt, [SYSTEM + QUESTIONS[1]])
    reader.engine.connector.tier.flush()
    stats = reader.stats()
    assert stats["kv_offload_errors"] == 1
    assert 0 < stats["kv_offload_loads"] < len(SYSTEM) // BS       # the blocks before the corrupt one
    assert client.get(victim) != bytes(value)        # deleted, then written again whole by the engine that computed it


def test_a_killed_redis_costs_hits_never_a_request_and_is_reconnected(ckpt, tmp_path):
    server = start_redis(tmp_path)
    try:
        llm = shared(ckpt, server.url)
        llm.engine.connector.tier.retry_seconds = 0.2
        everything = [SYSTEM + q for q in QUESTIONS]
        expected = reference(ckpt, everything)
        assert tokens(llm.generate(prompts(everything[0]), GREEDY, use_tqdm=False)) == expected[:1]
        server.kill()
        assert tokens(llm.generate(prompts(*everything[1:3]), GREEDY, use_tqdm=False)) == expected[1:3]
        assert llm.stats()["kv_offload_errors"] > 0
        server.start()                 # an empty server on the same port
        stored = llm.stats()["kv_offload_blocks_stored"]
        deadline = time.monotonic() + 60
        while llm.stats()["kv_offload_blocks_stored"] == stored:
            assert time.monotonic() < deadline, "the tier never wrote to the restarted server"
            time.sleep(0.25)
            llm.generate(prompts(ids(8, int(time.monotonic() * 1e3) % 10_000 + 100)), GREEDY, use_tqdm=False)
            llm.engine.connector.tier.flush()
        assert tokens(llm.generate(prompts(everything[3]), GREEDY, use_tqdm=False)) == expected[3:]
        assert server.client().keys("kvserve:*")
    finally:
        server.stop()


@pytest.mark.parametrize("policy", ["allkeys-lru", "noeviction"])
def test_a_full_redis_costs_hits_never_a_request(ckpt, tmp_path, policy):
    """maxmemory some 70 blocks past what the empty server uses, and 240 blocks written: with LRU, Redis evicts
    the oldest blocks (a later engine computes them again); without eviction, writes fail and are counted (which
    blocks stay then depends on when the tier backs off from the failures)."""
    server = start_redis(tmp_path)
    try:
        client = server.client()
        used = client.info("memory")["used_memory"]
        client.config_set("maxmemory", used + 192 * 2**10)
        client.config_set("maxmemory-policy", policy)
        many = [ids(41, 100 + i) for i in range(24)]          # 10 blocks of 2 KiB (and a header) each
        llm = shared(ckpt, server.url)
        assert tokens(llm.generate(prompts(*many), GREEDY, use_tqdm=False)) == reference(ckpt, many)
        llm.engine.close()
        if policy == "allkeys-lru":
            assert client.info("stats")["evicted_keys"] > 0
        else:
            assert llm.stats()["kv_offload_errors"] > 0
        later = shared(ckpt, server.url)
        assert tokens(later.generate(prompts(*many[:2]), GREEDY, use_tqdm=False)) == reference(ckpt, many[:2])
        if policy == "allkeys-lru":
            assert later.stats()["kv_offload_hit_tokens"] < 2 * 40      # the first prompts' blocks went
    finally:
        server.stop()


def test_engines_of_another_layout_or_salt_never_share_blocks(ckpt, redis_url):
    writer = shared(ckpt, redis_url)
    writer.generate(prompts(SYSTEM + QUESTIONS[0]), GREEDY, use_tqdm=False)
    writer.engine.connector.tier.flush()
    int8 = shared(ckpt, redis_url, kv_cache_dtype="int8")
    int8.generate(prompts(SYSTEM + QUESTIONS[1]), GREEDY, use_tqdm=False)
    assert int8.stats()["kv_offload_hit_tokens"] == 0
    salted = shared(ckpt, redis_url)
    salted.generate([{"prompt_token_ids": SYSTEM + QUESTIONS[1], "cache_salt": "tenant"}], GREEDY, use_tqdm=False)
    assert salted.stats()["kv_offload_hit_tokens"] == 0
    compat = TierCompat("m", "float32", "auto", BS, 2, 2, 16)
    assert len({compat.digest, TierCompat("m", "float32", "auto", BS, 2, 2, 16, tp_rank=1, tp_size=2).digest,
                TierCompat("m", "float32", "auto", BS, 2, 2, 16, tp_size=2).digest}) == 3


def test_an_unreachable_redis_at_start_up_serves_without_it(ckpt):
    """A server that is not there: the engine starts, answers, counts the failure."""
    from kvserve.bench.serve import free_port

    llm = shared(ckpt, f"redis://127.0.0.1:{free_port()}/0")
    assert tokens(llm.generate(prompts(SYSTEM + QUESTIONS[0]), GREEDY, use_tqdm=False)) == \
        reference(ckpt, [SYSTEM + QUESTIONS[0]])
    assert llm.stats()["kv_offload_errors"] > 0 and llm.stats()["kv_offload_blocks"] == 0


@pytest.mark.parametrize("url", ["redis://", "redis://host", "redis://host:port", "redis://host:1/db", "rediss:x"])
def test_bad_urls_name_the_field(url):
    with pytest.raises(ValueError, match="kv_offload"):
        EngineConfig(kv_offload=url)


def test_the_tier_alone(redis_url):
    """put, get_prefix in one pipeline up to the first block it cannot serve, and the key checked on read."""
    from kvserve.kv.blocks import block_key

    compat = TierCompat("m", "float32", "auto", BS, 1, 1, 1)
    tier = RedisTier(redis_url, 2**20, compat, 64)
    keys, parent = [], None
    for i in range(4):
        keys.append(block_key(parent, tuple(range(i, i + BS)), None))
        parent = keys[-1].hash
    rows = torch.arange(4 * 64, dtype=torch.int32).to(torch.uint8).reshape(4, 64)
    for key, row in zip(keys[:3], rows):
        assert tier.put(key, row.clone())
    tier.flush()
    got = tier.get_prefix(keys)
    assert len(got) == 3 and all(torch.equal(g, r) for g, r in zip(got, rows))
    other = block_key(keys[0].parent_hash, keys[0].token_ids, "salt")
    assert tier.get(type(other)(keys[0].hash, other.parent_hash, other.token_ids, other.cache_salt)) is None
    assert tier.num_blocks == 3 and tier.contains(keys[1].hash) and not tier.contains(keys[3].hash)
    tier.close()


def test_an_idle_server_reports_blocks_its_writer_stored_after_the_last_step(ckpt, redis_url):
    """The engine core sends its stats again while idle once they change: /metrics shows the blocks the tier's
    writer stored after the last step, not the count as of that step."""
    import multiprocessing
    import threading

    from kvserve.server.engine_core import EngineCore

    llm = shared(ckpt, redis_url, num_kv_blocks=64)
    tier, release = llm.engine.connector.tier, threading.Event()
    store = tier._store
    tier._store = lambda blocks: (release.wait(60), store(blocks))        # the writer waits for the request's end
    ours, theirs = multiprocessing.Pipe()
    threading.Thread(target=EngineCore(llm.engine, theirs).run, daemon=True).start()
    try:
        assert ours.recv()[0] == "ready"
        ours.send(("add", "r", {"prompt_token_ids": SYSTEM + QUESTIONS[0]}, GREEDY, None))
        stats, finished = None, False
        while not finished:
            message = ours.recv()
            if message[0] == "outputs":
                stats, finished = message[2], any(o.finished for o in message[1])
        assert stats["kv_offload_blocks_stored"] == 0
        release.set()
        while stats["kv_offload_blocks_stored"] < len(SYSTEM) // BS:
            assert ours.poll(30), "the idle engine never reported the blocks its tier's writer stored"
            message = ours.recv()
            stats = message[1] if message[0] == "stats" else stats
    finally:
        release.set()
        ours.send(("shutdown",))
        while ours.recv()[0] != "stopped":
            pass
