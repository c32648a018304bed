"""Structured outputs: a request's output held to a JSON schema, a regex, a choice of strings or a grammar.

params.py    StructuredOutputsParams (vLLM's fields), checked when made
grammar.py   the Grammar a sequence advances token by token (NO_GRAMMAR: none)
backend.py   the grammar engine, llguidance: compiled constraints (cached) and each sequence's matcher
manager.py   StructuredOutputManager: the engine's part: grammars for new requests, each step's masks
"""
from kvserve.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
