"""Every pair of features composes: an engine with both gives the greedy tokens of the engine without those of the
pair that must not change them (tensor parallelism, the disk tier, prefix caching, the hybrid cache's layer
groups, n > 1 forks), with the ones that do change them (quantized weights and pages, sink eviction) kept; or
it refuses the pair with a reason a user accepts, listed in REFUSED."""
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field

import pytest

from kvserve import LLM, SamplingParams

BLOCK = 4
SYSTEM = list(range(3, 31))            # a shared prefix of seven blocks
PROMPTS = [SYSTEM + [40, 41, 42], SYSTEM + [50, 51], list(range(100, 133))]
MAX_TOKENS = 10


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


def run(path, kwargs: dict, n: int, tier=None) -> tuple[list[list[int]], dict]:
    """Each prompt's greedy samples' tokens and the engine's stats; with a `tier`, the engine first serves the
    prompts and closes, and a second engine over the tier serves them again (what is returned)."""
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
        return [[o.token_ids for o in out.outputs] for out in outs], llm.stats()
    finally:
        llm.engine.close()
        llm.shutdown()


_references: dict = {}


def reference(path, kwargs: dict) -> list[list[int]]:
    key = (str(path), tuple(sorted(kwargs.items())))
    if key not in _references:
        _references[key] = [samples[0] for samples in run(path, kwargs, 1)[0]]
    return _references[key]


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
    assert got == [[tokens] * n for tokens in expected]
    # each feature did what it is for
    if "tp2" in pair:
        assert stats["tensor_parallel_size"] == 2
    if "disk_tier" in pair:
        assert stats["kv_offload_hit_tokens"] > 0
    if "prefix_caching" in pair:      # from the pool, or the tier where a restarted engine's pool is empty
        assert stats["prefix_cache_hits"] + stats.get("kv_offload_hit_tokens", 0) > 0
    if "sink" in pair:
        assert stats["num_evicted_tokens"] > 0
    if "hybrid" in pair:      # a group of the global layer, one of each sliding layer (window 8)
        assert [g["sliding_window"] for g in stats["kv_groups"]] == [None, 8, 8]
    for name in ("int8_pages", "int4_pages"):
        if name in pair:
            assert stats["kv_cache_dtype"] == re.sub("_pages", "", name)
