"""The OpenAI-compatible HTTP server: completions, chat, streaming, metrics."""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvserve.config import EngineConfig
from kvserve.engine.engine import LLMEngine
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.server.async_engine import AsyncEngine, QueueFullError
from kvserve.server.metrics import ServerMetrics
from kvserve.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                     TokenizeRequest)

DEFAULT_MAX_BODY_BYTES = 8 * 2**20


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def error_response(status: int, message: str, kind: str = "invalid_request_error", param=None) -> JSONResponse:
    """OpenAI's error shape."""
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status)


class BodyLimit:
    """ASGI middleware: 413 for request bodies over `max_bytes`, declared or streamed."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            if int(declared) > self.max_bytes:
                return await self._too_large(scope, receive, send)
            return await self.app(scope, receive, send)
        # No declared length (chunked): read the body here, up to the limit, then replay it.
        messages, size = [], 0
        while True:
            message = await receive()
            messages.append(message)
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                return await self._too_large(scope, receive, send)
            if message["type"] != "http.request" or not message.get("more_body"):
                break
        replay = iter(messages)

        async def replayed():
            return next(replay, None) or await receive()

        return await self.app(scope, replayed, send)

    async def _too_large(self, scope, receive, send):
        return await error_response(413, f"request body over {self.max_bytes} bytes")(scope, receive, send)


def build_app(engine: LLMEngine | EngineConfig, model_name: str, api_key: str | None = None,
              max_queue: int | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """The app over an engine: built here in a process of its own from an EngineConfig (what
    `kvserve serve` does), or an LLMEngine object stepped in a thread."""
    server = AsyncEngine(engine, max_queue)
    metrics = server.metrics = ServerMetrics(server.stats, model_name)

    @asynccontextmanager
    async def lifespan(_app):
        server.start()
        yield
        await asyncio.to_thread(server.shutdown)

    app = FastAPI(title="kvserve", lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    app.state.async_engine = server
    _add_error_handlers(app)
    auth = Depends(_auth_check(api_key))
    handlers = _Handlers(server, model_name)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=503 if server.dead else 200)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", dependencies=[auth])
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "kvserve",
                                            "max_model_len": server.engine.max_model_len}]}

    app.post("/v1/completions", dependencies=[auth])(handlers.completions)
    app.post("/v1/chat/completions", dependencies=[auth])(handlers.chat)
    app.post("/tokenize", dependencies=[auth])(handlers.tokenize)
    app.post("/detokenize", dependencies=[auth])(handlers.detokenize)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_req, e: APIError):
        return error_response(e.status, e.message, e.kind, e.param)

    @app.exception_handler(RequestValidationError)
    async def invalid(_req, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        message = f"{where}: {first.get('msg', 'invalid request')}" if where else first.get("msg", "invalid request")
        return error_response(400, message, param=where)

    @app.exception_handler(QueueFullError)
    async def full(_req, e: QueueFullError):
        return error_response(429, str(e), "rate_limit_error")

    @app.exception_handler(ValueError)
    async def bad_value(_req, e: ValueError):
        return error_response(400, str(e))

    @app.exception_handler(RuntimeError)
    async def engine_failure(_req, e: RuntimeError):
        # the engine failed while running the request (it serves on), or the server is shutting down
        return error_response(500, str(e), "internal_error")


def _auth_check(api_key: str | None):
    async def check(request: Request) -> None:
        if api_key is not None and request.headers.get("authorization") != f"Bearer {api_key}":
            raise APIError(401, "invalid or missing API key", "authentication_error")
    return check


class _Handlers:
    """The endpoints that run requests through the engine."""

    def __init__(self, server: AsyncEngine, model_name: str):
        self.server = server
        self.engine = server.engine
        self.model_name = model_name

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model `{model}` does not exist; this server serves `{self.model_name}`",
                           "not_found_error", "model")

    async def completions(self, req: CompletionRequest, raw: Request):
        self._check_model(req.model)
        params = req.sampling_params(16, req.logprobs)
        rid = f"cmpl-{uuid.uuid4().hex}"
        streams = await self._submit(rid, req.prompts(), params, req.cache_salt)
        fmt = _CompletionFormat(rid, self.model_name, self.engine.tokenizer, req.logprobs or 0)
        return await self._respond(req, raw, streams, fmt, params)

    async def chat(self, req: ChatCompletionRequest, raw: Request):
        self._check_model(req.model)
        tok = self.engine.tokenizer
        text = self._render_chat(req.messages, req.add_generation_prompt)
        prompt = {"prompt": text, "prompt_token_ids": tok.encode(text, add_special_tokens=False)}
        top = req.top_logprobs or 0
        params = req.sampling_params(None, top if req.logprobs else None)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        streams = await self._submit(rid, [prompt], params, req.cache_salt)
        fmt = _ChatFormat(rid, self.model_name, tok, top)
        return await self._respond(req, raw, streams, fmt, params)

    def _render_chat(self, messages, add_generation_prompt: bool) -> str:
        tok = self.engine.tokenizer
        if not tok.chat_template:
            raise APIError(400, "this model has no chat template; use /v1/completions")
        try:
            return tok.apply_chat_template([m.model_dump(exclude_none=True) for m in messages], tokenize=False,
                                           add_generation_prompt=add_generation_prompt)
        except Exception as e:  # noqa: BLE001
            # a template error (jinja's raise_exception, say) is the request's fault
            raise APIError(400, f"cannot apply the chat template: {e}", param="messages") from None

    async def tokenize(self, req: TokenizeRequest):
        self._check_model(req.model)
        tok = self.engine.tokenizer
        if req.messages is not None:
            tokens = tok.encode(self._render_chat(req.messages, True), add_special_tokens=False)
        else:
            tokens = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": self.engine.max_model_len}

    async def detokenize(self, req: DetokenizeRequest):
        self._check_model(req.model)
        vocab = self.engine.model_config.vocab_size
        if any(not 0 <= t < vocab for t in req.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
        return {"prompt": self.engine.tokenizer.decode(req.tokens)}

    async def _submit(self, rid: str, prompts: list, params, cache_salt) -> list[AsyncIterator[RequestOutput]]:
        streams = []
        try:
            for i, prompt in enumerate(prompts):
                streams.append(await self.server.submit(f"{rid}-{i}", prompt, params, cache_salt))
        except BaseException:
            for i in range(len(streams)):
                self.server.abort(f"{rid}-{i}")
            raise
        return streams

    async def _respond(self, req, raw: Request, streams, fmt, params):
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        if req.stream:
            # Text that may be the start of a stop string waits until it cannot be.
            hold = max((len(s) for s in params.stop), default=1) - 1
            return StreamingResponse(_sse(fmt, _merge(streams), include_usage, hold),
                                     media_type="text/event-stream")
        finals = await _until_disconnect(raw, _last_outputs(streams))
        return fmt.response(finals)


async def _merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave the outputs of several requests as they come; cancelling aborts them all."""
    if len(streams) == 1:       # the common case, without a task and a queue between stream and response
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            await streams[0].aclose()    # a disconnect aborts the request now
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, stream):
        try:
            async for out in stream:
                await queue.put((i, out))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        done = 0
        while done < len(tasks):
            i, out = await queue.get()
            if out is None:
                done += 1
            else:
                yield i, out
        for t in tasks:
            t.result()     # re-raise an engine failure
    finally:
        for t in tasks:
            t.cancel()


async def _last_outputs(streams) -> list[RequestOutput]:
    last: dict[int, RequestOutput] = {}
    async for i, out in _merge(streams):
        last[i] = out
    return [last[i] for i in range(len(streams))]


async def _until_disconnect(raw: Request, coro):
    """Run coro; cancel it (aborting its requests) if the client goes away first."""
    task = asyncio.create_task(coro)
    while not task.done():
        done, _ = await asyncio.wait({task}, timeout=0.5)
        if not done and await raw.is_disconnected():
            task.cancel()
            raise APIError(499, "client disconnected")
    return task.result()


async def _sse(fmt, merged: AsyncIterator[tuple[int, RequestOutput]], include_usage: bool, hold: int):
    sent: dict[tuple[int, int], tuple[int, int]] = {}    # (prompt, sample) -> (chars, tokens) streamed
    finals: dict[int, RequestOutput] = {}
    try:
        async for i, out in merged:
            finals[i] = out
            for c in out.outputs:
                chars, tokens = sent.get((i, c.index), (0, 0))
                if len(c.token_ids) == tokens:
                    continue
                end = len(c.text) if c.finished else max(chars, len(c.text) - hold)
                sent[(i, c.index)] = (end, len(c.token_ids))
                yield _event(fmt.chunk(i, out, c, chars, end, tokens, first=tokens == 0))
        if include_usage:
            yield _event(fmt.usage_chunk([finals[i] for i in sorted(finals)]))
        yield "data: [DONE]\n\n"
    except Exception as e:  # noqa: BLE001
        # the status is sent: report the failure in the stream
        yield _event({"error": {"message": str(e), "type": "internal_error", "code": 500}})
    finally:
        await merged.aclose()      # a disconnect aborts the requests now, not at garbage collection


def _event(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


class _Format:
    """Shapes engine outputs into one endpoint's OpenAI responses."""

    object_name = chunk_object = ""

    def __init__(self, rid: str, model_name: str, tokenizer):
        self.rid, self.model, self.tokenizer, self.created = rid, model_name, tokenizer, int(time.time())

    def _envelope(self, object_name: str, choices: list, usage=None) -> dict:
        body = {"id": self.rid, "object": object_name, "created": self.created, "model": self.model,
                "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return body

    @staticmethod
    def usage(finals: list[RequestOutput]) -> dict:
        prompt = sum(len(f.prompt_token_ids) for f in finals)
        completion = sum(len(c.token_ids) for f in finals for c in f.outputs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(f.num_cached_tokens for f in finals)}}

    def usage_chunk(self, finals: list[RequestOutput]) -> dict:
        return self._envelope(self.chunk_object, [], self.usage(finals))

    @staticmethod
    def choice_index(i: int, c: CompletionOutput, out: RequestOutput) -> int:
        return i * len(out.outputs) + c.index

    @staticmethod
    def _top(entry) -> list:
        return sorted(entry.items(), key=lambda kv: kv[1].rank)


class _CompletionFormat(_Format):
    object_name = chunk_object = "text_completion"

    def __init__(self, rid, model_name, tokenizer, top_logprobs: int):
        super().__init__(rid, model_name, tokenizer)
        self.top_logprobs = top_logprobs

    def response(self, finals: list[RequestOutput]) -> dict:
        choices = [{"index": self.choice_index(i, c, f), "text": c.text, "logprobs": self._logprobs(c, 0, 0),
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                   for i, f in enumerate(finals) for c in f.outputs]
        return self._envelope(self.object_name, choices, self.usage(finals))

    def chunk(self, i, out, c, chars, end, tokens, first) -> dict:
        choice = {"index": self.choice_index(i, c, out), "text": c.text[chars:end],
                  "logprobs": self._logprobs(c, tokens, chars), "finish_reason": c.finish_reason}
        return self._envelope(self.object_name, [choice])

    def _logprobs(self, c: CompletionOutput, start: int, offset: int) -> dict | None:
        if c.logprobs is None:
            return None
        entries = [(t, e) for t, e in zip(c.token_ids[start:], c.logprobs[start:])]
        tokens = [e[t].decoded_token for t, e in entries]
        offsets = []
        for s in tokens:
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": [e[t].logprob for t, e in entries], "text_offset": offsets,
                "top_logprobs": [self._by_text(self._top(e)[:self.top_logprobs]) for _, e in entries]}

    @staticmethod
    def _by_text(ranked) -> dict[str, float]:
        """Legacy top_logprobs are keyed by text; tokens that decode alike keep the likeliest."""
        out: dict[str, float] = {}
        for _, lp in ranked:
            out.setdefault(lp.decoded_token, lp.logprob)
        return out


class _ChatFormat(_Format):
    object_name, chunk_object = "chat.completion", "chat.completion.chunk"

    def __init__(self, rid, model_name, tokenizer, top_logprobs: int):
        super().__init__(rid, model_name, tokenizer)
        self.top_logprobs = top_logprobs

    def response(self, finals: list[RequestOutput]) -> dict:
        (f,) = finals
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": self._logprobs(c, 0), "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                   for c in f.outputs]
        return self._envelope(self.object_name, choices, self.usage(finals))

    def chunk(self, i, out, c, chars, end, tokens, first) -> dict:
        delta = {"content": c.text[chars:end]}
        if first:
            delta = {"role": "assistant", **delta}
        choice = {"index": c.index, "delta": delta, "logprobs": self._logprobs(c, tokens),
                  "finish_reason": c.finish_reason}
        return self._envelope(self.chunk_object, [choice])

    def _logprobs(self, c: CompletionOutput, start: int) -> dict | None:
        if c.logprobs is None:
            return None

        def item(lp):
            return {"token": lp.decoded_token, "logprob": lp.logprob, "bytes": list(lp.decoded_token.encode())}

        return {"content": [{**item(e[t]), "top_logprobs": [item(lp) for _, lp in self._top(e)[:self.top_logprobs]]}
                            for t, e in zip(c.token_ids[start:], c.logprobs[start:])]}
