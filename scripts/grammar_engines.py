"""llguidance (kvserve's grammar engine) beside xgrammar on this machine: the cost of setting up a vocabulary,
compiling a JSON schema and computing a token mask, and what each lets through.

    pip install xgrammar        # not a kvserve dependency
    python scripts/grammar_engines.py [--tokenizer DIR ...]

Vocabularies: the tests' tiny BPE, the demo model's, a 32k one of placeholder words (the benches'), and any
Hugging Face tokenizer directory given. Each schema's document is walked token by token: the mask of each step
is timed (medians over three walks), then the token taken. The probes feed raw bytes as single-byte tokens.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import llguidance
import llguidance.hf
import llguidance.torch
import torch
import xgrammar as xgr
from transformers import AutoTokenizer

from kvserve.model.loader import DEMO_MODEL_DIR
from kvserve.model.random_checkpoint import make_tokenizer

SCHEMAS = [
    ({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
      "required": ["name", "age"]}, {"name": "Ada Lovelace", "age": 36}),
    ({"type": "object", "properties": {"items": {"type": "array", "items": {"type": "object", "properties": {
        "id": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}, "price": {"type": "number"},
        "kind": {"enum": ["a", "b", "c"]}}, "required": ["id", "tags", "price", "kind"]}}}, "required": ["items"]},
     {"items": [{"id": i, "tags": ["x", "yz"], "price": 1.5 * i, "kind": "b"} for i in range(6)]}),
]
# (what, schema, bytes after which a JSON parser or the schema says no)
PROBES = [
    ("control character in a string of maxLength", {"type": "string", "maxLength": 8}, b'"a\x13'),
    ("overlong UTF-8 in a string of a pattern", {"type": "string", "pattern": "^.{0,10}$"}, b'"a\xf0\x81\x86\xbd'),
    ("UTF-16 surrogate in a string", {"type": "string"}, b'"a\xed\xa0\x80'),
    ("uniqueItems (a repeated item)", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, b"[1,1]"),
    ("not (what it forbids)", {"not": {"type": "integer"}}, b"4"),
    ("allOf of two schemas (the second's bound)", {"allOf": [{"type": "integer"}, {"maximum": 5}]}, b"9"),
]


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok):
        self.info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)

    def matcher(self, schema):
        return xgr.GrammarMatcher(self.compiler.compile_json_schema(json.dumps(schema)))

    def mask(self, m, bitmask):
        m.fill_next_token_bitmask(bitmask)

    @staticmethod
    def take(m, token) -> bool:
        return m.accept_token(token)


class LLGuidance:
    name = "llguidance"

    def __init__(self, tok):
        self.tokenizer = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok))

    def matcher(self, schema):
        m = llguidance.LLMatcher(self.tokenizer, llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema)),
                                 log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def mask(self, m, bitmask):
        llguidance.torch.fill_next_token_bitmask(m, bitmask, 0)

    @staticmethod
    def take(m, token) -> bool:
        return m.consume_token(token)


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def walk(engine, schema, ids: list[int], vocab: int) -> tuple[float, list[float]]:
    """Seconds to compile (up to the first mask), and each later step's mask seconds."""
    bitmask = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
    m, compile_s = timed(lambda: engine.matcher(schema))
    _, first = timed(lambda: engine.mask(m, bitmask))
    steps = []
    for token in ids:
        assert engine.take(m, token), (engine.name, token)
        steps.append(timed(lambda: engine.mask(m, bitmask))[1])
    return compile_s + first, steps


def probe(engine, tok, schema, data: bytes) -> str:
    alphabet = bytes_to_unicode()            # a byte-level BPE holds a token of each byte
    byte_tokens = {b: tok.convert_tokens_to_ids(alphabet[b]) for b in range(256)}
    try:
        m = engine.matcher(schema)
    except (ValueError, RuntimeError) as e:
        return f"refused: {str(e).splitlines()[0][:60]}"
    return "LETS IT THROUGH" if all(engine.take(m, byte_tokens[b]) for b in data) else "stops it"


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: the character of each byte in a byte-level BPE's vocabulary."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokenizer", action="append", default=[], help="a Hugging Face tokenizer directory")
    args = p.parse_args()
    torch.set_num_threads(1)
    tokenizers = {"tiny": make_tokenizer(["The quick brown fox jumps over the lazy dog. {\"a\": 1}"] * 4, 384),
                  "demo": AutoTokenizer.from_pretrained(DEMO_MODEL_DIR),
                  "32k placeholders": make_tokenizer(total=32000),
                  **{path: AutoTokenizer.from_pretrained(path) for path in args.tokenizer}}
    print(f"{'vocabulary':28} {'engine':10} {'setup ms':>9} {'compile ms':>10} {'mask us (median, p90)':>22}")
    for name, tok in tokenizers.items():
        for cls in (XGrammar, LLGuidance):
            engine, setup = timed(lambda: cls(tok))
            compiles, steps = [], []
            for schema, doc in SCHEMAS:
                ids = tok.encode(json.dumps(doc, separators=(",", ":")), add_special_tokens=False)
                for _ in range(3):
                    c, s = walk(engine, schema, ids, len(tok))
                    compiles.append(c)
                    steps += s
            steps.sort()
            label = f"{name} ({len(tok)})"
            print(f"{label:28} {cls.name:10} {setup * 1e3:9.0f} {statistics.median(compiles) * 1e3:10.2f}"
                  f" {statistics.median(steps) * 1e6:12.1f} {steps[int(0.9 * len(steps))] * 1e6:9.1f}")
    tok = tokenizers["tiny"]
    engines = [XGrammar(tok), LLGuidance(tok)]
    print(f"\n{'probe':48} {'xgrammar':26} llguidance")
    for what, schema, data in PROBES:
        print(f"{what:48} " + " ".join(f"{probe(e, tok, schema, data):26}" for e in engines))


if __name__ == "__main__":
    main()
