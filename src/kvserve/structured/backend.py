"""The grammar engine, xgrammar: structured outputs compiled against the tokenizer's vocabulary (once per
constraint), and each sequence's matcher over its compiled grammar."""
from __future__ import annotations

import copy
import json
import os
import re
from collections import OrderedDict

import torch
import xgrammar as xgr

from kvserve.structured.params import StructuredOutputsParams

# the compiled grammars kept for requests to come (vLLM's default for xgrammar's cache is 512 MiB; a compiled
# grammar of a JSON schema over a 32k vocabulary takes tens of KiB)
GRAMMAR_CACHE_BYTES = 64 * 2**20
COMPILE_THREADS = min(8, os.cpu_count() or 1)

# JSON schema keywords whose values are schemas: by name (a map of them), in a list, or one
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalProperties", "contains", "propertyNames", "unevaluatedProperties",
                  "unevaluatedItems", "additionalItems", "not", "if", "then", "else")
# keywords xgrammar compiles without enforcing them: a schema with one is refused rather than not followed
_NOT_ENFORCED = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas")
# xgrammar's errors begin with the time and the C++ source line
_ERROR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


class XGrammarCompiler:
    """Compiles structured outputs for one tokenizer (a Hugging Face one) and a model's vocabulary; each constraint
    is compiled once and kept (least recently used first out, past GRAMMAR_CACHE_BYTES). A sequence ends its
    grammar with one of `stop_token_ids` (the model's EOS)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: set[int]):
        # without EOS ids of its own, xgrammar finds the tokenizer's
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=sorted(stop_token_ids) or None)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=COMPILE_THREADS, cache_enabled=False)
        self.cache: OrderedDict[tuple, xgr.CompiledGrammar] = OrderedDict()
        self.cache_bytes = 0
        self.hits = self.misses = 0

    def grammar(self, params: StructuredOutputsParams) -> MatcherGrammar:
        """A fresh matcher of the request's constraint; ValueError (naming structured_outputs) for a schema, regex
        or grammar that does not compile, or a schema with keywords the grammar engine would not enforce."""
        key = _key(params)
        compiled = self.cache.get(key)
        if compiled is None:
            self.misses += 1
            compiled = self._compile(params)
            self.cache[key] = compiled
            self.cache_bytes += compiled.memory_size_bytes
            while self.cache_bytes > GRAMMAR_CACHE_BYTES and len(self.cache) > 1:
                self.cache_bytes -= self.cache.popitem(last=False)[1].memory_size_bytes
        else:
            self.hits += 1
            self.cache.move_to_end(key)
        return MatcherGrammar(xgr.GrammarMatcher(compiled))

    def _compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        kind = params.kind
        if kind == "json":
            _check_enforced(params.json)
        try:
            if kind == "json":
                return self.compiler.compile_json_schema(json.dumps(_bounded_strings(params.json), ensure_ascii=False),
                                                         any_whitespace=not params.disable_any_whitespace)
            if kind == "json_object":
                return self.compiler.compile_builtin_json_grammar()
            if kind == "regex":
                return self.compiler.compile_regex(params.regex)
            if kind == "choice":
                return self.compiler.compile_grammar(choice_grammar(params.choice))
            return self.compiler.compile_grammar(params.grammar)
        except RuntimeError as e:
            what = {"json": "the JSON schema", "regex": "the regex", "grammar": "the grammar (xgrammar's EBNF)",
                    "choice": "the choice"}.get(kind, kind)
            raise ValueError(f"structured_outputs: {what} does not compile: {_ERROR_PREFIX.sub('', str(e)).strip()}"
                             ) from None

    def stats(self) -> dict:
        return {"grammars_cached": len(self.cache), "grammar_cache_hits": self.hits,
                "grammar_cache_misses": self.misses}


class MatcherGrammar:
    """A sequence's xgrammar matcher. Once it has taken a stop token (EOS) the grammar has ended: it constrains
    nothing after (the sequence goes on only with ignore_eos)."""

    def __init__(self, matcher: xgr.GrammarMatcher):
        self.matcher = matcher

    @property
    def constrains(self) -> bool:
        return not self.matcher.is_terminated()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        return self.matcher.is_terminated() or self.matcher.accept_token(token)

    def fork(self) -> MatcherGrammar:
        return MatcherGrammar(self.matcher.fork())


def choice_grammar(choices: list[str]) -> str:
    """EBNF of exactly one of the strings (JSON's escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _key(params: StructuredOutputsParams) -> tuple:
    """What makes two constraints compile alike: the kind, its spec (a schema's keys in their order: they are the
    order the output writes them in) and the whitespace option."""
    spec = getattr(params, params.kind)
    if params.kind == "json":
        spec = json.dumps(spec, ensure_ascii=False)
    elif params.kind == "choice":
        spec = tuple(spec)
    return params.kind, spec, params.disable_any_whitespace


def _subschemas(node: dict):
    """The schemas a schema object holds: its properties', its items', its branches', ..."""
    for key in _SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            yield from (sub for sub in node[key].values() if isinstance(sub, dict))
    for key in _SCHEMA_LISTS:
        if isinstance(node.get(key), list):
            yield from (sub for sub in node[key] if isinstance(sub, dict))
    yield from (node[key] for key in _SCHEMA_VALUES if isinstance(node.get(key), dict))


def _check_enforced(node) -> None:
    """ValueError naming the keywords of a JSON schema (at any depth) that xgrammar compiles without enforcing."""
    found: set[str] = set()

    def walk(node: dict) -> None:
        found.update(k for k in _NOT_ENFORCED if k in node)
        if node.get("uniqueItems") is True:
            found.add("uniqueItems")
        if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
            found.add("allOf of several schemas")
        if {"minLength", "maxLength"} & node.keys() and {"pattern", "format"} & node.keys():
            found.add("a string's length beside its pattern or format")
        for sub in _subschemas(node):
            walk(sub)

    if isinstance(node, dict):
        walk(node)
    if found:
        raise ValueError(f"structured_outputs: the JSON schema uses {', '.join(sorted(found))}, which kvserve's "
                         f"grammar engine (xgrammar) does not enforce")


def _bounded_strings(node):
    """The schema with each string's minLength/maxLength written as a pattern of as many characters, none of them a
    control character, a quote or a backslash. (xgrammar's rule for a bounded string lets unescaped control
    characters through, which no JSON parser takes; its rule for a pattern does not.)"""
    if not isinstance(node, dict):
        return node
    node = copy.deepcopy(node)

    def walk(node: dict) -> None:
        if {"minLength", "maxLength"} & node.keys() and "pattern" not in node:
            low, high = node.pop("minLength", 0), node.pop("maxLength", "")
            node["pattern"] = f'^[^\\x00-\\x1f"\\\\]{{{low},{high}}}$'
        for sub in _subschemas(node):
            walk(sub)

    walk(node)
    return node
