"""Structured outputs and tool calls through the server, with the openai client: response_format, vLLM's
structured_outputs and guided_* fields, tools with tool_choice named, "required" and "auto" (Hermes and Llama 3
JSON templates), streamed and not; a constraint that does not compile is a 400 naming its field."""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pydantic
import pytest

from kvserve.config import EngineConfig, ServerConfig
from kvserve.engine.engine import LLMEngine
from kvserve.server.app import build_app
from kvserve.server.protocol import ChatCompletionRequest
from schemas import demo_schemas
from servers import ServerThread
from tiny_models import CHAT_TEMPLATE

MODEL = "tiny"
ENGINE_ARGS = dict(block_size=4, num_kv_blocks=512, max_model_len=1024)
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 10},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["admin", "user", "guest"]},
}, "required": ["name", "age", "role"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Rome"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                            "unit": {"enum": ["c", "f"]}}, "required": ["city", "days"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather to come",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}]
MESSAGES = [{"role": "user", "content": "What is the weather in Oslo?"}]
# random weights write whitespace between JSON's tokens for as long as they may: at most a space here
COMPACT = {"guided_whitespace_pattern": " ?"}
HERMES_TEMPLATE = (
    "{% if tools %}<s>system: You may call these tools:\n<tools>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    '</tools>\nCall one as <tool_call>\n{"name": <name>, "arguments": <arguments>}\n</tool_call>\n{% endif %}'
    + CHAT_TEMPLATE)
LLAMA3_TEMPLATE = (
    '{% if tools %}<s>system: To call a function, respond with <|python_tag|>{"name": function name, "parameters": '
    "dictionary of argument name and its value}\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}{% endif %}"
    + CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def ckpt(checkpoint):
    return checkpoint("llama", max_position_embeddings=1024)


def serve(ckpt, template: str | None = None):
    config = ServerConfig(chat_template=template)
    return ServerThread(build_app(LLMEngine(EngineConfig(model=str(ckpt), **ENGINE_ARGS)), MODEL, config), config)


@pytest.fixture(scope="module")
def url(ckpt):
    with ServerThread(build_app(EngineConfig(model=str(ckpt), **ENGINE_ARGS), MODEL)) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def chat(client, stream=False, **kw):
    return client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=stream, **{"max_tokens": 200, **kw})


def test_response_format_json_schema(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 5, "top_p": 0.9}):
        r = chat(client, response_format=fmt, n=2, extra_body=COMPACT, **sampling)
        for choice in r.choices:
            assert choice.finish_reason == "stop"
            jsonschema.validate(json.loads(choice.message.content), PERSON)
        streamed = chat(client, stream=True, response_format=fmt, extra_body=COMPACT, **sampling)
        text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        assert text == r.choices[0].message.content


def test_the_openai_client_parses_into_its_model(client):
    """The client's own structured outputs: a pydantic model sent as a strict json_schema, its reply parsed back."""
    class Person(pydantic.BaseModel):
        age: int = pydantic.Field(ge=0, le=120)
        admin: bool

    r = client.chat.completions.parse(model=MODEL, messages=MESSAGES, max_tokens=100, temperature=0,
                                      response_format=Person, extra_body=COMPACT)
    assert isinstance(r.choices[0].message.parsed, Person)


def test_response_format_json_object(client):
    r = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=160, temperature=0,
                                  extra_body={"response_format": {"type": "json_object"}})
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].text), dict)


@pytest.mark.parametrize("body, check", [
    ({"structured_outputs": {"regex": "[a-z]{3}-[0-9]{2}"}}, lambda t: re.fullmatch("[a-z]{3}-[0-9]{2}", t)),
    ({"structured_outputs": {"choice": ["red", "green"]}}, lambda t: t in ("red", "green")),
    ({"structured_outputs": {"grammar": 'root ::= "x" [0-9] ("," "x" [0-9])?'}},
     lambda t: re.fullmatch("x[0-9](,x[0-9])?", t)),
    ({"guided_json": PERSON, **COMPACT}, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
    ({"guided_regex": "(ab|cd){2}"}, lambda t: re.fullmatch("(ab|cd){2}", t)),
    ({"guided_choice": ["one", "two"]}, lambda t: t in ("one", "two")),
])
def test_vllm_s_fields_constrain_completions(client, body, check):
    r = client.completions.create(model=MODEL, prompt=["def f(x):", "import os"], max_tokens=100, temperature=0.8,
                                  seed=1, extra_body=body)
    for choice in r.choices:
        assert choice.finish_reason == "stop" and check(choice.text), choice.text


def arguments_of(calls) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls]


def streamed_calls(stream) -> tuple[str, list[tuple[str, dict]], str]:
    """The content, the calls (their deltas put together by index) and the finish reason of a streamed reply."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or ():
            call = calls.setdefault(d.index, {"name": "", "arguments": ""})
            if d.function.name:
                call["name"] = d.function.name
                assert d.id.startswith("chatcmpl-tool-") and d.type == "function"
            call["arguments"] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())], finish


def test_response_format_s_schema_is_read_and_unknown_fields_are_named(caplog):
    """The json_schema's "schema" (a key that is no Python name) is read, not reported as a field kvserve ignores."""
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    with caplog.at_level("WARNING", logger="kvserve.server.protocol"):
        req = ChatCompletionRequest.model_validate_json(json.dumps({"messages": MESSAGES, "response_format": fmt,
                                                                    "frobnicate": 1}))
    assert req.response_format.json_schema.json_schema == PERSON
    assert [r.getMessage() for r in caplog.records] == [
        "ignoring fields of the request kvserve does not know: [\"'frobnicate'\"]"]


def test_a_named_function_s_arguments_follow_its_parameters(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 3}):
        r = chat(client, tools=TOOLS, tool_choice=named, extra_body=COMPACT, **sampling)
        message = r.choices[0].message
        assert r.choices[0].finish_reason == "stop" and not message.content
        ((name, args),) = arguments_of(message.tool_calls)
        assert name == "get_weather" and message.tool_calls[0].id.startswith("chatcmpl-tool-")
        jsonschema.validate(args, WEATHER)
        content, calls, finish = streamed_calls(chat(client, True, tools=TOOLS, tool_choice=named, extra_body=COMPACT,
                                                     **sampling))
        assert (content, calls, finish) == ("", [(name, args)], "stop")


@pytest.mark.parametrize("parallel", [False, True])
def test_required_tool_calls_follow_their_tools(client, parallel):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    r = chat(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel, temperature=0.9, seed=2,
             max_tokens=400, extra_body=COMPACT)
    assert r.choices[0].finish_reason == "tool_calls"
    calls = arguments_of(r.choices[0].message.tool_calls)
    assert calls and (parallel or len(calls) == 1)
    for name, args in calls:
        jsonschema.validate(args, schemas[name])
    content, streamed, finish = streamed_calls(chat(client, True, tools=TOOLS, tool_choice="required",
                                                    parallel_tool_calls=parallel, temperature=0.9, seed=2,
                                                    max_tokens=400, extra_body=COMPACT))
    assert (content, streamed, finish) == ("", calls, "tool_calls")


HERMES_CALL = (r'Checking\. <tool_call>\n\{"name": "get_weather", "arguments": '
               r'\{"city": "(Oslo|Rome)", "days": [1-7]\}\}\n</tool_call>')
LLAMA3_CALLS = r'<\|python_tag\|>\{"name": "get_time", "parameters": \{"zone": "UTC"\}\}; ' \
               r'\{"name": "get_weather", "parameters": \{"city": "Paris", "days": [1-7]\}\}'


@pytest.mark.parametrize("template, regex, content, names", [
    (HERMES_TEMPLATE, HERMES_CALL, "Checking. ", ["get_weather"]),
    (HERMES_TEMPLATE, "It is (sunny|rainy)\\.", None, []),
    (LLAMA3_TEMPLATE, LLAMA3_CALLS, None, ["get_time", "get_weather"]),
    (LLAMA3_TEMPLATE, "It is (sunny|rainy)\\.", None, []),
], ids=["hermes-call", "hermes-content", "llama3-calls", "llama3-content"])
def test_auto_parses_the_template_s_tool_calls(ckpt, template, regex, content, names):
    """With tool_choice "auto" the model writes calls in its template's format or content: the template is given
    the tools, and the reply parsed as vLLM's Hermes and Llama 3 JSON parsers do (the model is steered here with
    a regex: random weights call no tool of their own)."""
    with serve(ckpt, template) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        bare, prompt = (httpx.post(f"{base}/tokenize", json={"messages": MESSAGES, **tools}, timeout=60).json()["count"]
                        for tools in ({}, {"tools": TOOLS}))
        r = chat(client, tools=TOOLS, temperature=0, extra_body={"guided_regex": regex})
        assert r.usage.prompt_tokens == prompt > bare        # the tools are in the prompt
        message, choice = r.choices[0].message, r.choices[0]
        calls = arguments_of(message.tool_calls or [])
        assert [name for name, _ in calls] == names
        if names:
            assert message.content == content and choice.finish_reason == "tool_calls"
        else:
            assert re.fullmatch(regex, message.content) and choice.finish_reason == "stop"
        streamed = streamed_calls(chat(client, True, tools=TOOLS, temperature=0, extra_body={"guided_regex": regex}))
        assert streamed == (message.content or "", calls, choice.finish_reason)


def test_a_conversation_goes_on_after_a_tool_call(ckpt):
    """The assistant's call (its arguments JSON text, as OpenAI sends them) and the tool's result go back through
    the template."""
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call-1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call-1", "content": "sunny"}]
    template = ("{% for m in messages %}{{ m['role'] }}: {% if m.tool_calls %}{{ m.tool_calls[0].function.arguments"
                ".city }}{% else %}{{ m['content'] }}{% endif %}\n{% endfor %}")
    with serve(ckpt, template) as base:
        text = httpx.post(f"{base}/tokenize", json={"messages": history}, timeout=60).json()
        r = httpx.post(f"{base}/v1/chat/completions", json={"messages": history, "max_tokens": 3}, timeout=60)
        assert r.status_code == 200 and text["count"] == r.json()["usage"]["prompt_tokens"]
        assert "assistant: Oslo" in httpx.post(f"{base}/detokenize", json={"tokens": text["tokens"]},
                                               timeout=60).json()["prompt"]


@pytest.mark.parametrize("path, body, param, message", [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "frob"}}}}, "response_format", "the JSON schema does not compile"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "needs"),
    ("/v1/chat/completions", {"response_format": {"type": "structural_tag"}}, "response_format.type",
     "not supported"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}}}], "tool_choice": "required"},
     "tools", "Unimplemented keys"),
    ("/v1/chat/completions", {"tools": TOOLS}, "tool_choice", 'tool_choice "auto" needs a chat template'),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice", "needs tools"),
    ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "none of the tools"),
    ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format", "constrains the output to its calls"),
    ("/v1/completions", {"structured_outputs": {"regex": "a(b"}}, "structured_outputs", "the regex does not compile"),
    ("/v1/completions", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ("/v1/completions", {"guided_grammar": "root ::= missing"}, "guided_grammar", "does not compile"),
    ("/v1/completions", {"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "give one of"),
    ("/v1/completions", {"guided_json": "{oops"}, "guided_json", "not valid JSON"),
    ("/v1/completions", {"guided_regex": "a", "guided_decoding_backend": "xgrammar"}, "guided_decoding_backend",
     "llguidance"),
])
def test_a_constraint_that_does_not_compile_is_a_400_naming_its_field(url, path, body, param, message):
    base = {"prompt": "def f(x):"} if path == "/v1/completions" else {"messages": MESSAGES}
    r = httpx.post(f"{url}{path}", json={"model": MODEL, **base, **body}, timeout=60)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param and message in error["message"], error
    assert httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60).status_code == 200


DEMO_REGEXES = [r"[a-z]{2,6}-[0-9]{3}", r"(yes|no), because [a-z ]{1,20}\.", r"[0-9]{1,3}(\.[0-9]{1,2})?",
                r"#[0-9a-f]{6}", r"[A-Z][a-z]{1,8} [A-Z][a-z]{1,8}", r"\d{4}-\d{2}-\d{2}"]
DEMO_CHOICES = [["yes", "no"], ["red", "green", "blue"], ["Paris", "Oslo", "Rome", "somewhere else"],
                ["positive", "negative", "neutral"]]


def test_the_demo_model_s_replies_validate_against_fifty_schemas():
    """The demo model served, with the openai client: each of fifty-odd schemas as a strict json_schema
    response_format and as a named tool's parameters; regexes and choices as vLLM's structured_outputs. Every reply
    ends within max_tokens and follows its constraint."""
    schemas = demo_schemas()
    config = EngineConfig(max_model_len=512, num_kv_blocks=1024, max_num_seqs=16)
    with ServerThread(build_app(config, "demo")) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)

        def ask(i: int, **kw):
            return client.chat.completions.create(
                model="demo", messages=[{"role": "user", "content": "Answer in JSON."}], max_tokens=300,
                temperature=0.7, seed=i, **kw)

        def as_response_format(i: int, schema: dict):
            fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}}
            choice = ask(i, response_format=fmt, extra_body=COMPACT).choices[0]
            assert choice.finish_reason == "stop", (schema, choice.message.content)
            jsonschema.validate(json.loads(choice.message.content), schema)

        def as_tool(i: int, schema: dict):
            if schema.get("type") != "object":      # a function's parameters are an object; references from its root
                items = {k: v for k, v in schema.items() if k != "$defs"}
                schema = {"type": "object", "properties": {"items": items}, "required": ["items"],
                          "$defs": schema.get("$defs", {})}
            tool = {"type": "function", "function": {"name": f"f{i}", "parameters": schema}}
            choice = ask(i, tools=[tool], tool_choice={"type": "function", "function": {"name": f"f{i}"}},
                         extra_body=COMPACT).choices[0]
            assert choice.finish_reason == "stop", (schema, choice.message)
            ((name, args),) = arguments_of(choice.message.tool_calls)
            assert name == f"f{i}"
            jsonschema.validate(args, schema)

        def as_regex(i: int, regex: str):
            text = ask(i, extra_body={"structured_outputs": {"regex": regex}}).choices[0].message.content
            assert re.fullmatch(regex, text), (regex, text)

        def as_choice(i: int, options: list[str]):
            text = ask(i, extra_body={"structured_outputs": {"choice": options}}).choices[0].message.content
            assert text in options, (options, text)

        jobs = [*((as_response_format, i, s) for i, s in enumerate(schemas)),
                *((as_tool, i, s) for i, s in enumerate(schemas)),
                *((as_regex, i, r) for i, r in enumerate(DEMO_REGEXES)),
                *((as_choice, i, c) for i, c in enumerate(DEMO_CHOICES))]
        with ThreadPoolExecutor(16) as pool:
            for future in [pool.submit(*job) for job in jobs]:
                future.result()
