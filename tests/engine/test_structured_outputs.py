"""Structured outputs offline: every output follows its JSON schema, regex, choice or grammar, in every sampling
mode, with n > 1, preemption, prefix caching, stop strings and max_tokens; errors name the field; the masks are
computed while the model runs, and the multi-step C path never takes a constrained request."""
from __future__ import annotations

import json
import random
import re

import jsonschema
import numpy as np
import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.engine.speculative import Proposer
from kvserve.sampling import Sampler, TokenMask
from kvserve.structured import StructuredOutputsParams
from schemas import demo_schemas
from spec_oracle import OracleProposer
from tiny_models import VOCAB

PROMPTS = ["The quick brown fox", "def fibonacci(n):", "Paged attention splits", "import os"]
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 10},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["admin", "user", "guest"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
    "score": {"anyOf": [{"type": "boolean"}, {"type": "null"}]},
}, "required": ["name", "age", "role", "tags"]}
REGEX = r"[a-z]{2,6}-[0-9]{3}"
CHOICE = ["yes", "no", "not sure"]
# sums of one-digit numbers
EBNF = 'root ::= num (" + " num){0,3}\nnum ::= [1-9]'
MODES = {"greedy": dict(temperature=0), "temperature": dict(temperature=1.0, seed=7),
         "top_k_top_p": dict(temperature=0.9, top_k=8, top_p=0.8, seed=3), "min_p": dict(temperature=1.2, min_p=0.1)}


def json_params(**kw) -> StructuredOutputsParams:
    return StructuredOutputsParams(json=PERSON, disable_any_whitespace=True, **kw)


# (json_object is any object: a random model's keys run on past any max_tokens but greedily, test_json_object)
CONSTRAINTS = {"json": json_params(), "regex": StructuredOutputsParams(regex=REGEX),
               "choice": StructuredOutputsParams(choice=CHOICE), "grammar": StructuredOutputsParams(grammar=EBNF)}


def check(kind: str, text: str) -> None:
    """The text follows the constraint `kind` (CONSTRAINTS) in full."""
    if kind == "json":
        jsonschema.validate(json.loads(text), PERSON)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICE
    else:
        assert re.fullmatch(r"[1-9]( \+ [1-9]){0,3}", text), text


@pytest.fixture(scope="module")
def ckpt(checkpoint):
    return checkpoint("llama", max_position_embeddings=512)


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(str(ckpt), block_size=4, num_kv_blocks=512, max_model_len=512)


def generate(llm: LLM, prompts, **params):
    return llm.generate(prompts, SamplingParams(**params), use_tqdm=False)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", CONSTRAINTS)
def test_every_output_follows_its_constraint_in_every_sampling_mode(llm, kind, mode):
    for out in generate(llm, PROMPTS, max_tokens=160, structured_outputs=CONSTRAINTS[kind], **MODES[mode]):
        (c,) = out.outputs
        assert c.finish_reason == "stop" and c.token_ids[-1] == 1, c     # ended by EOS, which the grammar allows last
        check(kind, c.text)


def test_json_object_is_any_object(llm):
    for out in generate(llm, PROMPTS, temperature=0, max_tokens=160,
                        structured_outputs=StructuredOutputsParams(json_object=True)):
        assert out.outputs[0].finish_reason == "stop" and isinstance(json.loads(out.outputs[0].text), dict)


def test_a_batch_mixes_constrained_and_free_requests(llm):
    """The free requests of a batch sample as they do alone; every constrained row of it follows its own grammar."""
    free = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], free, use_tqdm=False)]
    kinds = list(CONSTRAINTS)
    params = [free, *(SamplingParams(max_tokens=160, temperature=0.8, seed=i, structured_outputs=CONSTRAINTS[k])
                      for i, k in enumerate(kinds)), free]
    outs = llm.generate([PROMPTS[0], *PROMPTS[1:2] * len(kinds), PROMPTS[1]], params, use_tqdm=False)
    assert [outs[0].outputs[0].token_ids, outs[-1].outputs[0].token_ids] == alone
    for kind, out in zip(kinds, outs[1:-1]):
        check(kind, out.outputs[0].text)


def test_n_samples_fork_the_grammar_with_the_sequence(llm):
    """Each of n samples advances a grammar of its own, forked from the prompt's: they differ and all follow it; the
    forked samples' first masks are the only ones computed after the forward."""
    before = llm.stats()["grammar_masks_inline"]
    (out,) = generate(llm, PROMPTS[0], n=4, temperature=1.0, seed=11, max_tokens=160, structured_outputs=json_params())
    assert len({c.text for c in out.outputs}) > 1
    for c in out.outputs:
        assert c.finish_reason == "stop"
        check("json", c.text)
    assert llm.stats()["grammar_masks_inline"] - before == 3


def test_masks_are_computed_while_the_model_runs_and_compiled_once(llm):
    stats = llm.stats()
    params = StructuredOutputsParams(choice=["cached", "twice"])
    generate(llm, PROMPTS[:2], temperature=0, max_tokens=8, structured_outputs=params)
    after = llm.stats()
    assert after["grammar_cache_misses"] - stats["grammar_cache_misses"] == 1
    assert after["grammar_cache_hits"] - stats["grammar_cache_hits"] == 1
    assert after["grammar_masks_overlapped"] - stats["grammar_masks_overlapped"] >= 2
    assert after["grammar_masks_inline"] == stats["grammar_masks_inline"]


def test_max_tokens_cuts_the_output_with_finish_reason_length(llm):
    """A grammar that cannot finish within max_tokens ends as vLLM's: "length", its tokens a prefix the grammar
    takes."""
    for out in generate(llm, PROMPTS, temperature=0, max_tokens=5, structured_outputs=json_params()):
        c = out.outputs[0]
        assert c.finish_reason == "length" and len(c.token_ids) == 5
        grammar = llm.engine.structured.grammar(SamplingParams(structured_outputs=json_params()))
        assert all(grammar.accept(t) for t in c.token_ids) and grammar.constrains


def test_a_stop_string_ends_the_output_within_the_grammar(llm):
    (out,) = generate(llm, PROMPTS[0], temperature=0, max_tokens=160, stop=['"age"'], structured_outputs=json_params())
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == '"age"'
    assert c.text.startswith('{"name":"') and c.text.endswith('",')


def test_preemption_keeps_each_sequence_s_grammar(ckpt, llm):
    """A pool too small for the batch preempts and recomputes sequences: each keeps its tokens, so its grammar's
    state, and the greedy outputs are those of a pool that never preempts."""
    small = LLM(str(ckpt), block_size=4, num_kv_blocks=24, max_model_len=512)
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=json_params())
    outs = small.generate(PROMPTS, params, use_tqdm=False)
    assert small.stats()["num_preemptions"] > 0
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in
                                                      llm.generate(PROMPTS, params, use_tqdm=False)]


def test_prefix_caching_serves_constrained_requests(ckpt):
    llm = LLM(str(ckpt), block_size=4, num_kv_blocks=256, max_model_len=512, enable_prefix_caching=True)
    prompt = PROMPTS[1] * 4
    params = dict(temperature=0, max_tokens=160, structured_outputs=json_params())
    first, second = (generate(llm, prompt, **params)[0] for _ in range(2))
    assert second.num_cached_tokens > 0 and first.outputs[0].text == second.outputs[0].text
    check("json", second.outputs[0].text)


def test_the_multi_step_c_path_never_takes_a_constrained_request(ckpt):
    llm = LLM(str(ckpt), block_size=4, num_kv_blocks=128, max_model_len=512, num_scheduler_steps=8)
    if "native_multi_step" not in llm.stats()["steps"]:
        pytest.skip("no native executors here (the C kernels are not built)")
    generate(llm, PROMPTS, temperature=0, max_tokens=160, structured_outputs=json_params())
    assert llm.stats()["steps"]["native_multi_step"] == 0
    generate(llm, PROMPTS, temperature=0, max_tokens=16, ignore_eos=True)
    assert llm.stats()["steps"]["native_multi_step"] > 0


@pytest.mark.parametrize("params, message", [
    (StructuredOutputsParams(json={"type": "frob"}), "the JSON schema does not compile: Invalid type: frob"),
    (StructuredOutputsParams(json={"type": "array", "uniqueItems": True}), 'Unimplemented keys: ["uniqueItems"]'),
    (StructuredOutputsParams(json={"type": "object", "properties": {"a": {"not": {"type": "null"}}}}),
     'Unimplemented keys: ["not"]'),
    (StructuredOutputsParams(regex="a(b"), "the regex does not compile"),
    (StructuredOutputsParams(grammar='root ::= undefined_rule'), "the grammar (Lark or GBNF) does not compile"),
])
def test_a_constraint_that_does_not_compile_is_refused_before_it_is_queued(llm, params, message):
    with pytest.raises(ValueError, match=re.escape(message)) as e:
        llm.engine.add_request("bad", PROMPTS[0], SamplingParams(structured_outputs=params))
    assert str(e.value).startswith("structured_outputs: ")
    assert not llm.engine.has_unfinished_requests() and "bad" not in llm.engine.requests


@pytest.mark.parametrize("fields, message", [
    (dict(json={}, regex="a"), "exactly one of json, regex, choice, grammar, json_object; got json, regex"),
    (dict(), "got none"),
    (dict(json="{not json"), "json is not valid JSON"),
    (dict(json=[1]), "json must be a JSON schema"),
    (dict(choice=[]), "choice must be a non-empty list of strings"),
    (dict(choice=["a", 1]), "choice must be a non-empty list of strings"),
    (dict(grammar=" "), "grammar must be a non-empty string"),
    (dict(regex="a", structural_tag="{}"), "structural_tag is not supported"),
    (dict(regex="a", whitespace_pattern=1), "whitespace_pattern must be a string"),
    (dict(regex="a", disable_any_whitespace=1), "disable_any_whitespace must be true or false"),
])
def test_structured_outputs_params_check_their_fields(fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(structured_outputs=fields)


def test_structured_outputs_params_come_as_a_dict_too():
    params = SamplingParams(structured_outputs={"json": '{"type": "integer"}'})
    assert params.structured_outputs == StructuredOutputsParams(json={"type": "integer"})
    assert params.changes_logits and not params.has_logits_processors
    with pytest.raises(ValueError, match=r"unknown fields \['jsn'\]"):
        SamplingParams(structured_outputs={"jsn": {}})


def test_without_a_tokenizer_structured_outputs_are_refused(ckpt):
    llm = LLM(str(ckpt), block_size=4, num_kv_blocks=64, skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="structured_outputs need the tokenizer"):
        llm.engine.add_request("r", [5, 6], SamplingParams(structured_outputs={"regex": "a"}))


def test_a_token_the_grammar_refuses_aborts_its_sequence(llm):
    """min_tokens forbids EOS, the only token the grammar allows once "yes" is written: nothing is left to draw, and
    the sequence ends there rather than leave its grammar."""
    (out,) = generate(llm, PROMPTS[0], temperature=0, max_tokens=8, min_tokens=4,
                      structured_outputs=StructuredOutputsParams(choice=["yes"]))
    assert out.outputs[0].text == "yes" and out.outputs[0].finish_reason == "abort"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_sampler_never_draws_a_masked_token_and_logprobs_see_the_mask(temperature):
    logits = torch.randn(3, 64)
    logits[:, 5] = 30.0                       # every row's likeliest token, masked in rows 0 and 2
    bias = torch.full((2, 64), -torch.inf)
    bias[0, [7, 9]] = 0.0
    bias[1, 11] = 0.0
    params = [SamplingParams(temperature=temperature, logprobs=2, seed=1)] * 3
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    out = Sampler(torch.Generator().manual_seed(0))(logits, params, gens, mask=TokenMask([0, 2], bias))
    assert out.token_ids[0] in (7, 9) and out.token_ids[1] == 5 and out.token_ids[2] == 11
    assert out.logprobs[2][11][0] == pytest.approx(0.0) and set(out.logprobs[0]) <= {7, 9}


def test_the_demo_model_s_outputs_validate_against_fifty_schemas():
    llm = LLM(max_model_len=512, num_kv_blocks=512, max_num_seqs=64)
    schemas = demo_schemas()
    params = [SamplingParams(temperature=0.7, seed=i, max_tokens=200, structured_outputs=StructuredOutputsParams(
        json=s, disable_any_whitespace=True)) for i, s in enumerate(schemas)]
    outs = llm.generate(["<|user|>\nAnswer in JSON.\n<|assistant|>\n"] * len(schemas), params, use_tqdm=False)
    for schema, out in zip(schemas, outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (schema, c.text)
        jsonschema.validate(json.loads(c.text), schema)


# ---- with speculative decoding -------------------------------------------------------------------------------------

def _allowed(grammar, drafts=()) -> list[set[int]]:
    """The tokens the grammar allows next and after each of `drafts`, one fill_bitmask call."""
    bitmask = torch.zeros(len(drafts) + 1, (VOCAB + 31) // 32, dtype=torch.int32)
    grammar.fill_bitmask(bitmask, 0, drafts)
    bits = bitmask.numpy().view(np.uint8)
    return [set(np.flatnonzero(np.unpackbits(row, bitorder="little")[:VOCAB]).tolist()) for row in bits]


def test_a_grammar_s_masks_after_drafts_are_those_of_taking_them_one_by_one(llm):
    """fill_bitmask with drafts gives, row by row, the masks a copy of the grammar shows as it takes them, and leaves
    the grammar as it was; validate counts the drafts it allows up to the first it does not, and ends at EOS."""
    grammar = llm.engine.structured.grammar(SamplingParams(structured_outputs=json_params()))
    tokenizer = llm.get_tokenizer()
    drafts = tokenizer.encode('{"name":"ab', add_special_tokens=False)
    assert grammar.validate(drafts) == len(drafts)
    rows = _allowed(grammar, drafts)
    walker = grammar.fork()
    for token, row in zip(drafts, rows):
        assert row == _allowed(walker)[0] and token in row
        assert walker.accept(token)
    assert rows[-1] == _allowed(walker)[0]
    assert _allowed(grammar)[0] == rows[0]                         # the grammar has not moved
    forbidden = min(set(range(VOCAB)) - rows[2])
    assert grammar.validate(drafts[:2] + [forbidden] + drafts[3:]) == 2
    choice = llm.engine.structured.grammar(SamplingParams(structured_outputs=StructuredOutputsParams(choice=["yes"])))
    yes = tokenizer.encode("yes", add_special_tokens=False)
    eos = tokenizer.eos_token_id
    assert choice.validate(yes + [eos, eos]) == len(yes) + 1      # EOS ends it: nothing after
    assert _allowed(choice, yes + [eos])[-1] == set(range(VOCAB))  # after EOS the grammar constrains nothing
    assert choice.accept(yes[0]) and choice.validate([eos]) == (1 if len(yes) == 1 else 0)


class GrammarWalk(Proposer):
    """Drafts of constrained sequences walked through a copy of their grammar: at each token, plain decoding's
    (`references`, by prompt) with probability 1 - miss while the outputs follow it, else one the grammar allows
    drawn at random; then a token it forbids, which propose must cut. Unconstrained sequences get none."""

    def __init__(self, references: dict[tuple[int, ...], list[int]], miss: float, seed: int = 0):
        self.references, self.miss, self.rng = references, miss, random.Random(seed)

    def draft(self, seqs, limits):
        return [self._walk(s, k) if s.grammar.constrains else [] for s, k in zip(seqs, limits)]

    def _walk(self, seq, k: int) -> list[int]:
        reference = self.references.get(tuple(seq.prompt_token_ids), [])
        ref, on_track = reference[seq.num_output_tokens:], reference[:seq.num_output_tokens] == seq.output_token_ids
        walker, drafts = seq.grammar.fork(), []
        for i in range(k - 1):
            allowed = _allowed(walker)[0]
            hit = on_track and i < len(ref) and self.rng.random() >= self.miss
            token = ref[i] if hit else self.rng.choice(sorted(allowed))
            on_track = hit
            if not walker.accept(token) or not walker.constrains:
                return drafts + [token]
            drafts.append(token)
        return drafts + [min(set(range(VOCAB)) - _allowed(walker)[0])]


@pytest.mark.parametrize("kind", CONSTRAINTS)
def test_speculation_within_a_grammar_gives_plain_decoding_s_tokens(ckpt, kind):
    """Drafts checked against each sequence's grammar and verified under its masks: greedy outputs equal those of
    decoding without speculation, a free request speculates beside them, the forbidden drafts never reach the
    model (each step's drafts stop before them), some drafts are accepted and some rejected, and every block comes
    back."""
    kw = dict(block_size=4, num_kv_blocks=512, max_model_len=512, num_scheduler_steps=1)
    prompts = PROMPTS + [p + " and" for p in PROMPTS]
    params = [SamplingParams(temperature=0, max_tokens=160, structured_outputs=CONSTRAINTS[kind])] * 7
    params.append(SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    expected = LLM(str(ckpt), **kw).generate(prompts, params, use_tqdm=False)
    k = 4
    llm = LLM(str(ckpt), speculative_config={"method": "ngram", "num_speculative_tokens": k,
                                             "disable_by_batch_size": len(prompts)}, **kw)
    references = {tuple(o.prompt_token_ids): o.outputs[0].token_ids for o in expected}
    walk = GrammarWalk(references, miss=0.5)
    spec = llm.engine.speculator
    spec.proposer = CombinedProposer(walk, OracleProposer(references, miss=0.3))
    verified = []             # (drafts, how many the grammar allows) of each constrained verification

    def verify(seqs, out, masks):
        masks([s for s, k in zip(seqs, out.num_drafts) if k])       # the mask thread done with the grammars
        verified.extend((len(s.spec_token_ids), s.grammar.validate(s.spec_token_ids))
                        for s in seqs if s.grammar.constrains and s.spec_token_ids)
        return verify_drafts(seqs, out, masks)

    verify_drafts, spec.verify = spec.verify, verify
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expected]
    assert verified and all(n == valid <= k - 1 for n, valid in verified)
    for out in outs[:-1]:
        check(kind, out.outputs[0].text)
        assert out.metrics["spec_decode_num_accepted_tokens"] > 0
    assert sum(o.metrics["spec_decode_num_accepted_tokens"] for o in outs[:-1]) < \
        sum(o.metrics["spec_decode_num_draft_tokens"] for o in outs[:-1])
    assert outs[-1].metrics["spec_decode_num_accepted_tokens"] > 0
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_usable_blocks
    llm.engine.kv.check_invariants()


class CombinedProposer(Proposer):
    """Each sequence's drafts from the first proposer, or from the second where the first proposes none."""

    def __init__(self, first: Proposer, second: Proposer):
        self.first, self.second = first, second

    def draft(self, seqs, limits):
        return [a or b for a, b in zip(self.first.draft(seqs, limits), self.second.draft(seqs, limits))]


@pytest.mark.parametrize("mode", ["temperature", "top_k_top_p"])
def test_sampled_speculation_within_a_grammar_follows_it(ckpt, mode):
    """Sampled outputs verified under their grammar's masks follow it, n > 1 forks included."""
    llm = LLM(str(ckpt), block_size=4, num_kv_blocks=512, max_model_len=512,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 4})
    outs = llm.generate(PROMPTS[:2], SamplingParams(n=2, max_tokens=160, structured_outputs=json_params(),
                                                    **MODES[mode]), use_tqdm=False)
    walk = GrammarWalk({}, miss=1.0)
    llm.engine.speculator.proposer = walk
    outs += llm.generate(PROMPTS[2:], SamplingParams(n=2, max_tokens=160, structured_outputs=json_params(),
                                                     **MODES[mode]), use_tqdm=False)
    for out in outs:
        for c in out.outputs:
            assert c.finish_reason == "stop"
            check("json", c.text)
    assert llm.stats()["spec_decode_num_accepted_tokens"] > 0
