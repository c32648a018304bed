"""StructuredOutputsParams: the one constraint a request's output must follow (vLLM's fields and names)."""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

# the fields that each name a kind of constraint; exactly one of them is given
KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """One constraint on the whole output, as vLLM's StructuredOutputsParams:

    - json: a JSON schema (a dict, or its JSON text) the output is an instance of;
    - regex: a regular expression the output matches in full;
    - choice: one of these strings, exactly;
    - grammar: a context-free grammar, in Lark's syntax or GBNF's (`root ::= ...`);
    - json_object: True for any JSON object.

    JSON's options: disable_any_whitespace (no whitespace between its tokens; else any, as the model likes),
    whitespace_pattern (a regex of the whitespace allowed there). An object whose schema lists its properties takes
    no others unless its additionalProperties says so, as with vLLM's default grammar engine: what
    disable_additional_properties asks is done always. disable_fallback: there is one grammar engine, never another
    to fall back to. structural_tag is vLLM's and refused here.

    Checked when made: the shape of each field, and exactly one constraint (ValueError naming the field). Whether
    the schema, regex or grammar compiles is checked with the tokenizer, when the engine takes the request."""

    json: str | dict | bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self):
        for name in ("disable_fallback", "disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"structured_outputs: {name} must be true or false, got {getattr(self, name)!r}")
        if self.structural_tag is not None:
            raise ValueError("structured_outputs: structural_tag is not supported by kvserve")
        if self.whitespace_pattern is not None and not isinstance(self.whitespace_pattern, str):
            raise ValueError(f"structured_outputs: whitespace_pattern must be a string (a regex), got "
                             f"{type(self.whitespace_pattern).__name__}")
        if self.json_object is False:       # asks for nothing
            self.json_object = None
        given = [name for name in KINDS if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"structured_outputs must give exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(given) if given else 'none'}")
        self.json = _schema(self.json) if self.json is not None else None
        if self.regex is not None and not isinstance(self.regex, str):
            raise ValueError(f"structured_outputs: regex must be a string, got {type(self.regex).__name__}")
        if self.grammar is not None and not (isinstance(self.grammar, str) and self.grammar.strip()):
            raise ValueError("structured_outputs: grammar must be a non-empty string (Lark or GBNF)")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice \
                    or not all(isinstance(c, str) for c in self.choice):
                raise ValueError(f"structured_outputs: choice must be a non-empty list of strings, got {self.choice!r}")
            self.choice = list(self.choice)
        if self.json_object not in (None, True):
            raise ValueError(f"structured_outputs: json_object must be true or false, got {self.json_object!r}")

    @classmethod
    def from_dict(cls, value: dict) -> StructuredOutputsParams:
        """From a request's JSON object; ValueError naming a key that is no field."""
        if not isinstance(value, dict):
            raise ValueError(f"structured_outputs must be an object, got {type(value).__name__}")
        unknown = sorted(value.keys() - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"structured_outputs: unknown fields {unknown}")
        return cls(**value)

    @property
    def kind(self) -> str:
        """The name of the constraint given: json, regex, choice, grammar or json_object."""
        return next(name for name in KINDS if getattr(self, name) is not None)


def _schema(schema: Any) -> dict | bool:
    """A JSON schema as an object (or a boolean schema), from itself or its JSON text."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"structured_outputs: json is not valid JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"structured_outputs: json must be a JSON schema (an object), got {type(schema).__name__}")
    return schema
