"""The OpenAI-compatible HTTP server: completions, chat, tokenize, streaming, metrics."""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from kvserve.config import EngineConfig, ServerConfig
from kvserve.engine.engine import LLMEngine
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.sampling import SamplingParams
from kvserve.structured import StructuredOutputsParams
from kvserve.server.async_engine import AsyncEngine, EngineError, EngineUnavailableError, QueueFullError
from kvserve.server.dashboard import KVStateView, add_dashboard_routes
from kvserve.server.errors import APIError, error_response, field_error
from kvserve.server.http import APIKeyCheck, RequestBody, UnexpectedErrors, parse_body
from kvserve.server.metrics import ServerMetrics
from kvserve.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
                                     tool_dicts)
from kvserve.server.tokenization import ServerTokenizer
from kvserve.server.tool_calls import (AutoToolCalls, NamedToolCall, NoToolCalls, RequiredToolCalls, ToolCalls,
                                       ToolCallStream)

DEFAULT_COMPLETION_MAX_TOKENS = 16      # OpenAI's and vLLM's default for /v1/completions


def build_app(engine: LLMEngine | EngineConfig, model_name: str, config: ServerConfig | None = None) -> FastAPI:
    """The app over an engine: built here in a process of its own from an EngineConfig (what
    `kvserve serve` does), or an LLMEngine object stepped in a thread."""
    config = config or ServerConfig()
    server = AsyncEngine(engine, config.max_queue, start_attempts=config.engine_start_attempts)
    metrics = server.metrics = ServerMetrics(server.stats, model_name)
    tokenizer = ServerTokenizer(server.engine.tokenizer, server.engine.max_model_len, config.chat_template,
                                config.tool_call_parser)
    utility = tokenizer.utility()

    @asynccontextmanager
    async def lifespan(_app):
        server.start()
        yield
        await asyncio.to_thread(server.shutdown)
        tokenizer.close()
        utility.close()

    docs = {} if config.enable_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="kvserve", lifespan=lifespan, **docs)
    # the last added runs first: unexpected errors caught around everything, the key checked before the body is read
    app.add_middleware(RequestBody, max_bytes=config.max_body_bytes, timeout=config.request_read_timeout)
    if config.api_key is not None:
        # the dashboard's page holds no data (server/dashboard.py): its state needs the key
        app.add_middleware(APIKeyCheck, api_key=config.api_key, open_paths=frozenset({"/health", "/dashboard"}))
    app.add_middleware(UnexpectedErrors)
    app.state.async_engine = server
    _add_error_handlers(app)
    handlers = _Handlers(server, tokenizer, utility, model_name, config)

    @app.get("/health")
    async def health() -> Response:
        if server.dead is not None:
            return error_response(APIError(503, f"the engine is not running: {server.dead}"))
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "kvserve",
                                            "max_model_len": server.engine.max_model_len}]}

    if config.kv_dashboard:
        add_dashboard_routes(app, KVStateView(server, utility, metrics, model_name,
                                              show_content=config.kv_dashboard_content))
    # the handlers read their bodies themselves (http.parse_body: a large one off the event loop)
    bodies = {"/v1/completions": (handlers.completions, CompletionRequest),
              "/v1/chat/completions": (handlers.chat, ChatCompletionRequest),
              "/tokenize": (handlers.tokenize, TokenizeRequest),
              "/detokenize": (handlers.detokenize, DetokenizeRequest)}
    for path, (handler, _) in bodies.items():
        app.post(path)(handler)
    if config.enable_docs:
        _document_bodies(app, {path: model for path, (_, model) in bodies.items()})
    return app


def _document_bodies(app: FastAPI, bodies: dict) -> None:
    """Put the request models of the endpoints that parse their own bodies into the OpenAPI schema, as FastAPI
    does for a body parameter."""
    generate = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = generate()
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for path, model in bodies.items():
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
                schema["paths"][path]["post"]["requestBody"] = {"required": True, "content": {
                    "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
        return app.openapi_schema

    app.openapi = openapi


def _add_error_handlers(app: FastAPI) -> None:
    """Every error the app answers in OpenAI's shape; anything else is UnexpectedErrors' 500."""
    @app.exception_handler(APIError)
    async def api_error(_req, e: APIError):
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def invalid(_req, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        if first.get("type") == "json_invalid":     # its loc is a byte offset, not a field
            return error_response(APIError(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error')}"))
        if first.get("type") in ("missing", "model_type") and tuple(first.get("loc", ())) == ("body",):
            return error_response(APIError(400, _whole_body_error(first, e.body)))     # no JSON object: no field
        message = first.get("msg", "invalid request").removeprefix("Value error, ")
        field = _param(first.get("loc", ()))
        if field:
            message = f"{field}: {message}"
        # a check of the whole request names the field it refuses in its context (protocol's vLLM fields), if any
        return error_response(APIError(400, message, field or first.get("ctx", {}).get("param")))

    @app.exception_handler(HTTPException)
    async def http_error(_req, e: HTTPException):
        # FastAPI's and Starlette's own: 404, 405, and a body FastAPI cannot parse, whose reason
        # (invalid UTF-8, nesting too deep, a number too long) is the exception's cause
        if e.status_code == 400 and e.__cause__ is not None:
            cause = e.__cause__
            what = "not valid UTF-8" if isinstance(cause, UnicodeDecodeError) else "not JSON kvserve can read"
            return error_response(APIError(400, f"the body is {what}: {type(cause).__name__}: {cause}"))
        return error_response(APIError(e.status_code, str(e.detail)))

    @app.exception_handler(QueueFullError)
    async def full(_req, e: QueueFullError):
        return error_response(APIError(429, str(e)))

    @app.exception_handler(EngineUnavailableError)
    async def unavailable(_req, e: EngineUnavailableError):
        return error_response(APIError(503, str(e)))

    @app.exception_handler(EngineError)
    async def engine_failure(_req, e: EngineError):
        # the engine failed while running the request (it serves on, or is restarted)
        return error_response(APIError(500, str(e)))


_JSON_TYPES = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean",
               type(None): "null"}


def _whole_body_error(error: dict, body) -> str:
    """What is wrong with a body that is no JSON object: none sent, one FastAPI did not read as
    JSON (a Content-Type other than JSON's, as `curl -d` sends), or JSON of another type."""
    if error.get("type") == "missing":
        return "the request has no body: send a JSON object (Content-Type: application/json)"
    if isinstance(body, bytes):
        return "the body was not read as JSON: send it with Content-Type: application/json"
    return f"the body must be a JSON object, not {_JSON_TYPES.get(type(body), type(body).__name__)}"


# the names pydantic gives the members of a union in an error's location
_UNION_MEMBERS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _param(loc: tuple) -> str | None:
    """The request field an error's location names ("messages.0.content"), up to the union member
    pydantic adds to it ("str", "list[ContentPart]", ...)."""
    parts = []
    for part in loc[1:]:                # loc[0] is "body"
        if isinstance(part, str) and (not part.isidentifier() or part in _UNION_MEMBERS):
            break
        parts.append(str(part))
    return ".".join(parts) or None


class _Handlers:
    """The endpoints that run requests through the engine. Each returns its JSON as a Response:
    a plain dict FastAPI would walk item by item (jsonable_encoder) on the event loop, and a million
    token ids (a long /tokenize) or a large batch with logprobs would hold every other request for
    that long."""

    def __init__(self, server: AsyncEngine, tokenizer: ServerTokenizer, utility: ServerTokenizer, model_name: str,
                 config: ServerConfig):
        self.server = server
        self.tokenizer = tokenizer          # the requests' (their prompts, chat templates, echo)
        self.utility = utility              # /tokenize's and /detokenize's, in threads of its own
        self.engine = server.engine
        self.model_name = model_name
        self.config = config
        self.vocab_size = server.engine.model_config.vocab_size

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model `{model}` does not exist; this server serves `{self.model_name}`",
                           "model")

    def _check_fan_out(self, num_prompts: int, n: int) -> None:
        limits = self.config
        if num_prompts > limits.max_completion_prompts:
            raise APIError(400, f"prompt: {num_prompts} prompts in one request, more than the server's limit of "
                                f"{limits.max_completion_prompts} (--max-completion-prompts)", "prompt")
        if n > limits.max_n_sequences:
            raise APIError(400, f"n: {n} samples, more than the server's limit of {limits.max_n_sequences} "
                                f"(--max-n-sequences)", "n")
        if num_prompts * n > limits.max_request_sequences:
            raise APIError(400, f"n: {num_prompts} prompts x n={n} make {num_prompts * n} sequences, more than the "
                                f"server's limit of {limits.max_request_sequences} a request "
                                f"(--max-request-sequences)", "n")

    def _check_work(self, prompts: list[dict], params: SamplingParams, param: str) -> None:
        """A 400 naming `param` (the request's max_tokens field) if the request's sequences may generate more tokens
        together than the server's limit: each up to max_tokens, or what max_model_len leaves after its prompt."""
        room = self.engine.max_model_len
        total = sum(params.n * min(params.max_tokens or room, room - len(p["prompt_token_ids"])) for p in prompts)
        if total > self.config.max_request_tokens:
            raise APIError(400, f"{param}: {len(prompts) * params.n} sequences of up to "
                                f"{params.max_tokens or 'max_model_len'} tokens may generate {total} tokens, more than "
                                f"the server's limit of {self.config.max_request_tokens} a request "
                                f"(--max-request-tokens)", param)

    async def completions(self, raw: Request):
        req = await parse_body(raw, CompletionRequest)
        self._check_model(req.model)
        texts = req.prompts()
        self._check_fan_out(len(texts), req.n)
        constraint, constraint_field = req.structured_outputs_params()
        params = req.sampling_params(req.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS, self.vocab_size, req.logprobs,
                                     prompt_logprobs=req.logprobs if req.echo else None,
                                     structured_outputs=constraint)
        prompts = await asyncio.gather(*(self._prompt(p, True, "prompt", params) for p in texts))
        self._check_work(prompts, params, "max_tokens")
        self._check_kv(prompts, params)
        echo = [await self._echo_text(p) for p in prompts] if req.echo else None
        rid = f"cmpl-{uuid.uuid4().hex}"
        streams = await self._submit(rid, prompts, params, req.cache_salt, constraint_field)
        fmt = _CompletionFormat(rid, self.model_name, self._token_ids_too(req), self.tokenizer.tokenizer,
                                req.logprobs or 0, echo)
        return await self._respond(req, raw, streams, fmt, params)

    async def chat(self, raw: Request):
        req = await parse_body(raw, ChatCompletionRequest)
        self._check_model(req.model)
        self._check_fan_out(1, req.n)
        top = req.top_logprobs or 0
        tools, constraint, constraint_field = self._tool_calls(req)
        params = req.sampling_params(req.max_completion_tokens or req.max_tokens, self.vocab_size,
                                     top if req.logprobs else None, structured_outputs=constraint)
        text = await self.tokenizer.render_chat([m.for_template() for m in req.messages], req.add_generation_prompt,
                                                tool_dicts(req.tools))
        # the template writes the special tokens it wants (a BOS, say): none added
        prompt = await self._prompt(text, False, "messages", params)
        self._check_work([prompt], params, "max_completion_tokens" if req.max_completion_tokens else "max_tokens")
        self._check_kv([prompt], params)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        streams = await self._submit(rid, [prompt], params, req.cache_salt, constraint_field)
        fmt = _ChatFormat(rid, self.model_name, self._token_ids_too(req), top, tools)
        return await self._respond(req, raw, streams, fmt, params)

    def _tool_calls(self, req: ChatCompletionRequest) -> tuple[ToolCalls, StructuredOutputsParams | None, str | None]:
        """How the reply's text becomes content and tool calls, the constraint on it, and the field that asks for
        it: tool_choice "required" or a named function constrain the output to calls (and take no other
        constraint); "auto" parses the calls of the template's format, under the request's own constraint if any."""
        constraint, field = req.structured_outputs_params()
        choice = req.tool_choice_name
        if choice in ("none", "auto"):
            if choice == "none":
                return NoToolCalls(), constraint, field
            parser = self.tokenizer.tool_call_parser
            if parser is None:
                raise APIError(400, 'tool_choice "auto" needs a chat template that writes tool calls in a format '
                                    'kvserve parses (Hermes <tool_call> or Llama 3 JSON), or --tool-call-parser; or '
                                    'use tool_choice "required" or a named function', "tool_choice")
            return AutoToolCalls(parser), constraint, field
        if field is not None:
            raise APIError(400, f"{field}: tool_choice {choice!r} constrains the output to its calls: send no {field}",
                           field)
        tools = RequiredToolCalls() if choice == "required" else NamedToolCall(choice)
        return tools, req.tool_constraint(), "tools"

    async def _echo_text(self, prompt: dict) -> str:
        """The text echo puts before a prompt's completions: the prompt as sent, or its token ids
        decoded; none without a tokenizer, whose outputs are token ids (prompt_token_ids among them)."""
        if prompt["prompt"] is not None:
            return prompt["prompt"]
        if self.tokenizer.tokenizer is None:
            return ""
        return await self.tokenizer.decode(prompt["prompt_token_ids"])

    def _token_ids_too(self, req) -> bool:
        """Token ids in the response: asked for, or the only output there is (no tokenizer, no text)."""
        return req.return_token_ids or self.tokenizer.tokenizer is None

    async def _prompt(self, prompt: str | list[int], add_special_tokens: bool, param: str,
                      params: SamplingParams) -> dict:
        """The engine's prompt (text and token ids), tokenized here, off the event loop: the engine's
        process only ever sees token ids. Its last tokens only with truncate_prompt_tokens (its text is then
        none: the token ids are the prompt)."""
        truncate = params.truncate_prompt_tokens
        if isinstance(prompt, str):
            ids = await self.tokenizer.encode_prompt(prompt, add_special_tokens, param, truncated=truncate is not None)
            text = prompt
        else:
            ids, text = prompt, None
        max_model_len = self.engine.max_model_len
        if not ids:
            raise APIError(400, f"{param}: the prompt is empty (as token ids)", param)
        if truncate is not None:
            keep = max_model_len if truncate == -1 else truncate
            if keep > max_model_len:
                raise APIError(400, f"truncate_prompt_tokens ({truncate}) exceeds max_model_len ({max_model_len})",
                               "truncate_prompt_tokens")
            if len(ids) > keep:
                ids, text = ids[-keep:], None
        if len(ids) >= max_model_len:
            raise APIError(400, f"{param}: the prompt is {len(ids)} tokens; with one to generate it exceeds "
                                f"max_model_len ({max_model_len})", param)
        if text is None and max(ids) >= self.vocab_size:
            raise APIError(400, f"{param}: token id {max(ids)} is out of range [0, {self.vocab_size})", param)
        return {"prompt": text, "prompt_token_ids": ids}

    def _check_kv(self, prompts: list[dict], params: SamplingParams) -> None:
        """n samples of a prompt run together: a 400 if, at their longest, they cannot all be in the
        KV cache at once. (One sample is the engine's to check: its eviction policy counts.)"""
        pool, n = self.server.kv_pool_tokens, params.n
        if n == 1 or not pool:
            return
        max_model_len = self.engine.max_model_len
        for p in prompts:
            prompt_len = len(p["prompt_token_ids"])
            # a sample holds at most max_model_len tokens, whatever its max_tokens and eviction
            sample = min(prompt_len + (params.max_tokens or max_model_len), max_model_len) - prompt_len
            need = prompt_len + n * sample
            if need > pool:
                raise APIError(400, f"n ({n}) samples of up to {sample} tokens each, beside the prompt's "
                                    f"{prompt_len}, need {need} tokens of KV cache; the whole cache holds {pool}: "
                                    f"ask for fewer samples or fewer max_tokens", "n")

    async def tokenize(self, raw: Request):
        """A text's or a conversation's token ids, in the utility threads; as a prompt's, a text that can never
        fit max_model_len is refused before it is encoded."""
        req = await parse_body(raw, TokenizeRequest)
        self._check_model(req.model)
        if req.messages is not None:
            text = await self.utility.render_chat([m.for_template() for m in req.messages], req.add_generation_prompt,
                                                  tool_dicts(req.tools))
            tokens = await self.utility.encode_prompt(text, False, "messages")
        else:
            tokens = await self.utility.encode_prompt(req.prompt, req.add_special_tokens)
        return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": self.engine.max_model_len})

    async def detokenize(self, raw: Request):
        req = await parse_body(raw, DetokenizeRequest)
        self._check_model(req.model)
        if req.tokens and max(req.tokens) >= self.vocab_size:
            raise APIError(400, f"tokens: token ids must be in [0, {self.vocab_size})", "tokens")
        return JSONResponse({"prompt": await self.utility.decode(req.tokens)})

    async def _submit(self, rid: str, prompts: list, params, cache_salt,
                      constraint_field: str | None = None) -> list[AsyncIterator[RequestOutput]]:
        """Each prompt's request, admitted by the engine; a 400 for one it refuses (naming `constraint_field`, the
        request's field the structured outputs came from, for a constraint that does not compile)."""
        streams = []
        try:
            for i, prompt in enumerate(prompts):
                streams.append(await self.server.submit(f"{rid}-{i}", prompt, params, cache_salt))
        except BaseException as e:
            for i in range(len(streams)):
                self.server.abort(f"{rid}-{i}")
            if isinstance(e, ValueError):     # the engine refused the request
                error = field_error(e, vars(params))
                if error.param == "structured_outputs" and constraint_field is not None:
                    error = APIError(400, f"{constraint_field}: {error.message.removeprefix('structured_outputs: ')}",
                                     constraint_field)
                raise error from None
            raise
        return streams

    async def _respond(self, req, raw: Request, streams, fmt, params):
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        if req.stream:
            # Text that may be the start of a stop string waits until it cannot be (kept in the text, it need not).
            hold = 0 if params.include_stop_str_in_output else max((len(s) for s in params.stop), default=1) - 1
            return StreamingResponse(_sse(fmt, _merge(streams), include_usage, hold),
                                     media_type="text/event-stream")
        finals = await _until_disconnect(raw, _last_outputs(streams))
        return JSONResponse(fmt.response(finals))


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
    except Exception as e:  # noqa: BLE001
        # the status is sent: report the failure in the stream, which ends as any other (as vLLM's does)
        yield _event({"error": {"message": str(e), "type": "internal_error", "param": None, "code": 500}})
    finally:
        await merged.aclose()      # a disconnect aborts the requests now, not at garbage collection
    yield "data: [DONE]\n\n"


def _event(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


class _Format:
    """Shapes engine outputs into one endpoint's OpenAI responses."""

    object_name = chunk_object = ""

    def __init__(self, rid: str, model_name: str, token_ids: bool):
        self.rid, self.model, self.created = rid, model_name, int(time.time())
        self.token_ids = token_ids          # the token ids beside the text (return_token_ids)

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

    @staticmethod
    def token_text(token: int, lp) -> str:
        """A token's text in logprobs; vLLM's "token_id:N" where there is none (no tokenizer)."""
        return lp.decoded_token if lp.decoded_token is not None else f"token_id:{token}"


class _CompletionFormat(_Format):
    object_name = chunk_object = "text_completion"

    def __init__(self, rid, model_name, token_ids: bool, tokenizer, top_logprobs: int, echo: list[str] | None):
        super().__init__(rid, model_name, token_ids)
        self.tokenizer, self.top_logprobs = tokenizer, top_logprobs
        self.echo = echo                    # per prompt, its text, put before each of its completions

    def response(self, finals: list[RequestOutput]) -> dict:
        choices = []
        for i, f in enumerate(finals):
            for c in f.outputs:
                choice = self._choice(i, f, c, 0, 0, len(c.text), first=True)
                choice["stop_reason"] = c.stop_reason
                choices.append(choice)
        return self._envelope(self.object_name, choices, self.usage(finals))

    def chunk(self, i, out, c, chars, end, tokens, first) -> dict:
        return self._envelope(self.object_name, [self._choice(i, out, c, chars, tokens, end, first)])

    def _choice(self, i: int, out: RequestOutput, c: CompletionOutput, chars: int, tokens: int, end: int,
                first: bool) -> dict:
        """The choice of completion c from its `tokens`-th token and `chars`-th character on; its
        first chunk starts with the echoed prompt."""
        prefix = self.echo[i] if self.echo is not None else ""
        logprobs = self._logprobs(c.token_ids[tokens:], c.logprobs[tokens:], len(prefix) + chars) \
            if c.logprobs is not None else None
        if first and self.echo is not None and logprobs is not None:
            logprobs = self._join(self._prompt_logprobs(out), logprobs)
        choice = {"index": self.choice_index(i, c, out), "text": (prefix if first else "") + c.text[chars:end],
                  "logprobs": logprobs, "finish_reason": c.finish_reason}
        if self.token_ids:
            if first:
                choice["prompt_token_ids"] = out.prompt_token_ids
            choice["token_ids"] = c.token_ids[tokens:]
        return choice

    def _logprobs(self, token_ids: list[int], entries: list, offset: int) -> dict:
        tokens = [self.token_text(t, e[t]) for t, e in zip(token_ids, entries)]
        offsets = []
        for s in tokens:
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": [e[t].logprob for t, e in zip(token_ids, entries)],
                "text_offset": offsets,
                "top_logprobs": [self._by_text(self._top(e)[:self.top_logprobs]) for e in entries]}

    def _prompt_logprobs(self, out: RequestOutput) -> dict:
        """The echoed prompt's logprobs: its first token has none (nothing before it to score it)."""
        first, *rest = out.prompt_token_ids
        text = self.tokenizer.decode([first]) if self.tokenizer is not None else f"token_id:{first}"
        scored = self._logprobs(rest, out.prompt_logprobs[1:], len(text))
        head = {"tokens": [text], "token_logprobs": [None], "text_offset": [0], "top_logprobs": [None]}
        return self._join(head, scored)

    @staticmethod
    def _join(a: dict, b: dict) -> dict:
        return {k: a[k] + b[k] for k in a}

    def _by_text(self, ranked) -> dict[str, float]:
        """Legacy top_logprobs are keyed by text; tokens that decode alike keep the likeliest."""
        out: dict[str, float] = {}
        for t, lp in ranked:
            out.setdefault(self.token_text(t, lp), lp.logprob)
        return out


class _ChatFormat(_Format):
    """`tools`: how a reply's text becomes its content and tool calls (server/tool_calls.py); a reply that calls
    tools where the request let the model choose ("auto") or required calls finishes with "tool_calls"."""

    object_name, chunk_object = "chat.completion", "chat.completion.chunk"

    def __init__(self, rid, model_name, token_ids: bool, top_logprobs: int, tools: ToolCalls):
        super().__init__(rid, model_name, token_ids)
        self.top_logprobs, self.tools = top_logprobs, tools
        self.streams: dict[int, tuple[ToolCallStream, list[bool]]] = {}   # by choice: its stream, whether it called

    def _finish_reason(self, reason: str | None, called: bool) -> str | None:
        return "tool_calls" if called and reason == "stop" and self.tools.calls_finish else reason

    def response(self, finals: list[RequestOutput]) -> dict:
        (f,) = finals
        choices = []
        for c in f.outputs:
            content, calls = self.tools.message(c.text)
            message = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = calls
            choice = {"index": c.index, "message": message, "logprobs": self._logprobs(c, 0),
                      "finish_reason": self._finish_reason(c.finish_reason, bool(calls)), "stop_reason": c.stop_reason}
            if self.token_ids:
                choice["token_ids"] = c.token_ids
            choices.append(choice)
        body = self._envelope(self.object_name, choices, self.usage(finals))
        if self.token_ids:
            body["prompt_token_ids"] = f.prompt_token_ids
        return body

    def chunk(self, i, out, c, chars, end, tokens, first) -> dict:
        stream, called = self.streams.setdefault(c.index, (self.tools.stream(), [False]))
        content, calls = stream.feed(c.text[:end], c.finished)
        delta = {"content": content} if content or not calls else {}
        if calls:
            delta["tool_calls"] = calls
            called[0] = True
        if first:
            delta = {"role": "assistant", **delta}
        choice = {"index": c.index, "delta": delta, "logprobs": self._logprobs(c, tokens),
                  "finish_reason": self._finish_reason(c.finish_reason, called[0])}
        if self.token_ids:
            choice["token_ids"] = c.token_ids[tokens:]
        body = self._envelope(self.chunk_object, [choice])
        if self.token_ids and first:
            body["prompt_token_ids"] = out.prompt_token_ids
        return body

    def _logprobs(self, c: CompletionOutput, start: int) -> dict | None:
        if c.logprobs is None:
            return None

        def item(token, lp):
            text = self.token_text(token, lp)
            return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode())}

        return {"content": [{**item(t, e[t]), "top_logprobs": [item(*kv) for kv in self._top(e)[:self.top_logprobs]]}
                            for t, e in zip(c.token_ids[start:], c.logprobs[start:])]}
