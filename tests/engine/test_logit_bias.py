"""logit_bias: added to a row's logits before greedy argmax, temperature, top-k/p; the logprobs stay the model's."""
from __future__ import annotations

import shutil

import pytest
import torch

from kvserve import LLM, SamplingParams, sampling
from kvserve.sampling import Sampler

VOCAB = 50
KINDS = [dict(temperature=0), dict(temperature=1.0), dict(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05)]


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return 3 * torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", KINDS, ids=["greedy", "sampled", "filtered"])
def test_plus_100_forces_the_token_and_minus_100_forbids_it(kind):
    logits = random_logits(64)
    least, best = logits.argmin(-1).tolist(), logits.argmax(-1).tolist()
    sampler = Sampler(torch.Generator().manual_seed(0))
    forced = sampler(logits, [SamplingParams(**kind, logit_bias={t: 100}) for t in least], [None] * 64)
    assert forced.token_ids == least
    # the rows' most likely tokens, forbidden: never drawn, even where they hold nearly all the mass
    peaked = logits.clone()
    peaked[torch.arange(64), best] += 20
    drawn = [sampler(peaked, [SamplingParams(**kind, logit_bias={t: -100}) for t in best], [None] * 64).token_ids
             for _ in range(20)]
    assert all(t != b for row in drawn for t, b in zip(row, best))
    unbiased = sampler(peaked, [SamplingParams(**kind)] * 64, [None] * 64).token_ids
    assert sum(t == b for t, b in zip(unbiased, best)) > 32


def test_a_biased_row_leaves_the_others_as_they_were_and_is_itself_as_alone():
    logits = random_logits(6, seed=1).bfloat16()
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=3),
              SamplingParams(temperature=0.8, top_k=4, seed=4), SamplingParams(temperature=0, logprobs=3),
              SamplingParams(temperature=1.0, seed=5, logit_bias={7: 2.5, 11: -1.0}),
              SamplingParams(temperature=0, logit_bias={int(logits[5].float().argmin()): 30.0})]

    def draw(rows: list[int]) -> list[int]:
        gens = [None if params[i].seed is None else torch.Generator().manual_seed(params[i].seed) for i in rows]
        return Sampler(torch.Generator().manual_seed(0))(logits[rows], [params[i] for i in rows], gens).token_ids

    batched = draw(list(range(6)))
    assert batched[:4] == draw([0, 1, 2, 3])
    assert [batched[4]] == draw([4]) and [batched[5]] == draw([5])
    assert batched[5] == int(logits[5].float().argmin())


def test_logprobs_are_the_models_before_the_bias():
    """As vLLM's default (raw_logprobs): the bias picks the token, the logprobs say what the model thought of it."""
    logits = random_logits(2, seed=2)
    least = int(logits[0].argmin())
    sampler = Sampler()
    plain = sampler(logits, [SamplingParams(temperature=0, logprobs=2)] * 2, [None] * 2)
    biased = sampler(logits, [SamplingParams(temperature=0, logprobs=2, logit_bias={least: 100})] * 2, [None] * 2)
    assert biased.token_ids == [least, least] != plain.token_ids
    ref = logits.log_softmax(-1)
    assert biased.logprobs[0][least] == (pytest.approx(ref[0, least].item(), abs=1e-5), VOCAB)
    top = {t: v for t, v in biased.logprobs[0].items() if t != least}
    assert top == {t: v for t, v in plain.logprobs[0].items()}


def test_no_bias_builds_nothing(monkeypatch):
    """The bias tensors are made only in a step where some row has a bias."""
    calls = []
    monkeypatch.setattr(sampling, "_processed", lambda logits, *args: calls.append(1) or logits)
    Sampler()(random_logits(4), [SamplingParams(temperature=0), SamplingParams(temperature=1.0, logit_bias={})] * 2,
              [None] * 4)
    assert not calls
    Sampler()(random_logits(4), [SamplingParams(temperature=0)] * 3 + [SamplingParams(logit_bias={1: 1})], [None] * 4)
    assert calls == [1]


@pytest.fixture(scope="module")
def ckpt(checkpoint):
    return checkpoint("llama", max_position_embeddings=128)


PROMPTS = [{"prompt_token_ids": [5, 17, 42]}, {"prompt_token_ids": list(range(10, 30))}, {"prompt_token_ids": [7]}]


def tokens(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_ids_out_of_the_vocabulary_are_rejected_at_add_request(ckpt):
    llm = LLM(str(ckpt), block_size=4, num_kv_blocks=32)
    with pytest.raises(ValueError, match=r"logit_bias token ids out of the vocabulary \[0, 384\): \[384, 1000\]"):
        llm.engine.add_request("r", PROMPTS[0], SamplingParams(logit_bias={1000: 1.0, 3: 2.0, 384: -1.0}))
    assert not llm.engine.requests and not llm.engine.has_unfinished_requests()
    llm.engine.add_request("r", PROMPTS[0], SamplingParams(logit_bias={383: 1.0}))


@pytest.mark.parametrize("kind", KINDS[:2], ids=["greedy", "sampled"])
def test_engine_forces_and_forbids_in_a_batch(ckpt, kind):
    llm = LLM(str(ckpt), block_size=4, num_kv_blocks=64)
    base = dict(max_tokens=8, ignore_eos=True, seed=1, **kind)
    plain = tokens(llm, PROMPTS, SamplingParams(**base))
    forced = tokens(llm, PROMPTS, [SamplingParams(**base), SamplingParams(**base, logit_bias={99: 100}),
                                   SamplingParams(**base)])
    assert forced[1] == [99] * 8 and forced[0] == plain[0] and forced[2] == plain[2]
    banned = {t: -100 for t in plain[1]}
    out = tokens(llm, PROMPTS[1], SamplingParams(**base, logit_bias=banned))[0]
    assert len(out) == 8 and not set(out) & set(banned)


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler: no native decode steps")
def test_multi_step_native_decode_does_not_skip_the_bias(ckpt):
    """Offline greedy batches decode several steps in one C call that takes the plain argmax: a request with a
    logit_bias keeps a step at a time, and the others in its batch still decode as they would alone."""
    llm = LLM(str(ckpt), block_size=4, num_kv_blocks=64, num_scheduler_steps=8)
    (multi,) = [e for e in llm.engine.runner.executors if e.name == "native_multi_step"]
    calls = []
    run = multi.run
    multi.run = lambda step: calls.append(len(step.sched.seqs)) or run(step)
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = tokens(llm, PROMPTS, greedy)
    assert calls                                   # the multi-step path is taken without a bias
    calls.clear()
    biased = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logit_bias={99: 100})
    out = tokens(llm, PROMPTS, [greedy, biased, greedy])
    assert out[1] == [99] * 12 and [out[0], out[2]] == [alone[0], alone[2]]
    assert all(n < 3 for n in calls)               # only once the biased request is done
