"""The grammar engine, llguidance: structured outputs compiled against the tokenizer's vocabulary (once per
constraint), and each sequence's matcher, a copy of its constraint's compiled one."""
from __future__ import annotations

import copy
import json
from collections import OrderedDict
from collections.abc import Sequence

import llguidance
import llguidance.hf
import llguidance.torch
import torch

from kvserve.structured.params import StructuredOutputsParams

# compiled constraints kept for the requests to come, least recently used first out
GRAMMAR_CACHE_SIZE = 128
# an error names what is wrong, not the parser's state
_LIMITS = llguidance.LLParserLimits(verbose_errors=False)
_WHAT = {"json": "the JSON schema", "json_object": "json_object", "regex": "the regex", "choice": "the choice",
         "grammar": "the grammar (Lark or GBNF)"}
# JSON schema keywords whose values are schemas: by name (a map of them), in a list, or one
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalProperties", "contains", "propertyNames", "unevaluatedProperties",
                  "unevaluatedItems", "additionalItems", "not", "if", "then", "else")


class GuidanceCompiler:
    """Compiles structured outputs for one tokenizer (a Hugging Face fast one) and a model's vocabulary: each
    constraint once, into a matcher kept (GRAMMAR_CACHE_SIZE of them) that each request's is a copy of. A sequence
    ends its grammar with one of `eos_token_ids`."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: set[int]):
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                      eos_token=sorted(eos_token_ids) or None)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.cache: OrderedDict[tuple, llguidance.LLMatcher] = OrderedDict()
        self.hits = self.misses = 0

    def grammar(self, params: StructuredOutputsParams) -> MatcherGrammar:
        """A fresh matcher of the request's constraint; ValueError (naming structured_outputs) for a schema, regex
        or grammar that does not compile, or a schema with keywords the grammar engine does not implement."""
        key = _key(params)
        compiled = self.cache.get(key)
        if compiled is None:
            self.misses += 1
            compiled = self.cache[key] = self._compile(params)
            if len(self.cache) > GRAMMAR_CACHE_SIZE:
                self.cache.popitem(last=False)
        else:
            self.hits += 1
            self.cache.move_to_end(key)
        return MatcherGrammar(compiled.deep_copy(), self.eos_token_ids)

    def _compile(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        try:
            matcher = llguidance.LLMatcher(self.tokenizer, grammar_text(params), log_level=0, limits=_LIMITS)
        except ValueError as e:             # a grammar the GBNF converter cannot read
            raise ValueError(f"structured_outputs: {_WHAT[params.kind]} does not compile: {e}") from None
        if matcher.is_error():
            raise ValueError(f"structured_outputs: {_WHAT[params.kind]} does not compile: {matcher.get_error()}")
        return matcher

    def stats(self) -> dict:
        return {"grammars_cached": len(self.cache), "grammar_cache_hits": self.hits,
                "grammar_cache_misses": self.misses}


class MatcherGrammar:
    """A sequence's llguidance matcher. Once it has taken EOS (one of `eos_token_ids`) the grammar has ended: it
    constrains nothing after (the sequence goes on only with ignore_eos)."""

    def __init__(self, matcher: llguidance.LLMatcher, eos_token_ids: frozenset[int]):
        self.matcher, self.eos_token_ids = matcher, eos_token_ids
        self.ended = False

    @property
    def constrains(self) -> bool:
        return not self.ended

    def fill_bitmask(self, bitmask: torch.Tensor, row: int, drafts: Sequence[int] = ()) -> None:
        llguidance.torch.fill_next_token_bitmask(self.matcher, bitmask, row)
        consumed = 0
        for i, token in enumerate(drafts, start=1):
            if token in self.eos_token_ids:       # the grammar ends there: nothing after is masked
                bitmask[row + i:row + len(drafts) + 1] = -1
                break
            if not self.matcher.consume_token(token):
                raise ValueError(f"draft token {token} is not one the grammar allows (validate drafts first)")
            consumed += 1
            llguidance.torch.fill_next_token_bitmask(self.matcher, bitmask, row + i)
        self.matcher.rollback(consumed)

    def validate(self, tokens: Sequence[int]) -> int:
        if self.ended:
            return len(tokens)
        if self.matcher.is_stopped():           # complete: only EOS, which the matcher's validation does not count
            n = int(bool(tokens) and tokens[0] in self.eos_token_ids)
        else:
            n = self.matcher.validate_tokens(list(tokens))
        return next((i + 1 for i, t in enumerate(tokens[:n]) if t in self.eos_token_ids), n)

    def accept(self, token: int) -> bool:
        if self.ended:
            return True
        if not self.matcher.consume_token(token):
            return False
        self.ended = token in self.eos_token_ids
        return True

    def fork(self) -> MatcherGrammar:
        other = MatcherGrammar(self.matcher.deep_copy(), self.eos_token_ids)
        other.ended = self.ended
        return other


def grammar_text(params: StructuredOutputsParams) -> str:
    """llguidance's grammar of the constraint (ValueError for a grammar in neither Lark nor GBNF)."""
    kind = params.kind
    if kind in ("json", "json_object"):
        options = {"whitespace_flexible": not params.disable_any_whitespace}
        if params.whitespace_pattern is not None:
            options["whitespace_pattern"] = params.whitespace_pattern
        schema = _without_additional_properties(params.json) if kind == "json" else {"type": "object"}
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=options)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        return llguidance.grammar_from("choice", params.choice)
    return llguidance.grammar_from("grammar", params.grammar)


def _key(params: StructuredOutputsParams) -> tuple:
    """What makes two constraints compile alike: the kind, its spec (a schema's keys in their order: they are the
    order the output writes them in) and the JSON options."""
    spec = getattr(params, params.kind)
    if params.kind == "json":
        spec = json.dumps(spec, ensure_ascii=False)
    elif params.kind == "choice":
        spec = tuple(spec)
    return params.kind, spec, params.disable_any_whitespace, params.whitespace_pattern


def _without_additional_properties(schema):
    """The schema with additionalProperties false in each object schema that lists its properties and says
    nothing of others: as vLLM's default grammar engine (xgrammar) reads a schema, and what its
    disable_additional_properties asks of the other."""
    if not isinstance(schema, dict):
        return schema
    schema = copy.deepcopy(schema)

    def walk(node: dict) -> None:
        if "properties" in node and "additionalProperties" not in node:
            node["additionalProperties"] = False
        for sub in _subschemas(node):
            walk(sub)

    walk(schema)
    return schema


def _subschemas(node: dict):
    """The schemas a schema object holds: its properties', its items', its branches', ..."""
    for key in _SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            yield from (sub for sub in node[key].values() if isinstance(sub, dict))
    for key in _SCHEMA_LISTS:
        if isinstance(node.get(key), list):
            yield from (sub for sub in node[key] if isinstance(sub, dict))
    yield from (node[key] for key in _SCHEMA_VALUES if isinstance(node.get(key), dict))
