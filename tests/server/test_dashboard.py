"""The live view of the KV cache: the state the engine reports at its step boundaries, and its endpoints."""
from __future__ import annotations

import asyncio
import json
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from kvserve.cli import build_parser, main
from kvserve.config import EngineConfig, ServerConfig
from kvserve.engine import kv_state
from kvserve.engine.engine import LLMEngine
from kvserve.engine.kv_state import STATES, block_detail, render, snapshot
from kvserve.sampling import SamplingParams
from kvserve.server import engine_core
from kvserve.server.app import build_app
from kvserve.server.async_engine import AsyncEngine
from kvserve.server.dashboard import KVStateView
from kvserve.server.metrics import ServerMetrics
from kvserve.server.tokenization import ServerTokenizer
from kvserve.server.top import grid_cells
from tiny_models import HYBRID
from servers import ServerThread

MODEL = "tiny-llama"
KEY = "sk-dash"
AUTH = {"Authorization": f"Bearer {KEY}"}
SYSTEM = list(range(3, 30))                  # a prompt prefix of six full blocks of 4 tokens and a part


def expected_states(engine: LLMEngine) -> str:
    """Each block's state from the block tables (who owns it) and the prefix index (what it holds),
    as the view's characters."""
    kv, pool = engine.kv, engine.kv.pool
    tables = [t for m in getattr(kv, "groups", [kv]) for t in m.block_tables.values()]
    owners = Counter(b for table in [*tables, *kv.pinned.values()] for b in table)
    if kv.null_block is not None:       # a hybrid cache's: held by the cache itself
        owners[kv.null_block] += 1
    states = []
    for b in range(kv.num_blocks):
        if owners[b]:
            name = "shared" if owners[b] > 1 else "used"
        else:
            key = pool.keys[b]
            name = "cached" if key is not None and pool.lookup(key) == b else "free"
        states.append(STATES[name])
    return "".join(states)


def add_workload(engine: LLMEngine) -> None:
    """Prefix hits (two prompts after a common one), forks (n = 3), and a sink policy that evicts."""
    greedy = dict(max_tokens=10, ignore_eos=True, temperature=0)
    engine.add_request("first", {"prompt_token_ids": SYSTEM + [40, 41]}, SamplingParams(**greedy))
    engine.step()
    engine.add_request("hit", {"prompt_token_ids": SYSTEM + [50, 51, 52]}, SamplingParams(**greedy))
    engine.add_request("fork", {"prompt_token_ids": SYSTEM + [60]},
                       SamplingParams(max_tokens=10, ignore_eos=True, n=3, temperature=1.0, seed=1))
    engine.add_request("sink", {"prompt_token_ids": list(range(100, 140))},
                       SamplingParams(max_tokens=30, ignore_eos=True, eviction="sink:sinks=4,window=8"))


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int4"])
def test_the_state_counts_each_block_as_the_pool_holds_it_at_every_step(tiny_llama, kv_cache_dtype):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), block_size=4, num_kv_blocks=48,
                                    kv_cache_dtype=kv_cache_dtype))
    add_workload(engine)
    seen = Counter()
    while engine.has_unfinished_requests():
        engine.step()
        state, stats = render(snapshot(engine)), engine.stats()
        assert state["blocks"] == expected_states(engine)
        counts = state["counts"]
        assert counts == {name: state["blocks"].count(c) for name, c in STATES.items()}
        # the same counts as LLMEngine.stats() (and so /metrics) at the same step
        assert state["stats"] == stats and "kv_offload" not in state      # no second tier here
        assert counts["free"] + counts["cached"] == stats["kv_blocks_free"] == engine.kv.pool.num_free
        assert [s["seq_id"] for s in state["running"]] == [s.seq_id for s in engine.scheduler.running]
        assert len(state["running"]) == stats["num_running"] and len(state["waiting"]) == stats["num_waiting"]
        for seq in state["running"]:
            assert seq["block_table"] == engine.kv.block_tables[seq["seq_id"]]
        seen.update(name for name, n in counts.items() if n)
    assert stats["prefix_cache_hits"] > 0 and stats["num_evicted_tokens"] > 0
    assert set(seen) == {"free", "cached", "used", "shared"}


def test_a_block_shows_its_owners_hash_and_tokens(tiny_llama):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), block_size=4, num_kv_blocks=48))
    add_workload(engine)
    for _ in range(3):
        engine.step()
    fork = engine.requests["fork"]
    table = engine.kv.block_tables[fork[0].seq_id]
    def block_detail(engine, block_id):
        return kv_state.block_detail(engine, block_id, show_content=True)

    shared = block_detail(engine, table[1])       # the system prompt's second block: every request's
    assert shared["state"] == "shared" and shared["token_ids"] == SYSTEM[4:8]
    assert shared["prefix_hash"] == fork[0].block_keys[1].hash.hex()
    assert shared["parent_hash"] == fork[0].block_keys[0].hash.hex()
    assert Counter(o["request_id"] for o in shared["owners"]) == {"first": 1, "hit": 1, "fork": 3}
    assert shared["ref_count"] == len(shared["owners"]) == 5 and {o["index"] for o in shared["owners"]} == {1}
    last = block_detail(engine, table[-1])        # part full, after the prompt: its computed tokens only
    seq = fork[0]
    assert last["prefix_hash"] is None
    assert last["token_ids"] == seq.token_ids[(len(table) - 1) * 4:seq.num_computed_tokens]
    while engine.requests["sink"][0].num_evicted_tokens == 0:
        engine.step()
    sink = engine.requests["sink"][0]
    window = engine.kv.block_tables[sink.seq_id]
    # past the sink block, a block holds the tokens after those dropped
    assert block_detail(engine, window[-1])["token_ids"] == sink.token_ids[(len(window) - 1) * 4 +
                                                                           sink.num_evicted_tokens:
                                                                           sink.num_computed_tokens]
    pinned = block_detail(engine, engine.kv.pinned[sink.seq_id][0])
    assert pinned["owners"] == [{"request_id": "sink", "seq_id": sink.seq_id, "group": 0, "index": 0,
                                 "pinned": True}]
    assert pinned["token_ids"] == sink.token_ids[:4]
    with pytest.raises(ValueError, match="block_id"):
        block_detail(engine, 48)


def test_a_blocks_tokens_are_shown_only_when_asked_and_only_under_its_own_salt(tiny_llama):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), block_size=4, num_kv_blocks=48))
    greedy = SamplingParams(max_tokens=3, ignore_eos=True, temperature=0)
    engine.add_request("a", {"prompt_token_ids": SYSTEM, "cache_salt": "tenant-a"}, greedy)
    engine.add_request("plain", {"prompt_token_ids": SYSTEM}, greedy)
    engine.step()
    salted = engine.kv.block_tables[engine.requests["a"][0].seq_id]
    plain = engine.kv.block_tables[engine.requests["plain"][0].seq_id]
    assert not set(salted) & set(plain)            # the salt keeps their prefixes apart
    for table, salt in ((salted, "tenant-a"), (plain, None)):
        for block in (table[0], table[-1]):        # a full, hashed block and the partial one after it
            assert block_detail(engine, block)["content"] == "off"       # by default: structure only
            assert block_detail(engine, block)["token_ids"] is None
            shown = block_detail(engine, block, show_content=True, cache_salt=salt)
            assert shown["content"] == "shown" and shown["token_ids"]
            for other in {"tenant-a", "tenant-b", "tenant-", None} - {salt}:
                hidden = block_detail(engine, block, show_content=True, cache_salt=other)
                assert hidden["content"] == "other_salt" and hidden["token_ids"] is None
    while engine.has_unfinished_requests():
        engine.step()
    cached = block_detail(engine, salted[0], show_content=True)         # after the request finished, as cached
    assert cached["state"] == "cached" and cached["token_ids"] is None and cached["content"] == "other_salt"
    assert block_detail(engine, salted[0], True, "tenant-a")["token_ids"] == SYSTEM[:4]


def test_a_block_with_hundreds_of_owners_is_shared(tiny_llama):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), block_size=4, num_kv_blocks=400, max_num_seqs=300))
    engine.add_request("many", {"prompt_token_ids": list(range(3, 11))},
                       SamplingParams(max_tokens=2, n=300, temperature=1.0, ignore_eos=True))
    engine.step()
    state = render(snapshot(engine))
    assert engine.kv.pool.ref_counts[engine.kv.block_tables[0][0]] == 300
    assert state["blocks"] == expected_states(engine) and state["counts"]["shared"] == 2


def test_no_cache_has_no_blocks(tiny_llama):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), cache_mode="none"))
    engine.add_request("r", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=3))
    engine.step()
    state = render(snapshot(engine))
    assert state["blocks"] == "" and state["num_blocks"] == 0 and len(state["running"]) == 1


def test_the_state_carries_the_offload_tiers_counters_as_stats_counts_them(tiny_llama, tmp_path):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), block_size=4, num_kv_blocks=8,
                                    kv_offload=f"disk:{tmp_path / 'tier'}", kv_offload_size="1MiB",
                                    preemption_mode="recompute"))
    greedy = SamplingParams(max_tokens=3, ignore_eos=True, temperature=0)
    prompts = [list(range(3 + 40 * i, 24 + 40 * i)) for i in range(3)]     # five full blocks each
    # one at a time in a pool of 8 blocks: the first prompt's blocks leave it for the tier, and come back
    for i, prompt in enumerate(prompts + prompts[:1]):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, greedy)
        while engine.has_unfinished_requests():
            engine.step()
            engine.connector.tier.flush()         # its writer stores blocks in the background: none moves now
            state, stats = render(snapshot(engine)), engine.stats()
            assert state["kv_offload"] == {"kind": "disk", "blocks": stats["kv_offload_blocks"],
                                           "bytes": stats["kv_offload_bytes"],
                                           "capacity_bytes": stats["kv_offload_capacity_bytes"],
                                           "hit_tokens": stats["kv_offload_hit_tokens"],
                                           "miss_tokens": stats["kv_offload_miss_tokens"]}
    assert state["kv_offload"]["capacity_bytes"] == 2**20
    assert state["kv_offload"]["blocks"] > 0 and 0 < state["kv_offload"]["bytes"] <= 2**20
    assert state["kv_offload"]["hit_tokens"] == 20


def test_every_block_of_a_hybrid_cache_has_its_owners_in_their_group(checkpoint):
    # three layers: two sliding (window 8), one global: three layer groups, each with its own block tables
    gemma3 = checkpoint(**HYBRID["gemma3"])
    engine = LLMEngine(EngineConfig(model=str(gemma3), block_size=4, num_kv_blocks=64, dtype="float32"))
    kv = engine.kv
    greedy = SamplingParams(max_tokens=20, ignore_eos=True, temperature=0)
    engine.add_request("a", {"prompt_token_ids": SYSTEM}, greedy)
    engine.add_request("b", {"prompt_token_ids": SYSTEM[:12] + [40, 41]}, greedy)
    groups_seen = set()
    while engine.has_unfinished_requests():
        engine.step()
        state = render(snapshot(engine))
        assert state["blocks"] == expected_states(engine)
        for seq in state["running"]:
            assert [seq["block_table"], *seq["group_tables"]] == kv.group_tables(seq["seq_id"])
        # a block's owners are the entries of every group's tables, the null block's (the one a sliding group
        # puts for the blocks that left its window) too, beyond the reference the cache itself keeps on it
        entries = Counter(b for seq in state["running"] for table in [seq["block_table"], *seq["group_tables"]]
                          for b in table)
        assert entries == {b: n - (b == kv.null_block) for b, n in enumerate(kv.pool.ref_counts)
                           if n - (b == kv.null_block)}
        for seq in state["running"]:
            for group, table in enumerate(seq["group_tables"], start=1):
                for index, b in enumerate(table[:1]):
                    owners = block_detail(engine, b)["owners"]
                    assert {"request_id": seq["request_id"], "seq_id": seq["seq_id"], "group": group,
                            "index": index, "pinned": False} in owners
                    groups_seen.add(group)
    assert groups_seen == {1, 2}


def test_a_sinks_pinned_blocks_name_their_own_layer_group(checkpoint):
    # layers 0 and 1 attend fully (a group each), layer 2 within 8 tokens: sink pins its originals in both
    # full-attention groups, each a block of its own
    qwen2 = checkpoint("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=2,
                       num_hidden_layers=3)
    engine = LLMEngine(EngineConfig(model=str(qwen2), block_size=4, num_kv_blocks=64, dtype="float32",
                                    eviction="sink:sinks=4,window=12"))
    engine.add_request("s", {"prompt_token_ids": list(range(1, 30))},
                       SamplingParams(max_tokens=20, ignore_eos=True, temperature=0))
    pinned = {}
    while engine.has_unfinished_requests() and not pinned:
        engine.step()
        seq = engine.scheduler.running[0]
        pinned = {g: m.pinned[seq.seq_id] for g, m in enumerate(engine.kv.groups) if m.pinned.get(seq.seq_id)}
    assert sorted(pinned) == [0, 1]
    for group, blocks in pinned.items():
        for index, b in enumerate(blocks):
            assert block_detail(engine, b)["owners"] == [{"request_id": "s", "seq_id": seq.seq_id, "group": group,
                                                          "index": index, "pinned": True}]


# ---- the endpoints ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def url(tiny_llama):
    # as `kvserve serve` runs: the engine in a process of its own
    config = EngineConfig(model=str(tiny_llama), block_size=4, num_kv_blocks=64, max_model_len=128)
    with ServerThread(build_app(config, MODEL, ServerConfig(api_key=KEY))) as base:
        yield base


def test_the_state_needs_the_key_and_the_page_does_not(url):
    page = httpx.get(f"{url}/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "connect-src 'self'" in page.headers["content-security-policy"]
    assert "<script" in page.text and "http://" not in page.text.replace("http://www.w3.org/2000/svg", "")
    for path in ("/v1/kv/state", "/v1/kv/blocks/0"):
        r = httpx.get(f"{url}{path}")
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert httpx.get(f"{url}{path}", headers={"Authorization": "Bearer wrong"}).status_code == 401


def test_the_state_json(url):
    prompt = "The quick brown fox jumps over the lazy dog. Once upon a time there was a cache."
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "n": 2, "temperature": 1.0}
    assert httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=60).status_code == 200
    state = httpx.get(f"{url}/v1/kv/state", headers=AUTH).json()
    assert state["object"] == "kv_state" and state["model"] == MODEL
    assert (state["num_blocks"], state["block_size"], state["cache_mode"], state["kv_cache_dtype"]) == \
        (64, 4, "paged", "auto")
    assert len(state["blocks"]) == 64 and set(state["blocks"]) <= set(STATES.values())
    assert set(state["counts"]) == set(STATES) and sum(state["counts"].values()) == 64
    assert state["counts"]["cached"] > 0 and state["running"] == state["waiting"] == []
    assert state["server"]["generation_tokens"] == 8 and state["server"]["prompt_tokens"] > 0
    assert state["stats"]["kv_blocks_free"] == 64
    # a cached block: its structure, not the prompt's tokens (the server was not asked to show them)
    cached = state["blocks"].index("c")
    detail = httpx.get(f"{url}/v1/kv/blocks/{cached}", headers=AUTH).json()
    assert detail["state"] == "cached" and detail["owners"] == [] and len(detail["prefix_hash"]) == 32
    assert detail["content"] == "off" and detail["token_ids"] is None and detail["text"] is None


SECRET = "TENANT-A SECRET: the launch code is 0000. " * 3


def salted_blocks(base: str) -> tuple[list[int], str]:
    """Run a salted request to its end (one token: its blocks hold the prompt alone); they stay cached. The
    cached blocks, and the secret's text."""
    body = {"model": MODEL, "prompt": SECRET, "max_tokens": 1, "cache_salt": "tenant-a", "temperature": 0}
    assert httpx.post(f"{base}/v1/completions", json=body, timeout=60).status_code == 200
    state = httpx.get(f"{base}/v1/kv/state").json()
    return [b for b, c in enumerate(state["blocks"]) if c == "c"], SECRET


@pytest.mark.parametrize("show_content", [False, True])
def test_no_caller_reads_a_salted_prompt_without_its_salt(tiny_llama, show_content):
    config = EngineConfig(model=str(tiny_llama), block_size=4, num_kv_blocks=64, max_model_len=128)
    with ServerThread(build_app(config, MODEL, ServerConfig(kv_dashboard_content=show_content))) as base:
        cached, secret = salted_blocks(base)
        assert cached
        for salt in (None, "tenant-b", "tenant-"):
            headers = {"X-Cache-Salt": salt} if salt else {}
            for b in cached:
                detail = httpx.get(f"{base}/v1/kv/blocks/{b}", headers=headers).json()
                assert detail["text"] is None and detail["token_ids"] is None
                assert detail["content"] == ("other_salt" if show_content else "off")
        own = [httpx.get(f"{base}/v1/kv/blocks/{b}", headers={"X-Cache-Salt": "tenant-a"}).json() for b in cached]
        if show_content:     # its own tenant, where the operator turned content on, reads it back
            assert all(d["content"] == "shown" and d["text"] in secret for d in own)
        else:
            assert all(d["content"] == "off" and d["text"] is None for d in own)


@pytest.mark.parametrize("path, status", [("/v1/kv/blocks/64", 404), ("/v1/kv/blocks/-1", 404),
                                          ("/v1/kv/blocks/first", 400)])
def test_a_block_that_is_not_there(url, path, status):
    r = httpx.get(f"{url}{path}", headers=AUTH)
    assert r.status_code == status
    error = r.json()["error"]
    assert error["param"] == "block_id" and "block_id" in error["message"]


def test_the_dashboard_can_be_turned_off(tiny_llama):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), block_size=4, num_kv_blocks=16))
    with ServerThread(build_app(engine, MODEL, ServerConfig(kv_dashboard=False))) as base:
        for path in ("/dashboard", "/v1/kv/state", "/v1/kv/blocks/0"):
            assert httpx.get(f"{base}{path}").status_code == 404
    assert build_parser().parse_args(["serve", "--no-kv-dashboard"]).kv_dashboard is False
    assert build_parser().parse_args(["serve"]).kv_dashboard is True
    assert build_parser().parse_args(["serve"]).kv_dashboard_content is False
    assert build_parser().parse_args(["serve", "--kv-dashboard-content"]).kv_dashboard_content is True


class PausableEngine:
    """Makes an LLMEngine look idle once it has run `pause_after` steps, so that its core waits between
    two steps, answering reads of its state, until `resume`."""

    def __init__(self, engine: LLMEngine):
        self.engine, self.steps, self.pause_after = engine, 0, None
        self.paused = threading.Event()
        step, unfinished = engine.step, engine.has_unfinished_requests

        def counted_step():
            outputs = step()
            self.steps += 1
            if self.steps == self.pause_after:
                self.paused.set()
            return outputs

        engine.step = counted_step
        engine.has_unfinished_requests = lambda: not self.paused.is_set() and unfinished()

    def resume(self) -> None:
        self.pause_after = None
        self.paused.clear()


def metric(text: str, name: str) -> float:
    line = next(line for line in text.splitlines() if line.startswith(f"kvserve:{name}{{"))
    return float(line.rsplit(" ", 1)[1])


def test_the_state_agrees_with_metrics_at_the_same_step(tiny_llama):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), block_size=4, num_kv_blocks=64, max_model_len=256))
    pausable = PausableEngine(engine)
    with ServerThread(build_app(engine, MODEL)) as base, httpx.Client(base_url=base, timeout=60) as http:
        prompt = {"model": MODEL, "prompt": SYSTEM + [40, 41], "max_tokens": 2}
        assert http.post("/v1/completions", json=prompt).status_code == 200
        pausable.pause_after = pausable.steps + 3      # the prefill and two decodes of the next request
        long = {"model": MODEL, "prompt": SYSTEM + [50], "max_tokens": 60, "n": 2, "temperature": 1.0,
                "ignore_eos": True}
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(http.post, "/v1/completions", json=long)
            assert pausable.paused.wait(60)
            state = http.get("/v1/kv/state").json()
            metrics = http.get("/metrics").text
            stats = engine.stats()                     # the engine waits: the same step
            assert state["stats"] == stats
            assert state["blocks"] == expected_states(engine)
            counts, total = state["counts"], state["num_blocks"]
            assert counts["shared"] > 0 and stats["prefix_cache_hits"] > 0
            in_use = total - counts["free"] - counts["cached"]
            assert metric(metrics, "kv_cache_usage_perc") == in_use / total
            assert metric(metrics, "num_requests_running") == len(state["running"]) == 2
            assert metric(metrics, "num_requests_waiting") == len(state["waiting"]) == 0
            assert metric(metrics, "prefix_cache_hits_total") == stats["prefix_cache_hits"]
            assert metric(metrics, "prefix_cache_queries_total") == stats["prefix_cache_queries"]
            pausable.resume()
            # a request wakes the core, which has gone to wait for one
            assert http.post("/v1/completions", json=prompt).status_code == 200
            assert running.result().status_code == 200


def test_pollers_share_one_snapshot_a_period(tiny_llama, monkeypatch):
    taken = []

    def counted(engine):
        taken.append(engine.stats()["kv_blocks_free"])
        return kv_state.snapshot(engine)

    monkeypatch.setitem(engine_core.QUERIES, "kv_state", counted)
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), block_size=4, num_kv_blocks=16))
    server = AsyncEngine(engine)
    metrics = ServerMetrics(server.stats, MODEL)
    view = KVStateView(server, ServerTokenizer(engine.tokenizer, engine.max_model_len), metrics, MODEL, interval=60)

    async def watch():
        first = await asyncio.gather(*(view.state() for _ in range(10)))
        again = await view.state()
        return first, again

    server.start()
    try:
        first, again = asyncio.run(watch())
    finally:
        server.shutdown()
    assert len(taken) == 1 and set(first) == {again}
    assert json.loads(again)["num_blocks"] == 16


def test_top_prints_the_state_and_needs_the_key(url, capsys):
    assert main(["top", "--url", url, "--api-key", KEY, "--once"]) == 0
    out = capsys.readouterr().out
    state = httpx.get(f"{url}/v1/kv/state", headers=AUTH).json()     # idle: the same counts
    assert f"{state['num_blocks']} blocks × 4 tokens" in out
    assert all(f"{name} {state['counts'][name]}" in out for name in ("free", "cached", "used", "shared"))
    assert main(["top", "--url", url, "--once"]) == 2
    assert "401 invalid or missing API key" in capsys.readouterr().err


def test_top_shows_the_most_telling_state_of_the_blocks_a_cell_stands_for():
    assert grid_cells("..uus.cc", 8) == ["free", "free", "used", "used", "shared", "free", "cached", "cached"]
    assert grid_cells("..uus.cc", 3) == ["used", "shared", "cached"]


def test_a_sequences_reads_under_sparse_attention(tiny_llama):
    """GET /v1/kv/sequences/{seq_id}/reads: per layer, how many KV heads read each block of a sequence in the last
    step under sparse attention (every block in a dense layer, some in the others); a 404 naming seq_id for a
    sequence that was not in it, and the key needed."""
    config = EngineConfig(model=str(tiny_llama), block_size=4, num_kv_blocks=64, max_model_len=128,
                          sparse_attention="quest:budget=16,recent=4,sinks=4,dense_layers=1")
    with ServerThread(build_app(config, MODEL, ServerConfig(api_key=KEY))) as base:
        body = {"model": MODEL, "prompt": list(range(3, 60)), "max_tokens": 3, "temperature": 0}
        assert httpx.post(f"{base}/v1/completions", json=body, headers=AUTH, timeout=60).status_code == 200
        reads = httpx.get(f"{base}/v1/kv/sequences/0/reads", headers=AUTH).json()
        assert reads["object"] == "kv_sparse_reads" and reads["kv_heads"] == 2 and len(reads["layers"]) == 2
        dense, sparse = reads["layers"]
        assert dense == "2" * 15 and set(sparse) <= {"0", "1", "2"} and 0 < sum(map(int, sparse)) < 30
        missing = httpx.get(f"{base}/v1/kv/sequences/7/reads", headers=AUTH)
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "seq_id"
        assert httpx.get(f"{base}/v1/kv/sequences/0/reads").status_code == 401
        state = httpx.get(f"{base}/v1/kv/state", headers=AUTH).json()
        assert 0 < state["stats"]["sparse_blocks_read"] < state["stats"]["sparse_blocks_total"]
