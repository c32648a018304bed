"""The HTTP edge: what stands between a client and the endpoints.

- ServerProtocol (uvicorn's httptools protocol): a connection whose request head is not complete
  within the read timeout gets a 408 and is closed, one whose head grows past MAX_HEAD_BYTES a 431;
  past the connection limit, a new connection gets a 503 and is closed at once, so that idle, slow
  or bloated clients cannot hold every socket, nor the server's memory.
- ASGI middleware, outermost first: UnexpectedErrors (any exception a 500 in OpenAI's shape, the
  connection kept), APIKeyCheck (401 before the body is read), RequestBody (the whole body read
  before the app sees it: 413 past the size limit, 408 past the read timeout).
- parse_body: a JSON body read into its request model, as FastAPI would, but a large one in a worker thread.
"""
from __future__ import annotations

import asyncio
import email.message
import functools
import hmac
import json
import logging
from typing import TypeVar

import uvicorn
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from kvserve.server.errors import APIError, error_body, send_error

log = logging.getLogger(__name__)

# A body past this many bytes is parsed and validated in a worker thread: megabytes of token ids take the
# interpreter for a second, which on the event loop every other request (/health too) would wait for.
PARSE_OFF_LOOP_BYTES = 64 * 2**10
M = TypeVar("M", bound=BaseModel)


# The most bytes a request's line and headers may take. uvicorn's httptools protocol sets no limit,
# and keeps every header it parses as Python objects, many times their size: megabytes of headers,
# sent before any key is checked, would take the server's memory. (Node allows 16 KiB, nginx 32 KiB.)
MAX_HEAD_BYTES = 64 * 2**10


class ServerProtocol(HttpToolsProtocol):
    """uvicorn's HTTP/1.1 protocol with a deadline and a size limit on each request head, and a limit
    on connections."""

    def __init__(self, *args, read_timeout: float, max_connections: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.read_timeout, self.max_connections = read_timeout, max_connections
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_bytes = 0              # of the head being read, as of the data before this chunk

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            self._refuse(APIError(503, f"the server has {self.max_connections} connections open, its limit "
                                       f"(--max-connections); retry later"))
        else:
            self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        # a head still incomplete once this chunk is parsed: the chunk was head (counted after the
        # parse, so that a small head and the body that follows it in one chunk count as nothing)
        if self._head_timer is not None and not self.transport.is_closing():
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self._refuse(APIError(431, f"the request line and headers are over {MAX_HEAD_BYTES} bytes"))

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_bytes = 0
        self._arm_head_timer()           # each request of a kept-alive connection gets its own deadline

    def on_headers_complete(self) -> None:
        self._cancel_head_timer()
        super().on_headers_complete()

    def connection_lost(self, exc) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.read_timeout, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        self._refuse(APIError(408, f"the request head did not arrive within {self.read_timeout:g} s "
                                   f"(--request-read-timeout)"))

    def _refuse(self, error: APIError) -> None:
        """Answer with `error` in place of a request, and close (mid-response, only close)."""
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self.transport.close()
            return
        body = error_body(error.status, error.message, error.param, error.kind)
        self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                             b"connection: close\r\n\r\n%s" % (error.status, _REASONS[error.status], len(body), body))
        self.transport.close()


_REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large", 503: b"Service Unavailable"}


def uvicorn_config(app, host: str, port: int, read_timeout: float, max_connections: int,
                   log_level: str = "info") -> uvicorn.Config:
    """uvicorn's Config for the app, with ServerProtocol as its HTTP protocol."""
    protocol = functools.partial(ServerProtocol, read_timeout=read_timeout, max_connections=max_connections)
    return uvicorn.Config(app, host=host, port=port, http=protocol, log_level=log_level,
                          timeout_graceful_shutdown=10)


class UnexpectedErrors:
    """ASGI middleware: an exception no handler expected is logged with its traceback and answered
    with a 500 in OpenAI's shape, on a connection that stays open (uvicorn's own answer is plain
    text and closes it)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracked(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as e:
            if started:         # too late for a response of its own: uvicorn logs it and closes
                raise
            log.exception("unexpected error answering %s %s", scope["method"], scope["path"])
            await send_error(scope, receive, send, APIError(500, f"internal server error: {type(e).__name__}: {e}"))


class APIKeyCheck:
    """ASGI middleware: every path but `open_paths` needs 'Authorization: Bearer KEY'; a request
    without it gets a 401 before its body is read."""

    def __init__(self, app, api_key: str, open_paths: frozenset[str] = frozenset({"/health"})):
        self.app, self.expected, self.open_paths = app, f"Bearer {api_key}".encode(), open_paths

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            # constant time: how much of a guess matches must not show in how long it takes to refuse
            if not hmac.compare_digest(given, self.expected):
                error = APIError(401, "invalid or missing API key (Authorization: Bearer KEY)")
                return await send_error(scope, receive, send, error, close=True)
        return await self.app(scope, receive, send)


class RequestBody:
    """ASGI middleware: reads a request's whole body before the app runs, then hands it over in one
    message. 413 for a body over `max_bytes` (declared or streamed); 408 for a body not complete
    `timeout` seconds after the request's head."""

    def __init__(self, app, max_bytes: int, timeout: float):
        self.app, self.max_bytes, self.timeout = app, max_bytes, timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if declared is not None and int(declared) > self.max_bytes:
            return await send_error(scope, receive, send, self._too_large(), close=True)
        try:
            first = await self._read(receive)
        except APIError as e:
            return await send_error(scope, receive, send, e, close=True)
        replay = iter([first])

        async def replayed():
            return next(replay, None) or await receive()

        return await self.app(scope, replayed, send)

    async def _read(self, receive) -> dict:
        """The body as one http.request message (or the disconnect that came first)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        chunks, size = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                raise APIError(408, f"the request body did not arrive within {self.timeout:g} s "
                                    f"(--request-read-timeout)") from None
            if message["type"] != "http.request":
                return message
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                raise self._too_large()
            if not message.get("more_body"):
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

    def _too_large(self) -> APIError:
        return APIError(413, f"request body over {self.max_bytes} bytes (--max-body-bytes)")


async def parse_body(request: Request, model: type[M]) -> M:
    """The request's JSON body as `model`, with FastAPI's errors for a body parameter (RequestValidationError,
    HTTPException: the app's handlers answer them); a body over PARSE_OFF_LOOP_BYTES off the event loop."""
    body = await request.body()
    content_type = request.headers.get("content-type")
    if len(body) > PARSE_OFF_LOOP_BYTES:
        return await asyncio.to_thread(_parse, body, content_type, model)
    return _parse(body, content_type, model)


def _parse(body: bytes, content_type: str | None, model: type[M]) -> M:
    if not body:
        raise RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}])
    value = body                     # a body not sent as JSON stays bytes, which no model takes
    if _is_json(content_type):
        try:
            value = json.loads(body)
        except json.JSONDecodeError as e:
            raise RequestValidationError([{"type": "json_invalid", "loc": ("body", e.pos), "msg": "JSON decode error",
                                           "input": {}, "ctx": {"error": e.msg}}], body=e.doc) from e
        except Exception as e:      # invalid UTF-8, nesting too deep: the cause says which
            raise HTTPException(400, "There was an error parsing the body") from e
    try:
        return model.model_validate(value)
    except ValidationError as e:
        errors = [{**error, "loc": ("body", *error["loc"])} for error in e.errors()]
        raise RequestValidationError(errors, body=value) from None


def _is_json(content_type: str | None) -> bool:
    """Whether FastAPI reads a body of this Content-Type as JSON (application/json or +json; none is not)."""
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))
