"""Tool calls of the chat endpoint, in OpenAI's shape: how a completion's text becomes `tool_calls`, whole and
streamed, for each tool_choice.

- named function: the output is the function's arguments (constrained by its parameters' schema);
- "required": the output is a JSON array of {"name", "parameters"} objects, one per call (vLLM's schema);
- "auto": the model writes calls in its chat template's format, parsed as vLLM's tool parsers do: Hermes
  (`<tool_call>{"name": ..., "arguments": ...}</tool_call>`) and Llama 3's JSON (`{"name": ..., "parameters": ...}`,
  calls separated by `;`, after an optional `<|python_tag|>`);
- "none" (or no tools): the output is the message's content.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Protocol

HERMES = "hermes"
LLAMA3_JSON = "llama3_json"
TOOL_CALL_PARSERS = (HERMES, LLAMA3_JSON)
_HERMES_START, _HERMES_END = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"


def detect_tool_call_parser(template: str | None) -> str | None:
    """The tool-call format a chat template teaches its model, if it names one kvserve parses."""
    if not template:
        return None
    if _HERMES_START in template:
        return HERMES
    if _PYTHON_TAG in template:
        return LLAMA3_JSON
    return None


def required_schema(tools: list[dict], parallel: bool) -> dict:
    """The JSON schema of tool_choice "required" (vLLM's): an array of one call or more, each the name of one of
    the tools and arguments following its parameters' schema; of exactly one call without parallel calls."""
    calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                               "parameters": parameters_schema(t)},
              "required": ["name", "parameters"]} for t in tools]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    defs = {k: v for t in tools for k, v in (t["function"].get("parameters") or {}).get("$defs", {}).items()}
    if defs:                # a tool's references point at the root's definitions
        schema["$defs"] = defs
    return schema


def parameters_schema(tool: dict) -> dict:
    """A tool's parameters' schema, an object of no properties where it has none."""
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def tool_call(name: str, arguments: str) -> dict:
    """One call in OpenAI's shape."""
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _arguments(value) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


class ToolCalls(Protocol):
    """How a choice's text becomes its message's content and tool calls. `calls_finish`: a reply that calls tools
    and stops finishes with "tool_calls" (the model chose to call, or had to: "auto" and "required")."""

    calls_finish: bool

    def message(self, text: str) -> tuple[str | None, list[dict]]:
        """The content (None: none) and the tool calls of a finished completion's text."""

    def stream(self) -> ToolCallStream:
        """A stream of one choice's deltas."""


class ToolCallStream(Protocol):
    def feed(self, text: str, finished: bool) -> tuple[str, list[dict]]:
        """The completion's text so far (all of it once `finished`): the content to send since the last feed and the
        tool calls' deltas (each with its "index" among the choice's calls)."""


@dataclass
class NoToolCalls:
    """tool_choice "none", or no tools: the text is the content."""

    calls_finish = False

    def message(self, text: str) -> tuple[str | None, list[dict]]:
        return text, []

    def stream(self) -> ToolCallStream:
        return _ContentStream()


@dataclass
class _ContentStream:
    sent: int = 0

    def feed(self, text: str, finished: bool) -> tuple[str, list[dict]]:
        delta, self.sent = text[self.sent:], len(text)
        return delta, []


@dataclass
class NamedToolCall:
    """A named function: the text is its arguments, streamed as they come."""

    name: str
    calls_finish = False

    def message(self, text: str) -> tuple[str | None, list[dict]]:
        return None, [tool_call(self.name, text)]

    def stream(self) -> ToolCallStream:
        return _NamedStream(self.name)


@dataclass
class _NamedStream:
    name: str
    sent: int | None = None         # characters of the arguments sent; None: the call not begun

    def feed(self, text: str, finished: bool) -> tuple[str, list[dict]]:
        if self.sent is None:
            self.sent = len(text)
            call = tool_call(self.name, text)
            return "", [{"index": 0, **call}]
        delta, self.sent = text[self.sent:], len(text)
        return "", [{"index": 0, "function": {"arguments": delta}}] if delta else []


@dataclass
class RequiredToolCalls:
    """tool_choice "required": the text is a JSON array of calls (required_schema), each sent whole as soon as the
    array's text closes it."""

    calls_finish = True

    def message(self, text: str) -> tuple[str | None, list[dict]]:
        try:
            calls = json.loads(text)
        except json.JSONDecodeError:    # cut short (max_tokens, a stop string): the calls it closed
            calls = [json.loads(item) for item in _closed_items(text)]
        return None, [tool_call(c["name"], _arguments(c["parameters"])) for c in calls]

    def stream(self) -> ToolCallStream:
        return _RequiredStream()


@dataclass
class _RequiredStream:
    num_sent: int = 0

    def feed(self, text: str, finished: bool) -> tuple[str, list[dict]]:
        items = _closed_items(text)
        deltas = []
        for index in range(self.num_sent, len(items)):
            call = json.loads(items[index])
            deltas.append({"index": index, **tool_call(call["name"], _arguments(call["parameters"]))})
        self.num_sent = len(items)
        return "", deltas


def _closed_items(text: str) -> list[str]:
    """The text of each item of a JSON array (the start of one, maybe cut short) that is closed."""
    items, depth, start, in_string, escaped = [], 0, None, False, False
    for i, ch in enumerate(text):
        if in_string:
            escaped, in_string = (False, True) if escaped else (ch == "\\", ch != '"')
            continue
        if ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth == 2:
                start = i
        elif ch in "]}":
            if depth == 2 and start is not None:
                items.append(text[start:i + 1])
            depth -= 1
    return items


@dataclass
class AutoToolCalls:
    """tool_choice "auto": the model calls tools in its template's format (TOOL_CALL_PARSERS), or writes content.
    Streamed, the content goes out as it comes until a call may begin; the calls go out whole at the end."""

    parser: str
    calls_finish = True

    def message(self, text: str) -> tuple[str | None, list[dict]]:
        content, calls = (_hermes if self.parser == HERMES else _llama3_json)(text)
        return (content or None) if calls else content, [tool_call(name, _arguments(args)) for name, args in calls]

    def stream(self) -> ToolCallStream:
        return _AutoStream(self)


@dataclass
class _AutoStream:
    tools: AutoToolCalls
    sent: int = 0
    calls: list[dict] = field(default_factory=list)

    def feed(self, text: str, finished: bool) -> tuple[str, list[dict]]:
        if finished:
            content, calls = self.tools.message(text)
            content = content or ""
            delta = content[self.sent:] if content.startswith(text[:self.sent]) else ""
            self.sent = len(content)
            return delta, [{"index": i, **call} for i, call in enumerate(calls)]
        safe = self._content_before_calls(text)
        delta, self.sent = safe[self.sent:], max(self.sent, len(safe))
        return delta, []

    def _content_before_calls(self, text: str) -> str:
        """The text that is content whatever follows: up to where a call may begin."""
        if self.tools.parser == HERMES:
            start = text.find(_HERMES_START)
            if start >= 0:
                return text[:start]
            # a tail that may be the start of a tag waits for the text after it
            held = next((k for k in range(len(_HERMES_START) - 1, 0, -1) if text.endswith(_HERMES_START[:k])), 0)
            return text[:len(text) - held]
        stripped = text.lstrip()
        if not stripped or stripped.startswith("{") or _PYTHON_TAG.startswith(stripped[:len(_PYTHON_TAG)]):
            return ""                   # a Llama 3 call is the whole message: nothing is content until it is not
        return text


def _hermes(text: str) -> tuple[str, list[tuple[str, object]]]:
    """Hermes' format (vLLM's hermes parser): the content before the first <tool_call>, and each call's name and
    arguments; a call that is not a JSON object with a name makes the whole text content."""
    start = text.find(_HERMES_START)
    if start < 0:
        return text, []
    calls, rest = [], text[start:]
    while rest.startswith(_HERMES_START):
        end = rest.find(_HERMES_END)
        body, rest = (rest[len(_HERMES_START):], "") if end < 0 else (rest[len(_HERMES_START):end],
                                                                       rest[end + len(_HERMES_END):].lstrip())
        call = _call(body, "arguments")
        if call is None:
            return text, []
        calls.append(call)
    return text[:start], calls


def _llama3_json(text: str) -> tuple[str, list[tuple[str, object]]]:
    """Llama 3's JSON format (vLLM's llama3_json parser): the message, after an optional <|python_tag|>, is one call
    or several separated by ";", each {"name": ..., "parameters": ...}; anything else is content."""
    body = text.lstrip().removeprefix(_PYTHON_TAG).strip()
    if not body.startswith("{"):
        return text, []
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(body):
        try:
            obj, at = decoder.raw_decode(body, at)
        except json.JSONDecodeError:
            return text, []
        call = _call(obj, "parameters", "arguments")
        if call is None:
            return text, []
        calls.append(call)
        at = len(body) - len(body[at:].lstrip().removeprefix(";").lstrip())
    return "", calls


def _call(body, *argument_keys: str) -> tuple[str, object] | None:
    """A call's name and arguments from its JSON (text or parsed), or None where it is no call."""
    if isinstance(body, str):
        try:
            body = json.loads(body)
        except json.JSONDecodeError:
            return None
    if not isinstance(body, dict) or not isinstance(body.get("name"), str):
        return None
    args = next((body[k] for k in argument_keys if k in body), {})
    return body["name"], args
