"""The OpenAI-compatible server, driven by the real openai client on a loopback port."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig
from kvserve.engine.engine import LLMEngine
from kvserve.server.app import ServerConfig, build_app
from kvserve.server.async_engine import SHUTDOWN_GRACE_S, AsyncEngine
from servers import ENGINE_ARGS, KEY, MODEL, ServerThread, free_port, wait_for


@pytest.fixture(scope="module")
def ckpt(checkpoint):
    return checkpoint("llama")


@pytest.fixture(scope="module")
def url(ckpt):
    # as `kvserve serve` runs: the engine in a process of its own
    config = EngineConfig(model=str(ckpt), **ENGINE_ARGS)
    server = ServerConfig(api_key=KEY, max_queue=300, max_body_bytes=100_000)
    with ServerThread(build_app(config, MODEL, server)) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def offline(ckpt):
    return LLM(str(ckpt), **ENGINE_ARGS)


def test_completion_equals_offline_generate(client, offline):
    r = client.completions.create(model=MODEL, prompt="def fibonacci(n):", max_tokens=12, temperature=0)
    ref = offline.generate("def fibonacci(n):", SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)[0]
    assert r.choices[0].text == ref.outputs[0].text
    assert r.choices[0].finish_reason == ref.outputs[0].finish_reason
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streaming_completion_concatenates_to_the_same_text(client):
    full = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=16, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt="Once upon", max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_chat_streaming_and_not(client, offline):
    messages = [{"role": "user", "content": "hello there"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    ref = offline.chat(messages, SamplingParams(max_tokens=10, temperature=0), use_tqdm=False)[0]
    assert r.choices[0].message.content == ref.outputs[0].text and r.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.outputs[0].text


def test_n_seed_and_logprobs(client, offline):
    kw = dict(model=MODEL, prompt="import os", max_tokens=8, temperature=1.0, seed=7, n=3)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    texts = [c.text for c in a.choices]
    assert [c.index for c in a.choices] == [0, 1, 2] and texts == [c.text for c in b.choices]
    ref = offline.generate("import os", SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=7), use_tqdm=False)
    assert texts == [o.text for o in ref[0].outputs]
    lp = client.completions.create(model=MODEL, prompt="import os", max_tokens=4, temperature=0, logprobs=2)
    info = lp.choices[0].logprobs
    assert len(info.tokens) == len(info.token_logprobs) == len(info.top_logprobs) == 4
    # keyed by text, as OpenAI does: two tokens that decode alike share a key
    for top, chosen in zip(info.top_logprobs, info.token_logprobs):
        assert 1 <= len(top) <= 2 and max(top.values()) >= chosen - 1e-6
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content)


def test_per_request_eviction(client, offline):
    prompt, eviction = "a b c d e f g h i j k l m n o p q r s t u v w x y z " * 2, "sink:sinks=4,window=8"
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                    extra_body={"eviction": eviction, "ignore_eos": True})
    params = dict(max_tokens=8, temperature=0, ignore_eos=True)
    evicted = offline.generate(prompt, SamplingParams(eviction=eviction, **params), use_tqdm=False)[0]
    full = offline.generate(prompt, SamplingParams(**params), use_tqdm=False)[0]
    assert evicted.outputs[0].text != full.outputs[0].text      # the policy shows in the tokens
    assert out.choices[0].text == evicted.outputs[0].text


def test_stop_string_and_token_ids_prompt(client, offline):
    base = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=16, temperature=0)
    text = base.choices[0].text
    stop = text[5:8]
    cut = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=16, temperature=0, stop=[stop])
    assert cut.choices[0].text == text[:text.find(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=16, temperature=0, stop=stop,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == cut.choices[0].text


def test_several_prompts_in_one_request(client):
    r = client.completions.create(model=MODEL, prompt=["a b", "c d"], max_tokens=4, temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    single = client.completions.create(model=MODEL, prompt="c d", max_tokens=4, temperature=0)
    assert r.choices[2].text == single.choices[0].text


def test_models_health_tokenize(url):
    headers = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(f"{url}/health").status_code == 200
    models = httpx.get(f"{url}/v1/models", headers=headers).json()
    assert models["data"][0]["id"] == MODEL
    tok = httpx.post(f"{url}/tokenize", json={"prompt": "hello world"}, headers=headers).json()
    assert tok["count"] == len(tok["tokens"])
    back = httpx.post(f"{url}/detokenize", json={"tokens": tok["tokens"]}, headers=headers).json()
    assert back["prompt"].endswith("hello world")


@pytest.mark.parametrize("body, status, text", [
    ("{not json", 400, "JSON"),
    ({"model": MODEL, "prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "temperature": 5}, 400, "temperature"),
    ({"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"model": MODEL, "prompt": "x", "n": 0}, 400, "n"),
    ({"model": MODEL, "prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ({"model": MODEL}, 400, "prompt"),
    ({"model": MODEL, "prompt": "x " * 200, "max_tokens": 10}, 400, "max_model_len"),
    ({"model": MODEL, "prompt": [5, 999999]}, 400, "out of range"),
    ({"model": MODEL, "prompt": "x", "eviction": "lru:budget=4"}, 400, "unknown eviction policy 'lru'"),
    ({"model": "gpt-4", "prompt": "x"}, 404, "gpt-4"),
    ({"model": MODEL, "prompt": "y" * 200_000}, 413, "bytes"),
])
def test_bad_requests_get_clear_errors_and_the_server_goes_on(url, client, body, status, text):
    headers = {"Authorization": f"Bearer {KEY}"}
    if isinstance(body, str):
        r = httpx.post(f"{url}/v1/completions", content=body, headers={**headers, "content-type": "application/json"})
    else:
        r = httpx.post(f"{url}/v1/completions", json=body, headers=headers)
    assert r.status_code == status
    error = r.json()["error"]
    assert text in error["message"] and error["code"] == status
    assert client.completions.create(model=MODEL, prompt="ok", max_tokens=2).choices[0].text is not None


def test_api_key_is_required(url):
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    wrong = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x"},
                       headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401


def metric(url: str, name: str) -> float:
    """A metric's value, summed over its label sets."""
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith((f"kvserve:{name}{{", f"kvserve:{name} "))]
    assert values, f"no metric {name}"
    return sum(values)


def test_cancelled_streams_free_every_block(url):
    async def open_and_cancel(http: httpx.AsyncClient, i: int):
        body = {"model": MODEL, "prompt": f"story {i}", "max_tokens": 100, "stream": True, "ignore_eos": True}
        async with http.stream("POST", f"{url}/v1/completions", json=body) as r:
            assert r.status_code == 200
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data:")
                if seen >= 2:
                    break

    async def run():
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as http:
            await asyncio.gather(*(open_and_cancel(http, i) for i in range(50)))

    asyncio.run(run())
    deadline = time.monotonic() + 30
    while metric(url, "num_requests_running") or metric(url, "kv_cache_usage_perc"):
        assert time.monotonic() < deadline, "cancelled requests still hold the engine"
        time.sleep(0.1)
    assert metric(url, "num_requests_waiting") == 0
    assert metric(url, "request_success_total") >= 50
    assert metric(url, "time_to_first_token_seconds_count") >= 50


def test_full_queue_is_429(ckpt):
    engine = LLMEngine(EngineConfig(model=str(ckpt), **ENGINE_ARGS))
    with ServerThread(build_app(engine, MODEL, ServerConfig(max_queue=0))) as base:
        r = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "x"})
        assert r.status_code == 429 and "max-queue" in r.json()["error"]["message"]


def test_graceful_shutdown_finishes_in_flight_streams(ckpt):
    engine = LLMEngine(EngineConfig(model=str(ckpt), **ENGINE_ARGS))
    server = ServerThread(build_app(engine, MODEL))
    base = server.__enter__()
    body = {"model": MODEL, "prompt": "x", "max_tokens": 30, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    lines = []
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as r:
        for line in filter(None, r.iter_lines()):
            lines.append(line)
            if len(lines) == 1:
                server.server.should_exit = True     # shut down while the stream runs
    server.thread.join(timeout=60)
    assert not server.thread.is_alive()
    # every token reaches the client (a client that falls behind gets them in fewer, larger chunks)
    assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][len("data: "):])["usage"]["completion_tokens"] == 30
    assert not engine.has_unfinished_requests()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_chunked_oversized_body_is_413(url, client):
    def body():
        yield b'{"model": "tiny-llama", "prompt": "'
        for _ in range(30):
            yield b"y" * 5000
        yield b'"}'

    r = httpx.post(f"{url}/v1/completions", content=body(),
                   headers={"Authorization": f"Bearer {KEY}", "content-type": "application/json"})
    assert r.status_code == 413 and "bytes" in r.json()["error"]["message"]
    assert client.completions.create(model=MODEL, prompt="ok", max_tokens=2).choices[0].text is not None


def slowed_engine(ckpt, seen: list, in_step: threading.Event) -> LLMEngine:
    """An engine whose every step records how many requests it holds, then takes 0.1 s longer."""
    engine = LLMEngine(EngineConfig(model=str(ckpt), **ENGINE_ARGS))
    step = engine.step

    def slow_step():
        seen.append(len(engine.requests))
        in_step.set()
        time.sleep(0.1)
        return step()
    engine.step = slow_step
    return engine


def test_requests_arriving_during_a_step_enter_together(ckpt):
    seen, in_step = [], threading.Event()
    server = AsyncEngine(slowed_engine(ckpt, seen, in_step))
    server.start()
    params = SamplingParams(max_tokens=4, ignore_eos=True)

    async def burst():
        first = await server.submit("a", "x", params)
        await asyncio.to_thread(in_step.wait)           # the engine is inside its first step
        streams = await asyncio.gather(*(server.submit(f"b{i}", "x", params) for i in range(8)))
        for stream in (first, *streams):
            async for _ in stream:
                pass
    asyncio.run(burst())
    server.shutdown()
    assert seen[:2] == [1, 9]


def test_a_request_cancelled_before_it_enters_the_engine_leaves_nothing_behind(ckpt):
    seen, in_step = [], threading.Event()
    engine = slowed_engine(ckpt, seen, in_step)
    server = AsyncEngine(engine)
    server.start()
    params = SamplingParams(max_tokens=50, ignore_eos=True)

    async def cancel_early():
        first = await server.submit("a", "x", SamplingParams(max_tokens=2))
        await asyncio.to_thread(in_step.wait)
        late = asyncio.create_task(server.submit("late", "x", params))
        await asyncio.sleep(0)                            # queued, not yet admitted
        late.cancel()
        async for _ in first:
            pass
    asyncio.run(cancel_early())
    deadline = time.monotonic() + 10
    while engine.has_unfinished_requests() or server.num_in_flight:
        assert time.monotonic() < deadline, "the cancelled request is still in the engine"
        time.sleep(0.05)
    server.shutdown()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


@pytest.mark.parametrize("where", ["step", "sampler"])
def test_a_failing_step_fails_its_requests_and_the_engine_serves_on(ckpt, where):
    engine = LLMEngine(EngineConfig(model=str(ckpt), **ENGINE_ARGS))
    # the sampler fails inside LLMEngine.step, which aborts the step's requests itself
    owner, name = (engine, "step") if where == "step" else (engine, "sampler")
    real, calls = getattr(owner, name), []

    def failing_once(*args):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return real(*args)
    setattr(owner, name, failing_once)
    with ServerThread(build_app(engine, MODEL)) as base:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 3, "ignore_eos": True}
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=30)
        assert r.status_code == 500 and "boom" in r.json()["error"]["message"]
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_a_stream_whose_step_fails_ends_with_an_error_event_then_done(ckpt):
    engine = LLMEngine(EngineConfig(model=str(ckpt), **ENGINE_ARGS))
    real, calls = engine.step, []

    def failing_second(*args):
        calls.append(1)
        if len(calls) == 2:         # after the first chunk is sent: the status is 200 by then
            raise RuntimeError("boom")
        return real(*args)
    engine.step = failing_second
    with ServerThread(build_app(engine, MODEL)) as base:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 5, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=30) as r:
            events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
        assert r.status_code == 200
        assert "boom" in json.loads(events[-2])["error"]["message"] and events[-1] == "[DONE]"


def test_a_killed_engine_process_fails_its_requests_and_is_started_again(ckpt):
    app = build_app(EngineConfig(model=str(ckpt), **ENGINE_ARGS), MODEL)
    server = app.state.async_engine
    with ServerThread(app) as base:
        killed = server._core
        body = {"model": MODEL, "prompt": "x", "max_tokens": 120, "ignore_eos": True}
        with ThreadPoolExecutor(1) as pool:
            in_flight = pool.submit(httpx.post, f"{base}/v1/completions", json=body, timeout=60)
            wait_for(lambda: server.num_in_flight == 1, "the request is in the engine")
            os.kill(killed.pid, signal.SIGKILL)
            r = in_flight.result()
        assert r.status_code == 500 and "engine" in r.json()["error"]["message"]
        # until a new engine is ready: not healthy, no engine gauges, new requests refused
        health = httpx.get(f"{base}/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == 503
        assert "kvserve:kv_cache_usage_perc" not in httpx.get(f"{base}/metrics").text
        refused = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
        assert refused.status_code == 503 and "not running" in refused.json()["error"]["message"]
        wait_for(lambda: httpx.get(f"{base}/health").status_code == 200, "the engine is started again")
        assert killed.exitcode == -signal.SIGKILL and server._core.is_alive()     # reaped, replaced
        r = httpx.post(f"{base}/v1/completions", json={**body, "max_tokens": 3}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert "kvserve:kv_cache_usage_perc" in httpx.get(f"{base}/metrics").text


def test_an_engine_that_cannot_start_again_is_tried_a_bounded_number_of_times(ckpt, tmp_path, caplog):
    config = EngineConfig(model=str(ckpt), **ENGINE_ARGS)
    app = build_app(config, MODEL, ServerConfig(engine_start_attempts=2))
    server = app.state.async_engine
    with ServerThread(app) as base:
        server._config = dataclasses.replace(config, model=str(tmp_path / "gone"))   # the next starts fail
        os.kill(server._core.pid, signal.SIGKILL)
        wait_for(lambda: server.dead is not None and "2 tries" in server.dead, "the engine is given up on")
        health = httpx.get(f"{base}/health")
        assert health.status_code == 503 and "could not be started again" in health.json()["error"]["message"]
        r = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=60)
        assert r.status_code == 503
    assert [record.msg for record in caplog.records].count("engine start %d of %d failed: %s") == 2


def test_an_engine_process_that_does_not_stop_is_killed_at_shutdown(ckpt, monkeypatch, caplog):
    import kvserve.server.async_engine as async_engine

    monkeypatch.setattr(async_engine, "SHUTDOWN_GRACE_S", 1.0)
    app = build_app(EngineConfig(model=str(ckpt), **ENGINE_ARGS), MODEL)
    core = app.state.async_engine._core
    with ServerThread(app) as base:
        assert httpx.get(f"{base}/health").status_code == 200
        os.kill(core.pid, signal.SIGSTOP)         # hung: it never reads the word to stop
    assert not core.is_alive() and core.exitcode == -signal.SIGKILL
    assert any("did not exit within" in record.getMessage() for record in caplog.records)


def test_the_engine_process_reports_a_bad_model_and_stops_with_the_server(ckpt, tmp_path):
    with pytest.raises(ValueError, match="no-such-model"):
        build_app(EngineConfig(model=str(tmp_path / "no-such-model")), MODEL)
    app = build_app(EngineConfig(model=str(ckpt), **ENGINE_ARGS), MODEL)
    core = app.state.async_engine._core
    with ServerThread(app) as base:
        assert httpx.get(f"{base}/health").status_code == 200
        assert core.is_alive()
    assert not core.is_alive() and core.exitcode == 0


# ---- `kvserve serve` as a service manager runs it -------------------------------------

def serve_command(ckpt, port: int, env: dict | None = None) -> subprocess.Popen:
    """`kvserve serve` in a process group (and session) of its own, as systemd or a terminal starts it."""
    command = [sys.executable, "-m", "kvserve", "serve", "--model", str(ckpt), "--port", str(port), "--block-size", "4",
               "--num-kv-blocks", "256", "--max-model-len", "128"]
    return subprocess.Popen(command, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, **(env or {})})


def healthy(base: str) -> bool:
    try:
        return httpx.get(f"{base}/health").status_code == 200
    except httpx.TransportError:
        return False


def group_members(pgid: int) -> list[int]:
    """The processes of a process group still running (zombies are not)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


def spawned_children(pid: int) -> list[int]:
    """The processes multiprocessing has spawned from process `pid` (its engine process)."""
    spawned = []
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        try:
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                spawned.append(int(child))
        except OSError:         # gone meanwhile
            continue
    return spawned


# the tests of `kvserve serve`'s processes read them from /proc
READS_PROC = Path(f"/proc/self/task/{os.getpid()}/children").exists()


def stopped(proc: subprocess.Popen) -> str:
    """Wait for the server to exit (killing its group if it never does) and for its group to be gone; its output."""
    try:
        out, _ = proc.communicate(timeout=SHUTDOWN_GRACE_S + 60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    wait_for(lambda: not group_members(proc.pid), "every process of the server's group has exited")
    return out


@pytest.mark.skipif(not READS_PROC, reason="reads processes from /proc")
def test_sigterm_to_the_process_group_shuts_the_server_down_once_and_quietly(ckpt):
    """systemd stops a service with SIGTERM to all its processes: the engine process goes on until the server, which
    finishes the requests in flight, tells it to stop; it is never restarted. (The key comes from the environment.)"""
    port = free_port()
    proc = serve_command(ckpt, port, env={"KVSERVE_API_KEY": KEY})
    base, lines = f"http://127.0.0.1:{port}", []
    try:
        wait_for(lambda: healthy(base), "the server is up")
        assert httpx.get(f"{base}/v1/models").status_code == 401
        # few enough tokens that a loaded machine finishes them within the shutdown's grace
        body = {"prompt": "x", "max_tokens": 32, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                          timeout=120) as r:
            for line in filter(None, r.iter_lines()):
                lines.append(line)
                if len(lines) == 1:
                    os.killpg(proc.pid, signal.SIGTERM)
    finally:
        out = stopped(proc)
    assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][len("data: "):])["usage"]["completion_tokens"] == 32
    assert "restart" not in out and "running again" not in out and "Traceback" not in out, out
    assert proc.returncode == -signal.SIGTERM


@pytest.mark.skipif(not READS_PROC, reason="reads processes from /proc")
@pytest.mark.parametrize("when", ["starting", "serving"])
def test_ctrl_c_stops_the_server_without_a_traceback(ckpt, when):
    """Ctrl+C reaches the terminal's process group: the server stops (after its engine process, which it started or
    was starting) with exit code 130 and no traceback."""
    port = free_port()
    proc = serve_command(ckpt, port)
    try:
        if when == "starting":
            wait_for(lambda: spawned_children(proc.pid), "the engine process is being started")
        else:
            wait_for(lambda: healthy(f"http://127.0.0.1:{port}"), "the server is up")
        os.killpg(proc.pid, signal.SIGINT)
    finally:
        out = stopped(proc)
    assert proc.returncode == 130 and "Traceback" not in out and "KeyboardInterrupt" not in out, out
