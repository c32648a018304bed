"""Every pair of features composes: an engine with both gives the greedy tokens of the engine without those of the
pair that must not change them (tensor parallelism, the disk tier, prefix caching, the hybrid cache's layer
groups, n > 1 forks, n-gram speculation), with the ones that do change them (quantized weights and pages, sink
eviction, sparse attention under a budget smaller than the contexts) kept; or it refuses the pair with a reason a
user accepts, listed in REFUSED. A request's structured output composes with each feature alike: the same tokens
with those that must not change them, and a valid output with the others."""
from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass, field

import jsonschema
import pytest
from transformers import AutoTokenizer

from kvserve import LLM, SamplingParams
from kvserve.structured import StructuredOutputsParams

BLOCK = 4
SYSTEM = list(range(3, 31))            # a shared prefix of seven blocks
PROMPTS = [SYSTEM + [40, 41, 42], SYSTEM + [50, 51], list(range(100, 133))]
MAX_TOKENS = 10
# a schema whose every output is short (it ends well within max_tokens), the model's choice in each field
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["s", "m", "l"]},
                                           "name": {"type": "string", "maxLength": 6}},
          "required": ["ok", "size", "name"], "additionalProperties": False}
STRUCTURED = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)


@dataclass(frozen=True)
class Feature:
    """An engine option. `exact`: the tokens are those of the engine without it."""

    kwargs: dict = field(default_factory=dict)
    exact: bool = True


FEATURES = {
    "tp2": Feature({"tensor_parallel_size": 2}),
    "int8_weights": Feature({"quantization": "int8"}, exact=False),
    "int4_weights": Feature({"quantization": "int4"}, exact=False),
    "int8_pages": Feature({"kv_cache_dtype": "int8"}, exact=False),
    "int4_pages": Feature({"kv_cache_dtype": "int4"}, exact=False),
    "disk_tier": Feature(),             # kv_offload on a directory of its own, served again after a restart
    "sink": Feature({"eviction": "sink:sinks=4,window=12"}, exact=False),
    "prefix_caching": Feature(),        # on; the engine without it: enable_prefix_caching=False
    "hybrid": Feature(),                # a Gemma-3-shaped model; without: one block table for every layer
    "n2": Feature(),                    # two greedy samples of each prompt, forked from one prompt
    # four of a context's blocks read (of up to eleven) in every layer that sees the whole context
    "sparse": Feature({"sparse_attention": "quest:budget=16,recent=4,sinks=4,dense_layers=0"}, exact=False),
    # drafts copied from earlier text, verified greedily: the tokens of plain decoding; a step a call, since a
    # sequence without drafts would otherwise decode several greedy steps in one native call, proposing nothing;
    # drafts at every batch these tests run
    "ngram": Feature({"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                             "prompt_lookup_max": 3, "disable_by_batch_size": 64},
                      "num_scheduler_steps": 1}),
}
# pairs an engine refuses, and what its error says
REFUSED: dict[frozenset, str] = {}
# two values of one option (int8 and int4 weights, or pages) are no pair
PAIRS = [frozenset(p) for p in itertools.combinations(FEATURES, 2)
         if not FEATURES[p[0]].kwargs.keys() & FEATURES[p[1]].kwargs.keys()]


@pytest.fixture(scope="module")
def models(checkpoint):
    llama = checkpoint("llama", initializer_range=0.05)
    gemma3 = checkpoint("gemma3", sliding_window=8, head_dim=16,
                        num_hidden_layers=3, sliding_window_pattern=3, initializer_range=0.05)
    return {"llama": llama, "gemma3": gemma3}


def engine_kwargs(features: set[str], exact: bool) -> dict:
    """The options of an engine with `features` (exact: only those that change the tokens)."""
    kwargs = dict(block_size=BLOCK, num_kv_blocks=96, dtype="float32", enable_prefix_caching="prefix_caching" in
                  features and not exact or "disk_tier" in features and not exact)
    for name in features:
        if not exact or not FEATURES[name].exact:
            kwargs.update(FEATURES[name].kwargs)
    if "hybrid" in features and exact:
        kwargs["disable_hybrid_kv_cache_manager"] = True
    return kwargs


def run(path, kwargs: dict, n: int, tier=None, structured: bool = False) -> tuple[list[list], dict]:
    """Each prompt's greedy samples (CompletionOutputs) and the engine's stats; `structured`: each follows SCHEMA
    and ends where it does; with a `tier`, the engine first serves the prompts and closes, and a second engine over
    the tier serves them again (what is returned)."""
    if structured:
        params = SamplingParams(n=n, max_tokens=64, temperature=0, structured_outputs=STRUCTURED)
    else:
        params = SamplingParams(n=n, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    if tier is not None:
        kwargs = dict(kwargs, kv_offload=f"disk:{tier}", kv_offload_size="16MiB")
        first = LLM(str(path), **kwargs)
        first.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        first.engine.close()
        first.shutdown()
    llm = LLM(str(path), **kwargs)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        return [out.outputs for out in outs], llm.stats()
    finally:
        llm.engine.close()
        llm.shutdown()


_references: dict = {}


def reference(path, kwargs: dict, structured: bool = False) -> list[list[int]]:
    """Each prompt's greedy tokens on the engine of `kwargs`."""
    key = (str(path), tuple(sorted(kwargs.items())), structured)
    if key not in _references:
        _references[key] = [samples[0].token_ids for samples in run(path, kwargs, 1, structured=structured)[0]]
    return _references[key]


def tokens(samples: list[list]) -> list[list[list[int]]]:
    return [[o.token_ids for o in outputs] for outputs in samples]


def check_features_ran(features: set[str], stats: dict) -> None:
    """Each feature did what it is for."""
    if "tp2" in features:
        assert stats["tensor_parallel_size"] == 2
    if "disk_tier" in features:
        assert stats["kv_offload_hit_tokens"] > 0
    if "prefix_caching" in features:      # from the pool, or the tier where a restarted engine's pool is empty
        assert stats["prefix_cache_hits"] + stats.get("kv_offload_hit_tokens", 0) > 0
    if "sink" in features:
        assert stats["num_evicted_tokens"] > 0
    if "sparse" in features:
        read, total = stats["sparse_blocks_read"], stats["sparse_blocks_total"]
        # quantized pages in blocks of 4 hold no more bytes than the float32 summaries that choosing among them
        # reads: choosing never pays (kv/sparse.py's selection_pays), and every block is read
        assert 0 < read == total if features & {"int8_pages", "int4_pages"} else 0 < read < total
    if "ngram" in features:   # drafts were verified; and some kept, but where the Gemma-3 model's ten tokens repeat
        # too little for the lookup, and where sink eviction's window leaves room for few drafts before it evicts
        assert stats["spec_decode_num_draft_tokens"] > 0
        assert stats["spec_decode_num_accepted_tokens"] > 0 or features & {"hybrid", "sink"}
    if "hybrid" in features:      # a group of the global layer, one of each sliding layer (window 8)
        assert [g["sliding_window"] for g in stats["kv_groups"]] == [None, 8, 8]
    for name in ("int8_pages", "int4_pages"):
        if name in features:
            assert stats["kv_cache_dtype"] == re.sub("_pages", "", name)


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: "+".join(sorted(p)))
def test_a_pair_of_features_composes(pair, models, tmp_path):
    path = models["gemma3" if "hybrid" in pair else "llama"]
    kwargs = engine_kwargs(set(pair), exact=False)
    n = 2 if "n2" in pair else 1
    tier = tmp_path / "tier" if "disk_tier" in pair else None
    if pair in REFUSED:
        with pytest.raises(ValueError, match=REFUSED[pair]):
            run(path, kwargs, n, tier)
        return
    got, stats = run(path, kwargs, n, tier)
    expected = reference(path, engine_kwargs(set(pair), exact=True))
    assert tokens(got) == [[t] * n for t in expected]
    check_features_ran(set(pair), stats)


@pytest.mark.parametrize("feature", FEATURES)
def test_structured_outputs_compose_with_each_feature(feature, models, tmp_path):
    """A JSON-schema-constrained greedy request: with a feature that must not change the tokens, those of the engine
    without it; with one that does, an output that still ends by EOS and validates."""
    path = models["gemma3" if feature == "hybrid" else "llama"]
    n = 2 if feature == "n2" else 1
    tier = tmp_path / "tier" if feature == "disk_tier" else None
    got, stats = run(path, engine_kwargs({feature}, exact=False), n, tier, structured=True)
    tokenizer = AutoTokenizer.from_pretrained(path)
    for samples in got:
        for o in samples:       # the tokens alone: a text's first bytes may complete the prompt's last character
            assert o.finish_reason == "stop", o
            jsonschema.validate(json.loads(tokenizer.decode(o.token_ids, skip_special_tokens=True)), SCHEMA)
    if FEATURES[feature].exact:
        expected = reference(path, engine_kwargs({feature}, exact=True), structured=True)
        assert tokens(got) == [[t] * n for t in expected]
    assert stats["grammar_masks_overlapped"] > 0
    check_features_ran({feature}, stats)
