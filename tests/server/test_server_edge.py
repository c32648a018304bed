"""The server against hostile and careless clients: slow sockets, huge or malformed bodies, missing
keys, over-large asks. Driven over loopback, raw sockets where a client library would be too polite."""
from __future__ import annotations

import json
import logging
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import fastapi.routing
import httpx
import pytest

from kvserve.config import EngineConfig
from kvserve.engine.engine import LLMEngine
from kvserve.server.app import ServerConfig, build_app
from kvserve.server.http import MAX_HEAD_BYTES, PARSE_OFF_LOOP_BYTES
from kvserve.server.tokenization import UTILITY_TOKENIZER_THREADS
from servers import ENGINE_ARGS, KEY, MODEL, ServerThread, wait_for

AUTH = {"Authorization": f"Bearer {KEY}"}
EDGE = ServerConfig(api_key=KEY, max_body_bytes=2 * 2**20, request_read_timeout=3, max_n_sequences=16,
                    max_completion_prompts=4, max_request_sequences=32, max_request_tokens=1700)


@pytest.fixture(scope="module")
def ckpt(checkpoint):
    return checkpoint("llama")


@pytest.fixture(scope="module")
def served(ckpt):
    """`kvserve serve` with a key, a 2 MiB body limit, a 3 s read timeout and small fan-out limits."""
    server = ServerThread(build_app(EngineConfig(model=str(ckpt), **ENGINE_ARGS), MODEL, EDGE), EDGE)
    server.__enter__()
    yield server
    server.__exit__()


@pytest.fixture(scope="module")
def url(served):
    return f"http://127.0.0.1:{served.port}"


@pytest.fixture(scope="module")
def in_thread(ckpt):
    """An engine object stepped in a thread (its tokenizer at hand), at most 2 open connections."""
    engine = LLMEngine(EngineConfig(model=str(ckpt), **ENGINE_ARGS))
    config = ServerConfig(max_connections=2)
    server = ServerThread(build_app(engine, MODEL, config), config)
    server.__enter__()
    yield engine, server
    server.__exit__()


def connect(port: int) -> socket.socket:
    """A raw client socket; the timeout only keeps a test from hanging on a server that never answers."""
    return socket.create_connection(("127.0.0.1", port), timeout=60)


def request(method: str, path: str, body: bytes = b"", headers: dict | None = None) -> bytes:
    head = [f"{method} {path} HTTP/1.1", "Host: test", f"Content-Length: {len(body)}",
            *(f"{k}: {v}" for k, v in (headers or {}).items())]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response with a content-length: status, headers, body."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise EOFError(f"the connection closed after {data!r}")
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    status_line, *lines = head.decode().split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}
    while len(body) < int(headers.get("content-length", 0)):
        body += sock.recv(65536)
    return int(status_line.split()[1]), headers, body


def openai_error(body: bytes, code: int) -> dict:
    """The error of an OpenAI-shaped error body."""
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code
    return error


def closed(sock: socket.socket) -> bool:
    return sock.recv(1) == b""


# ---- never stall for one request -------------------------------------------------------

def test_tokenize_calls_in_flight_never_delay_a_request_s_prompt(served, url, monkeypatch):
    """Six /tokenize calls held inside the tokenizer (as long texts hold it) take all the threads /tokenize has:
    a completion's prompt is encoded in threads of its own, and the completion is answered meanwhile."""
    tok = served.server.config.app.state.async_engine.engine.tokenizer     # the HTTP side's
    encode, entered, release = tok.encode, threading.Semaphore(0), threading.Event()

    def held(text, *args, **kwargs):
        if text.startswith("held"):
            entered.release()
            release.wait()
        return encode(text, *args, **kwargs)
    monkeypatch.setattr(tok, "encode", held)
    with ThreadPoolExecutor(6) as pool:
        try:
            calls = [pool.submit(httpx.post, f"{url}/tokenize", json={"prompt": f"held {i}"}, headers=AUTH, timeout=120)
                     for i in range(6)]
            for _ in range(UTILITY_TOKENIZER_THREADS):
                assert entered.acquire(timeout=120), "the /tokenize calls never reached the tokenizer"
            r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "a b c", "max_tokens": 2},
                           headers=AUTH, timeout=120)
            assert r.status_code == 200 and not any(call.done() for call in calls)
        finally:
            release.set()
        assert all(call.result().status_code == 200 for call in calls)


def test_a_large_body_is_parsed_off_the_event_loop(served, url, monkeypatch):
    """A body of megabytes of token ids is parsed in a worker thread: /health is answered while it is parsed (its
    JSON decoding held here until then)."""
    loads, parsing, release = json.loads, threading.Event(), threading.Event()

    def held(text, *args, **kwargs):
        if len(text) > PARSE_OFF_LOOP_BYTES:
            parsing.set()
            release.wait()
        return loads(text, *args, **kwargs)
    monkeypatch.setattr(json, "loads", held)
    big = {"model": MODEL, "prompt": list(range(300)) * 1000, "max_tokens": 1}
    assert len(json.dumps(big)) > PARSE_OFF_LOOP_BYTES
    with ThreadPoolExecutor(1) as pool:
        try:
            call = pool.submit(httpx.post, f"{url}/v1/completions", json=big, headers=AUTH, timeout=120)
            assert parsing.wait(timeout=120), "the body was never parsed"
            assert httpx.get(f"{url}/health", timeout=120).status_code == 200 and not call.done()
        finally:
            release.set()
        r = call.result()
    assert r.status_code == 400 and "max_model_len" in r.json()["error"]["message"]


@pytest.mark.parametrize("field, value, cap", [
    ("stop_token_ids", list(range(200_000)), "128"), ("stop_token_ids", list(range(129)), "128"),
    ("logit_bias", {str(t): 1.0 for t in range(1025)}, "1024"), ("allowed_token_ids", list(range(1025)), "1024"),
    ("bad_words", [f"w{i}" for i in range(129)], "128"), ("stop", ["a", "b", "c", "d", "e"], "4"),
])
def test_a_request_s_lists_past_vllm_s_caps_are_refused_naming_the_field(url, field, value, cap):
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "a", field: value}, headers=AUTH,
                   timeout=60)
    error = openai_error(r.content, 400)
    assert r.status_code == 400 and error["param"] == field and field in error["message"] and cap in error["message"]


@pytest.mark.parametrize("body, param, limit", [
    ({"prompt": ["a", "b", "c", "d"], "n": 9}, "n", "--max-request-sequences"),          # 36 sequences
    ({"prompt": ["a", "b"], "n": 8, "max_tokens": 120}, "max_tokens", "--max-request-tokens"),     # 1,920
])
def test_the_work_of_one_request_is_capped(url, body, param, limit):
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, **body}, headers=AUTH, timeout=60)
    error = openai_error(r.content, 400)
    assert r.status_code == 400 and error["param"] == param and limit in error["message"]
    chat = {"messages": [{"role": "user", "content": "hi"}], "n": 16}     # no max_tokens: what max_model_len leaves
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, **chat}, headers=AUTH, timeout=60)
    assert r.status_code == 400 and openai_error(r.content, 400)["param"] == "max_tokens"


def test_json_bodies_are_not_encoded_item_by_item_on_the_event_loop(in_thread, monkeypatch):
    """FastAPI encodes a returned dict by visiting every item (jsonable_encoder) on the event loop:
    the million token ids of a long /tokenize held every other request for a second. The endpoints
    return finished responses, which FastAPI passes through."""
    def item_by_item(*args, **kwargs):
        raise AssertionError("FastAPI encoded a response item by item")
    monkeypatch.setattr(fastapi.routing, "serialize_response", item_by_item)
    base = f"http://127.0.0.1:{in_thread[1].port}"
    for path, body in (("/tokenize", {"prompt": "hello"}), ("/detokenize", {"tokens": [5, 6]}),
                       ("/v1/completions", {"prompt": "a", "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})):
        r = httpx.post(f"{base}{path}", json=body, timeout=60)
        assert r.status_code == 200, (path, r.text)


def test_a_prompt_that_cannot_fit_is_refused_before_it_is_tokenized(url):
    messages = [{"role": "user", "content": "y" * 200_000}]
    for path, body in (("/v1/completions", {"prompt": "y" * 200_000}), ("/v1/chat/completions", {"messages": messages}),
                       ("/tokenize", {"prompt": "y" * 200_000}), ("/tokenize", {"messages": messages})):
        r = httpx.post(f"{url}{path}", json={"model": MODEL, **body}, headers=AUTH, timeout=60)
        assert r.status_code == 400
        message = r.json()["error"]["message"]
        assert "characters" in message and "max_model_len 128" in message


def test_a_request_head_that_never_completes_is_timed_out(served):
    for partial in (b"", b"POST /v1/completions HTTP/1.1\r\nHost: test\r\n"):
        with connect(served.port) as sock:
            sock.sendall(partial)
            status, headers, body = read_response(sock)
            assert status == 408 and headers["connection"] == "close"
            assert "--request-read-timeout" in openai_error(body, 408)["message"]
            assert closed(sock)


def test_a_request_body_that_never_completes_is_timed_out(served):
    with connect(served.port) as sock:
        head = request("POST", "/v1/completions", b"", {**AUTH, "Content-Type": "application/json"})
        sock.sendall(head.replace(b"Content-Length: 0", b"Content-Length: 100") + b'{"prompt": ')
        status, headers, body = read_response(sock)
        assert status == 408 and headers["connection"] == "close"
        assert "body" in openai_error(body, 408)["message"]
        assert closed(sock)


def test_a_request_head_past_the_size_limit_is_refused(served):
    many_headers = "".join(f"X-Header-{i}: {'v' * 20}\r\n" for i in range(MAX_HEAD_BYTES // 16))
    with connect(served.port) as sock:
        sock.sendall(f"GET /health HTTP/1.1\r\nHost: test\r\n{many_headers}\r\n".encode())
        status, headers, body = read_response(sock)
        assert status == 431 and headers["connection"] == "close"
        assert str(MAX_HEAD_BYTES) in openai_error(body, 431)["message"]
    # a small head and a large body in one write: only the head counts
    body = json.dumps({"tokens": [5] * (2 * MAX_HEAD_BYTES)}).encode()
    with connect(served.port) as sock:
        sock.sendall(request("POST", "/detokenize", body, {**AUTH, "Content-Type": "application/json"}))
        assert read_response(sock)[0] == 200


def test_connections_past_the_limit_are_refused_at_once(in_thread):
    _, server = in_thread
    with connect(server.port), connect(server.port), connect(server.port) as third:   # two idle, holding both places
        status, _, body = read_response(third)
        assert status == 503 and "--max-connections" in openai_error(body, 503)["message"]
        assert closed(third)
    # the places are free again once those close

    def served_again():
        with connect(server.port) as sock:
            sock.sendall(request("GET", "/health"))
            return read_response(sock)[0] == 200
    wait_for(served_again, "a new connection is served")


@pytest.mark.parametrize("body, limit", [
    ({"prompt": ["a", "b", "c", "d", "e"]}, "--max-completion-prompts"),
    ({"prompt": "a", "n": 17}, "--max-n-sequences"),
    ({"prompt": "a", "n": 16, "max_tokens": 100}, "KV cache"),
])
def test_over_large_asks_are_refused_naming_the_limit(url, body, limit):
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, **body}, headers=AUTH, timeout=60)
    assert r.status_code == 400 and limit in r.json()["error"]["message"]


# ---- client mistakes are 4xx, in OpenAI's shape ----------------------------------------

@pytest.mark.parametrize("path, body", [
    ("/v1/completions", b'{"prompt": "a\\ud800"}'),
    ("/v1/completions", b'{"prompt": ["ok", "a\\udfff"]}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud800"}]}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}'),
    ("/tokenize", b'{"prompt": "a\\ud800"}'),
])
def test_a_lone_surrogate_is_a_400(url, path, body):
    r = httpx.post(f"{url}{path}", content=body, headers={**AUTH, "Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 400 and "surrogate" in openai_error(r.content, 400)["message"]


@pytest.mark.parametrize("method, path, body, status", [
    ("POST", "/v1/completions", b'{"prompt": "\xff\xfe"}', 400),       # not UTF-8
    ("POST", "/v1/completions", b'{"prompt": "x",, }', 400),
    ("GET", "/v1/nothing-here", b"", 404),
    ("GET", "/v1/completions", b"", 405),
])
def test_every_error_has_openai_s_shape(url, method, path, body, status):
    r = httpx.request(method, f"{url}{path}", content=body, headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == status
    error = openai_error(r.content, status)
    assert error["param"] is None                 # a byte offset into bad JSON is no field


@pytest.mark.parametrize("body, content_type, text", [
    (b'{"prompt": "\xff\xfe"}', "application/json", "not valid UTF-8"),
    (b"[" * 50_000 + b"]" * 50_000, "application/json", "RecursionError"),
    (b'{"prompt": "a", "max_tokens": ' + b"9" * 5000 + b"}", "application/json", "digits"),
    (b"", "application/json", "no body"),
    (b"[1, 2]", "application/json", "a JSON object, not an array"),
    (b"null", "application/json", "a JSON object, not null"),
    (b'{"prompt": "a"}', "application/x-www-form-urlencoded", "Content-Type: application/json"),
], ids=["not-utf8", "too-deep", "long-number", "empty", "array", "null", "form-encoded"])
def test_a_body_that_is_no_json_object_says_why(url, body, content_type, text):
    r = httpx.post(f"{url}/v1/completions", content=body, headers={**AUTH, "Content-Type": content_type})
    error = openai_error(r.content, 400)
    assert r.status_code == 400 and text in error["message"] and error["param"] is None


def test_an_unexpected_error_is_a_json_500_logged_on_a_connection_that_stays_open(in_thread, monkeypatch, caplog):
    engine, server = in_thread

    def broken(*args, **kwargs):
        raise KeyError("a bug")
    monkeypatch.setattr(engine.tokenizer, "encode", broken)
    with connect(server.port) as sock:
        sock.sendall(request("POST", "/tokenize", b'{"prompt": "x"}', {"Content-Type": "application/json"}))
        status, headers, body = read_response(sock)
        assert status == 500 and "KeyError" in openai_error(body, 500)["message"]
        assert headers.get("connection") != "close"
        sock.sendall(request("GET", "/health"))          # the same connection serves the next request
        assert read_response(sock)[0] == 200
    logged = [r for r in caplog.records if r.levelno == logging.ERROR and r.exc_info]
    assert logged and logged[0].exc_info[0] is KeyError


@pytest.mark.parametrize("field, value", [
    ("n", True), ("n", 2.0), ("max_tokens", "5"), ("max_tokens", 4.0), ("logprobs", True), ("top_k", 1.0),
    ("seed", True), ("stop_token_ids", [True]), ("prompt", [1, True]), ("prompt", [[1.0]]), ("stream", 1),
    ("temperature", "0.5"), ("ignore_eos", "yes"),
])
def test_no_bool_float_or_string_passes_for_an_int(url, field, value):
    body = {"model": MODEL, "prompt": [5, 6], "max_tokens": 2, field: value}
    r = httpx.post(f"{url}/v1/completions", json=body, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"].startswith(field)


def test_detokenize_takes_only_int_token_ids(url):
    r = httpx.post(f"{url}/detokenize", json={"tokens": [5, True]}, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("tokens")


# ---- the key, before anything else -----------------------------------------------------

@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer sk-tesT"}, {"Authorization": KEY}])
def test_without_the_key_a_request_is_a_401_before_its_body_is_read(served, headers):
    bad_json = request("POST", "/v1/completions", b"{not json", {**headers, "Content-Type": "application/json"})
    # a head that declares a body over the limit, and no body: the key is checked first
    over_limit = request("POST", "/v1/completions", b"", headers).replace(b"Content-Length: 0",
                                                                         b"Content-Length: %d" % (3 * 2**20))
    for data in (bad_json, over_limit):
        with connect(served.port) as sock:
            sock.sendall(data)
            status, _, reply = read_response(sock)
            assert status == 401 and openai_error(reply, 401)["type"] == "authentication_error"


def test_the_key_guards_every_path_but_health(url):
    for path in ("/metrics", "/v1/models", "/tokenize", "/v1/nothing-here"):
        assert httpx.get(f"{url}{path}").status_code == 401
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/metrics", headers=AUTH).status_code == 200


def test_the_api_docs_are_off_unless_asked_for(url, ckpt):
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(f"{url}{path}", headers=AUTH).status_code == 404
    engine = LLMEngine(EngineConfig(model=str(ckpt), **ENGINE_ARGS))
    with ServerThread(build_app(engine, MODEL, ServerConfig(enable_docs=True))) as base:
        schema = httpx.get(f"{base}/openapi.json").json()
        assert schema["info"]["title"] == "kvserve"
        # the bodies the endpoints parse themselves are documented as FastAPI documents a body parameter
        for path, field in (("/v1/completions", "prompt"), ("/v1/chat/completions", "messages"),
                            ("/tokenize", "add_special_tokens"), ("/detokenize", "tokens")):
            ref = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
            assert field in schema["components"]["schemas"][ref.rsplit("/", 1)[1]]["properties"]
        assert "ChatMessage" in schema["components"]["schemas"]
