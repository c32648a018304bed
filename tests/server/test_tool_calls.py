"""Tool calls from a reply's text, as vLLM's parsers read them: whole, and streamed text piece by text piece, the
stream's content and calls always those of the whole text."""
from __future__ import annotations

import json

import pytest

from kvserve.server.tool_calls import (AutoToolCalls, NamedToolCall, RequiredToolCalls, detect_tool_call_parser,
                                       required_schema)

WEATHER = '{"name": "get_weather", "arguments": {"city": "Oslo", "note": "a \\"}\\" and ]"}}'


def calls(tool_calls) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in tool_calls]


def streamed(tools, text: str, step: int = 3) -> tuple[str, list[tuple[str, dict]]]:
    """The content and calls of `text` fed `step` characters at a time, the calls' deltas put together by index."""
    stream, content, parts = tools.stream(), "", {}
    for end in [*range(step, len(text), step), len(text)]:
        delta, deltas = stream.feed(text[:end], end == len(text))
        content += delta
        for d in deltas:
            part = parts.setdefault(d["index"], {"name": "", "arguments": ""})
            part["name"] = d.get("function", {}).get("name") or part["name"]
            part["arguments"] += d["function"].get("arguments", "")
    return content, [(p["name"], json.loads(p["arguments"])) for _, p in sorted(parts.items())]


@pytest.mark.parametrize("text, content, names", [
    (f"Let me look.\n<tool_call>\n{WEATHER}\n</tool_call>", "Let me look.\n", ["get_weather"]),
    (f"<tool_call>{WEATHER}</tool_call>\n<tool_call>{{\"name\": \"t\", \"arguments\": {{}}}}</tool_call>", None,
     ["get_weather", "t"]),
    (f"<tool_call>{WEATHER}", None, ["get_weather"]),                   # cut before its closing tag
    ("<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),     # no call: all content
    ("No tool needed: 1 < 2.", "No tool needed: 1 < 2.", []),
    ("ends with a partial tag <tool_c", "ends with a partial tag <tool_c", []),
])
def test_hermes(text, content, names):
    tools = AutoToolCalls("hermes")
    got_content, got_calls = tools.message(text)
    assert got_content == content and [n for n, _ in calls(got_calls)] == names
    assert streamed(tools, text) == (content or "", calls(got_calls))


@pytest.mark.parametrize("text, content, names", [
    ('<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}', None, ["a", "b"]),
    (' {"name": "a", "arguments": {"x": [1, 2]}}', None, ["a"]),
    ("It is sunny.", "It is sunny.", []),
    ('{"name": "a", "parameters": {"x": 1}} and then some words', '{"name": "a", "parameters": {"x": 1}} and then '
                                                                  'some words', []),
    ('{"no_name": 1}', '{"no_name": 1}', []),
])
def test_llama3_json(text, content, names):
    tools = AutoToolCalls("llama3_json")
    got_content, got_calls = tools.message(text)
    assert got_content == content and [n for n, _ in calls(got_calls)] == names
    assert streamed(tools, text) == (content or "", calls(got_calls))


def test_required_calls_stream_as_each_closes():
    text = ('[{"name": "a", "parameters": {"s": "]}, {\\"x"}}, {"name": "b", "parameters": {"n": [1, {"m": 2}]}}]')
    tools = RequiredToolCalls()
    content, whole = tools.message(text)
    assert content is None and calls(whole) == [("a", {"s": ']}, {"x'}), ("b", {"n": [1, {"m": 2}]})]
    stream = tools.stream()
    first_close = text.index("}},") + 2
    assert [d["index"] for d in stream.feed(text[:first_close - 1], False)[1]] == []
    assert [d["index"] for d in stream.feed(text[:first_close], False)[1]] == [0]
    assert [d["index"] for d in stream.feed(text, True)[1]] == [1]
    # cut short by max_tokens: the calls it closed
    assert calls(tools.message(text[:first_close + 5])[1]) == [("a", {"s": ']}, {"x'})]


def test_a_named_function_streams_its_arguments():
    tools = NamedToolCall("f")
    text = '{"x": 1, "y": "two"}'
    assert streamed(tools, text, step=4) == ("", [("f", json.loads(text))])
    content, (call,) = tools.message(text)
    assert content is None and call["type"] == "function" and call["function"] == {"name": "f", "arguments": text}
    assert call["id"].startswith("chatcmpl-tool-")


def test_required_schema_takes_each_tool_s_parameters():
    tools = [{"type": "function", "function": {"name": "a", "parameters": {
        "type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "$defs": {"P": {"type": "integer"}}}}},
        {"type": "function", "function": {"name": "b"}}]
    schema = required_schema(tools, parallel=False)
    assert schema["maxItems"] == 1 and schema["minItems"] == 1 and schema["$defs"] == {"P": {"type": "integer"}}
    assert [c["properties"]["name"]["enum"] for c in schema["items"]["anyOf"]] == [["a"], ["b"]]
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == {"type": "object", "properties": {}}
    assert "maxItems" not in required_schema(tools, parallel=True)


@pytest.mark.parametrize("template, parser", [
    ("{% for t in tools %}{{ t }}{% endfor %}<tool_call>", "hermes"),
    ("<|python_tag|>{{ messages }}", "llama3_json"),
    ("{{ messages }}", None),
    (None, None),
])
def test_the_parser_is_the_template_s(template, parser):
    assert detect_tool_call_parser(template) == parser
