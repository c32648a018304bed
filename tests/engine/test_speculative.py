"""Speculative decoding: greedy outputs equal plain decoding's token for token, with every backend and every part of
the cache; sampled ones follow the target's distribution; the configuration, refusals, limits and metrics."""
from __future__ import annotations

import argparse
import math
from collections import Counter

import numpy as np
import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.arg_utils import add_engine_args, engine_kwargs
from kvserve.config import EngineConfig
from kvserve.engine.speculative import NoSpeculation, SpeculativeConfig, ngram_lookup
from kvserve.sampling import RejectionSampler, Sampler, TokenMask
from kvserve.server.metrics import EngineCollector
from spec_oracle import NGRAM, OracleProposer, generate_ids, with_oracle
from tiny_models import HYBRID, VOCAB

WINDOW = HYBRID["gemma2"]["sliding_window"]
PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7], list(range(20, 60)), [3, 4] * 10, [11, 12, 13]]
GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


def _same_with_speculation(path, prompts=PROMPTS, params=GREEDY, miss: float = 0.3, k: int = 4, **kw) -> LLM:
    """Plain decoding's greedy outputs, then the same engine's with drafts that the test proposer (spec_oracle) gets
    right or wrong at random: the same tokens. The speculating LLM, its cache checked."""
    reference = generate_ids(LLM(str(path), **kw), prompts, params)
    llm = LLM(str(path), speculative_config={**NGRAM, "num_speculative_tokens": k}, **kw)
    with_oracle(llm, prompts, reference, miss)
    assert generate_ids(llm, prompts, params) == reference
    stats = llm.stats()
    assert stats["spec_decode_num_accepted_tokens"] > 0
    assert stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"] or miss == 0
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_usable_blocks      # every block back (but a null one)
    llm.engine.kv.check_invariants()
    return llm


# ---- the configuration ---------------------------------------------------------------------------------------------

def test_speculative_config_takes_vllms_names_and_defaults():
    spec = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max) == \
        ("ngram", 3, 4, 4)
    assert SpeculativeConfig.parse({"method": "ngram"}).prompt_lookup_min == 5          # vLLM's default
    draft = SpeculativeConfig.parse({"model": "/some/path", "num_speculative_tokens": 2})
    assert (draft.method, draft.model) == ("draft_model", "/some/path")
    assert SpeculativeConfig.parse(None) is None


@pytest.mark.parametrize("value,message", [
    ("{not json", "not JSON"),
    ([1, 2], "JSON object"),
    ({"method": "eagle"}, "method must be one of"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be a positive integer"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens must be a positive integer"),
    ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min (4) must be at most"),
    ({"method": "draft_model"}, "needs 'model'"),
    ({"method": "ngram", "model": "x"}, "takes no 'model' nor"),
    ({"model": "x", "quantization": "fp4"}, "quantization must be one of"),
    ({"method": "ngram", "speculative_model": "x"}, "unknown keys ['speculative_model']"),
])
def test_a_bad_speculative_config_is_refused_by_name(value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        EngineConfig(speculative_config=value)


def test_the_flag_takes_json():
    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'])
    config = EngineConfig(**engine_kwargs(args))
    assert SpeculativeConfig.parse(config.speculative_config).num_speculative_tokens == 2


def test_what_speculation_cannot_keep_exact_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="needs cache_mode 'paged' or 'contiguous'"):
        EngineConfig(speculative_config=NGRAM, cache_mode="none")
    with pytest.raises(ValueError, match="h2o scores the cache by the attention of every decode query"):
        EngineConfig(speculative_config=NGRAM, eviction="h2o:budget=64,recent=16")
    llm = LLM(str(tiny_llama), speculative_config=NGRAM, num_kv_blocks=64)
    with pytest.raises(ValueError, match="h2o scores"):
        llm.engine.add_request("r", [5, 6, 7], SamplingParams(eviction="h2o:budget=64,recent=16"))
    assert not llm.engine.has_unfinished_requests()


def test_a_draft_model_of_another_vocabulary_is_refused(tiny_llama, checkpoint):
    other = checkpoint("llama", vocab_size=400)
    with pytest.raises(ValueError, match=r"vocab_size \(400\) is not the target's \(384\)"):
        LLM(str(tiny_llama), speculative_config={"model": str(other)})


# ---- proposals -----------------------------------------------------------------------------------------------------

def test_ngram_lookup_takes_the_longest_suffix_and_its_latest_occurrence():
    tokens = np.array([1, 2, 3, 9, 1, 2, 3, 8, 7, 5, 2, 3])
    assert ngram_lookup(tokens, 1, 3, 3) == [8, 7, 5]          # "2 3" last seen before "8 7 5"
    assert ngram_lookup(tokens, 1, 3, 1) == [8]
    assert ngram_lookup(np.array([4, 5, 6]), 1, 3, 3) == []
    assert ngram_lookup(np.array([1, 2, 3, 1, 2, 4, 1, 2]), 3, 3, 2) == []    # no 3-gram repeats
    assert ngram_lookup(np.array([7, 7, 7]), 1, 2, 4) == [7]                    # a run copies what followed


def test_ngram_speculation_gives_plain_greedy_tokens(tiny_llama):
    params = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)
    reference = generate_ids(LLM(str(tiny_llama)), PROMPTS, params)
    llm = LLM(str(tiny_llama), speculative_config=NGRAM)
    assert generate_ids(llm, PROMPTS, params) == reference
    stats = llm.stats()
    # these random weights fall into loops that the lookup catches
    assert 0 < stats["spec_decode_num_accepted_tokens"] <= stats["spec_decode_num_draft_tokens"]
    assert sum(stats["spec_decode_num_accepted_tokens_per_pos"]) == stats["spec_decode_num_accepted_tokens"]
    assert stats["steps"]["native"] > 0


def test_a_sequence_proposes_within_max_tokens_max_model_len_and_the_batch_limit(tiny_llama):
    llm = LLM(str(tiny_llama), speculative_config={**NGRAM, "num_speculative_tokens": 8}, max_model_len=40)
    spec = llm.engine.speculator
    seq = llm.engine.add_request("a", list(range(5, 35)), SamplingParams(max_tokens=5, ignore_eos=True))
    seq.token_ids.append(7)
    assert spec.max_drafts(seq) == 5 - 1 - 1                     # one output, and a step emits drafts + 1
    seq.token_ids += [7] * 3
    assert spec.max_drafts(seq) == 0
    seq.max_tokens = 100
    assert spec.max_drafts(seq) == 40 - seq.num_tokens - 1       # max_model_len
    llm = LLM(str(tiny_llama), speculative_config={**NGRAM, "disable_by_batch_size": 2}, num_scheduler_steps=1)
    generate_ids(llm, PROMPTS[:3], GREEDY)
    assert llm.stats()["spec_decode_num_drafts"] == 0           # three run: past 2, nobody proposes
    generate_ids(llm, PROMPTS[:2], GREEDY)
    assert llm.stats()["spec_decode_num_drafts"] > 0


def test_drafts_fit_the_token_budget_and_never_preempt(tiny_llama):
    """A budget of 3 tokens verifies at most 2 drafts; a pool with room for plain decoding alone: drafts shrink
    rather than preempt anyone."""
    prompts = [list(range(5, 9)), list(range(40, 44))]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    kw = dict(block_size=4, num_kv_blocks=8, max_num_batched_tokens=8, max_num_seqs=2)
    plain = LLM(str(tiny_llama), **kw)
    reference = generate_ids(plain, prompts, params)
    assert plain.stats()["num_preemptions"] == 0
    llm = LLM(str(tiny_llama), speculative_config={**NGRAM, "num_speculative_tokens": 6}, **kw)
    with_oracle(llm, prompts, reference, miss=0.0)
    seen = []
    scheduler = llm.engine.scheduler
    schedule = scheduler.schedule
    scheduler.schedule = lambda: seen.append(out := schedule()) or out
    assert generate_ids(llm, prompts, params) == reference
    assert llm.stats()["num_preemptions"] == 0
    assert all(sum(out.num_new_tokens) <= 8 for out in seen)
    assert any(sum(out.num_spec_tokens) for out in seen)


# ---- greedy tokens equal plain decoding's, everywhere ----------------------------------------------------------------

@pytest.mark.parametrize("kw", [
    {},
    {"enforce_eager": True},
    {"attention_backend": "sdpa"},
    {"attention_backend": "flash"},
    {"attention_backend": "textbook"},
    {"cache_mode": "contiguous", "max_model_len": 96},
    {"dtype": "bfloat16"},
], ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "native")
def test_every_backend_verifies_drafts_exactly(tiny_llama, kw):
    llm = _same_with_speculation(tiny_llama, **kw)
    if not kw:       # every decode and verification by the C step: the prompts alone op by op
        assert llm.stats()["steps"]["eager"] == 1


def test_triton_verifies_drafts_exactly(tiny_llama):
    """Under Triton's interpreter here: a short run."""
    _same_with_speculation(tiny_llama, PROMPTS[:1], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
                           attention_backend="triton", block_size=4)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8", "int4"])
def test_quantized_pages_see_only_accepted_tokens(tiny_llama, kv_cache_dtype):
    _same_with_speculation(tiny_llama, kv_cache_dtype=kv_cache_dtype, block_size=4)


def test_forks_prefix_caching_and_preemption(tiny_llama):
    prompts = [list(range(5, 23)), list(range(5, 23)) + [40, 41], list(range(5, 19)) + [50], [60, 61, 62]]
    params = [SamplingParams(n=2, max_tokens=24, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)]
    llm = _same_with_speculation(tiny_llama, prompts, params, block_size=4, num_kv_blocks=24, max_num_seqs=5)
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0


def test_logprobs_are_plain_decodings(tiny_llama):
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=3)
    plain = LLM(str(tiny_llama)).generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    llm = LLM(str(tiny_llama), speculative_config=NGRAM)
    with_oracle(llm, PROMPTS, [[o.outputs[0].token_ids] for o in plain], miss=0.3)
    spec = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for a, b in zip(plain, spec):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert x.keys() == y.keys() and all(abs(x[t].logprob - y[t].logprob) < 1e-5 for t in x)
    assert spec[0].metrics["spec_decode_num_draft_tokens"] >= spec[0].metrics["spec_decode_num_accepted_tokens"] > 0


def test_logits_processors_and_stops_see_the_drafts_before_them(tiny_llama):
    """min_tokens, bad_words, logit_bias, allowed_token_ids at each verified position, and stops among accepted
    drafts (the tokens after them dropped) as plain decoding sees them."""
    params = [SamplingParams(max_tokens=30, temperature=0, min_tokens=10, stop_token_ids=[265, 7]),
              SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, logit_bias={40: 3.0, 41: 2.0}),
              SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, allowed_token_ids=list(range(20, 60))),
              SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, bad_words=["fox", "cache"]),
              SamplingParams(max_tokens=30, temperature=0, stop=["e"], ignore_eos=True)]
    _same_with_speculation(tiny_llama, PROMPTS + [PROMPTS[1]], params)


def test_a_hybrid_cache_releases_past_the_window_as_plain_decoding(gemma2, mistral):  # noqa: F811
    for path in (gemma2, mistral):
        for backend in ("native", "sdpa"):
            _same_with_speculation(path, block_size=4, num_kv_blocks=64, attention_backend=backend,
                                   long_prefill_token_threshold=12)


def test_sink_eviction_verifies_no_draft_across_an_eviction(tiny_llama, gemma2):  # noqa: F811
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    for path in (tiny_llama, gemma2):
        llm = _same_with_speculation(path, params=params, eviction=f"sink:sinks=4,window={WINDOW + 4}", block_size=4,
                                     num_kv_blocks=64, long_prefill_token_threshold=12, miss=0.1)
        assert llm.stats()["num_evicted_tokens"] > 0


def test_forked_samples_under_sink_eviction_rotate_sinks_of_their_own(tiny_llama):
    """A request's n samples share its sink's working copies when they fork; each accepts drafts at its own pace, so
    each evicts at its own steps, and rotates working copies of its own: every sample gives plain decoding's tokens."""
    prompt = list(range(5, 13)) + list(range(100, 114))
    params = SamplingParams(n=3, max_tokens=15, temperature=0, ignore_eos=True)
    llm = _same_with_speculation(tiny_llama, [prompt], params, miss=0.5, k=1, eviction="sink:sinks=2,window=12",
                                 block_size=3, long_prefill_token_threshold=8)
    assert llm.stats()["num_evicted_tokens"] > 0


def test_snapkv_evicts_the_prompt_before_any_draft(tiny_llama):
    prompts = [list(range(5, 45)), list(range(60, 100))]
    _same_with_speculation(tiny_llama, prompts, eviction="snapkv:budget=16,window=4", block_size=4)


def test_the_disk_tier_holds_verified_blocks(tiny_llama, tmp_path):
    prompts = [list(range(5, 30)), list(range(40, 65))]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    kw = dict(block_size=4, num_kv_blocks=24, kv_offload=f"disk:{tmp_path}/tier", kv_offload_size="1MiB")
    llm = _same_with_speculation(tiny_llama, prompts, params, **kw)
    # a prompt that continues one of the outputs finds its blocks in the tier, and gives plain decoding's tokens
    more = [prompts[0] + generate_ids(llm, prompts[:1], params)[0][0][:20]]
    llm.engine.speculator = NoSpeculation()
    assert generate_ids(llm, more, params) == generate_ids(LLM(str(tiny_llama), block_size=4), more, params)
    assert llm.stats()["kv_offload_hit_tokens"] + llm.stats()["prefix_cache_hits"] > 0


def test_two_ranks_verify_drafts(tiny_llama):
    for eager in (False, True):
        llm = LLM(str(tiny_llama), tensor_parallel_size=2, dtype="float32", enforce_eager=eager,
                  speculative_config=NGRAM, enable_prefix_caching=False)
        try:
            speculator, llm.engine.speculator = llm.engine.speculator, NoSpeculation()
            reference = generate_ids(llm, PROMPTS, GREEDY)
            llm.engine.speculator = speculator
            with_oracle(llm, PROMPTS, reference, miss=0.3)
            assert generate_ids(llm, PROMPTS, GREEDY) == reference
            assert llm.stats()["spec_decode_num_accepted_tokens"] > 0
            assert llm.stats()["steps"]["eager_tp" if eager else "native_tp"] > 0
        finally:
            llm.shutdown()


# ---- a draft model -------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def draft(checkpoint):
    """A one-layer random model of the tiny checkpoints' tokenizer."""
    return checkpoint("llama", seed=1, num_hidden_layers=1, hidden_size=32,
                      intermediate_size=64)


@pytest.mark.parametrize("eager", [False, True])
def test_a_draft_model_gives_plain_greedy_tokens(tiny_llama, draft, eager):
    prompts = PROMPTS + [PROMPTS[1]]
    params = [GREEDY] * 3 + [SamplingParams(n=2, max_tokens=30, temperature=0, ignore_eos=True)] * 2
    # a pool that preempts, and a budget that cuts drafts short (a sequence then gains a token unverified)
    kw = dict(enforce_eager=eager, block_size=4, num_kv_blocks=30, max_num_seqs=4, max_num_batched_tokens=12)
    reference = generate_ids(LLM(str(tiny_llama), **kw), prompts, params)
    # a random draft; the target as its own draft (every draft right); the target with int8 weights as its own
    for path, quantization, accepted in ((draft, None, None), (tiny_llama, None, 1.0), (tiny_llama, "int8", None)):
        llm = LLM(str(tiny_llama), speculative_config={"model": str(path), "num_speculative_tokens": 3,
                                                       "quantization": quantization}, **kw)
        assert generate_ids(llm, prompts, params) == reference
        stats = llm.stats()
        assert stats["spec_decode_num_draft_tokens"] > 0
        if accepted:
            assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"]
        assert stats["num_preemptions"] > 0
        proposer = llm.engine.speculator.proposer
        assert not proposer.mirrors and proposer.kv.num_free_blocks == proposer.kv.num_blocks
        if not eager:       # its catch-ups by the C step too (a verification's rows): prompts alone op by op
            assert proposer.runner.steps["native"] > 2 * proposer.runner.steps["eager"]


# ---- sampling follows the target's distribution ------------------------------------------------------------------

# the chi-square statistic a right sampler exceeds with probability 1e-4, by degrees of freedom (scipy.stats.chi2.isf)
CHI2_BOUND = {2: 18.42, 3: 21.11, 4: 23.51, 15: 44.26}


def _chi_square(counts: list[int], probs: list[float]) -> float:
    """The chi-square statistic of counts against probs; with a fixed seed, a bound of CHI2_BOUND never flakes."""
    n = sum(counts)
    return sum((c - p * n) ** 2 / (p * n) for c, p in zip(counts, probs))


def test_rejection_sampling_draws_from_the_targets_distribution():
    """Five tokens; a draft of 2 tokens, right or wrong: each emitted token's law is the target's p, whatever the
    drafts (one-hot proposals accepted with p(d), else drawn from p less d). 20,000 rows, a fixed seed, and a
    chi-square bound that a right sampler passes with probability 1 - 1e-4 (CHI2_BOUND)."""
    torch.manual_seed(0)
    p0 = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    p1 = torch.tensor([0.1, 0.1, 0.3, 0.3, 0.2])
    p2 = torch.tensor([0.25, 0.25, 0.25, 0.125, 0.125])
    rows = 20_000
    sampler = RejectionSampler(Sampler(torch.Generator().manual_seed(1)))
    params = [SamplingParams(temperature=1.0)] * rows
    drafts = [[0, 2]] * (rows // 2) + [[3, 4]] * (rows // 2)      # a likely draft, and an unlikely one
    logits = torch.stack([p0.log(), p1.log(), p2.log()]).repeat(rows, 1)      # each row's three, in turn
    results = sampler(logits, drafts, params, [None] * rows, [([], 0)] * rows)
    first = Counter(r.token_ids[0] for r in results)
    assert _chi_square([first[t] for t in range(5)], p0.tolist()) < CHI2_BOUND[4]
    # after an accepted first draft (0 or 3, whichever it was) the next token follows p1
    second = Counter(r.token_ids[1] for r in results if r.num_accepted >= 1)
    assert _chi_square([second[t] for t in range(5)], p1.tolist()) < CHI2_BOUND[4]
    accepted_first = sum(r.num_accepted >= 1 for r in results[:rows // 2]) / (rows // 2)
    assert abs(accepted_first - 0.5) < 0.02                       # p0(0): the chance draft 0 is kept
    # and greedy rows keep the drafts that are the argmax, then the argmax
    greedy = sampler(logits[:6], [[0, 2], [1, 2]], [SamplingParams(temperature=0)] * 2, [None] * 2, [([], 0)] * 2)
    assert [(r.token_ids, r.num_accepted) for r in greedy] == [([0, 2, 0], 2), ([0], 0)]


def test_rejection_sampling_within_masks_draws_from_the_masked_distribution():
    """A grammar's masks on a verification's rows (tokens 1 and 4 forbidden first, then token 0; nothing after) and
    drafts that they allow, as propose leaves them: each emitted token follows p renormalized over the tokens its
    row allows, never another; a greedy row's argmax is the mask's."""
    p0 = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    p1 = torch.tensor([0.1, 0.1, 0.3, 0.3, 0.2])
    rows = 20_000
    bias = torch.zeros(3, 5)
    bias[0, [1, 4]] = bias[1, 0] = -math.inf
    sampler = RejectionSampler(Sampler(torch.Generator().manual_seed(2)))
    drafts = [[0, 2]] * (rows // 2) + [[3, 4]] * (rows // 2)
    logits = torch.stack([p0.log(), p1.log(), p1.log()]).repeat(rows, 1)
    mask = TokenMask(list(range(3 * rows)), bias.repeat(rows, 1))
    results = sampler(logits, drafts, [SamplingParams(temperature=1.0)] * rows, [None] * rows, [([], 0)] * rows,
                      mask)
    first = Counter(r.token_ids[0] for r in results)
    assert set(first) <= {0, 2, 3}
    allowed = p0[[0, 2, 3]] / p0[[0, 2, 3]].sum()
    assert _chi_square([first[t] for t in (0, 2, 3)], allowed.tolist()) < CHI2_BOUND[2]
    second = Counter(r.token_ids[1] for r in results if r.num_accepted >= 1)
    assert set(second) <= {1, 2, 3, 4}
    allowed = p1[1:] / p1[1:].sum()
    assert _chi_square([second[t] for t in (1, 2, 3, 4)], allowed.tolist()) < CHI2_BOUND[3]
    greedy = sampler(torch.stack([p1.log(), p0.log(), p1.log()]), [[3, 4]], [SamplingParams(temperature=0)],
                     [None], [([], 0)], TokenMask([0, 1, 2], bias))
    assert (greedy[0].token_ids, greedy[0].num_accepted) == ([2], 0)     # the masked argmax of row 0, not draft 3


def _allowed_probs(llm: LLM, prompt: list[int], allowed: list[int]) -> list[float]:
    """The model's next-token probabilities of `allowed` after prompt, renormalized over them (what sampling at
    temperature 1 with allowed_token_ids draws from), from plain decoding's logprobs of the whole vocabulary."""
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, temperature=0, logprobs=VOCAB),
                       use_tqdm=False)[0]
    weights = [math.exp(out.outputs[0].logprobs[0][t].logprob) for t in allowed]
    return [w / sum(weights) for w in weights]


def test_sampled_outputs_follow_the_targets_distribution(tiny_llama):
    """Four allowed tokens at temperature 1: the pairs of the first two sampled tokens of 3,000 seeded requests of
    three tokens, whose second comes from a verification of one draft (the test proposer's, the same token whatever
    the text: often right, often wrong), against the exact probabilities from plain decoding's logprobs."""
    allowed, prompt = [30, 31, 32, 33], [5, 6, 7, 8]
    plain = LLM(str(tiny_llama))
    first = _allowed_probs(plain, prompt, allowed)
    probs = {(a, b): pa * pb for a, pa in zip(allowed, first)
             for b, pb in zip(allowed, _allowed_probs(plain, prompt + [a], allowed))}
    llm = LLM(str(tiny_llama), speculative_config={**NGRAM, "num_speculative_tokens": 2, "disable_by_batch_size": 256},
              num_scheduler_steps=1)
    llm.engine.speculator.proposer = OracleProposer({}, miss=0.0, fallback=[31])
    n = 3000
    outs = llm.generate([{"prompt_token_ids": prompt}] * n,
                        [SamplingParams(max_tokens=3, temperature=1.0, allowed_token_ids=allowed, ignore_eos=True,
                                        seed=i) for i in range(n)], use_tqdm=False)
    pairs = Counter(tuple(o.outputs[0].token_ids[:2]) for o in outs)
    cells = sorted(probs)
    assert _chi_square([pairs[c] for c in cells], [probs[c] for c in cells]) < CHI2_BOUND[15]
    stats = llm.stats()
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]


def test_seeded_sampling_with_speculation_is_reproducible(tiny_llama):
    params = [SamplingParams(max_tokens=30, temperature=0.8, top_k=20, seed=s, ignore_eos=True) for s in range(4)]
    runs = [generate_ids(LLM(str(tiny_llama), speculative_config=NGRAM), PROMPTS, params) for _ in range(2)]
    assert runs[0] == runs[1]


# ---- what it shows -------------------------------------------------------------------------------------------------

def test_metrics_use_vllms_spec_decode_names(tiny_llama):
    llm = _same_with_speculation(tiny_llama)
    families = {f.name: f for f in EngineCollector(llm.stats, "m").collect()}
    stats = llm.stats()
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert families[f"kvserve:spec_decode_{name}"].samples[0].value == stats[f"spec_decode_{name}"]
    per_pos = families["kvserve:spec_decode_num_accepted_tokens_per_pos"].samples
    assert [s.labels["position"] for s in per_pos] == ["0", "1", "2", "3"]
    assert sum(s.value for s in per_pos) == stats["spec_decode_num_accepted_tokens"]
    assert "kvserve:spec_decode_num_drafts" not in {f.name for f in EngineCollector(LLM(str(tiny_llama)).stats,
                                                                                        "m").collect()}
