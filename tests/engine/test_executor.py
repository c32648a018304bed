"""The executor seam (engine/executor.py): which executors an engine builds, which one runs each step, and
the per-executor step counts in LLMEngine.stats() and /metrics."""
from __future__ import annotations

import shutil

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.server.metrics import ServerMetrics

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def prompts(n: int) -> list[dict]:
    g = torch.Generator().manual_seed(n)
    return [{"prompt_token_ids": torch.randint(3, 384, (5,), generator=g).tolist()} for _ in range(n)]


@pytest.mark.parametrize("kwargs, names", [
    ({}, ["native_multi_step", "native", "eager"]),
    (dict(num_scheduler_steps=1), ["native", "eager"]),
    (dict(enforce_eager=True), ["eager"]),
    (dict(kv_cache_dtype="int8"), ["native_multi_step", "native", "eager"]),      # its steps write quantized pages
])
def test_the_engine_builds_its_executors_once_in_the_order_tried(tiny_llama, kwargs, names):
    llm = LLM(str(tiny_llama), block_size=4, num_kv_blocks=64, dtype="float32", **kwargs)
    assert [e.name for e in llm.engine.runner.executors] == names
    assert llm.stats()["steps"] == dict.fromkeys(names, 0)


def test_each_step_is_counted_under_the_executor_that_ran_it(tiny_llama):
    """An offline greedy batch: its prefill op by op, then its decodes in multi-step calls (counted by the
    decode steps they ran); a request with logprobs decodes one step per call; streamed steps alike."""
    llm = LLM(str(tiny_llama), block_size=4, num_kv_blocks=64, dtype="float32")
    llm.generate(prompts(2), GREEDY, use_tqdm=False)
    assert llm.stats()["steps"] == {"native_multi_step": 5, "native": 0, "eager": 1}
    llm.generate(prompts(1), SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=1),
                 use_tqdm=False)
    assert llm.stats()["steps"] == {"native_multi_step": 5, "native": 5, "eager": 2}


def test_metrics_count_steps_by_executor(tiny_llama):
    llm = LLM(str(tiny_llama), block_size=4, num_kv_blocks=64, dtype="float32")
    llm.generate(prompts(2), GREEDY, use_tqdm=False)
    text = ServerMetrics(llm.engine.stats, "tiny").render().decode()
    lines = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
             if line.startswith("kvserve:steps_total")}
    assert lines == {'kvserve:steps_total{executor="native_multi_step",model_name="tiny"}': 5.0,
                     'kvserve:steps_total{executor="native",model_name="tiny"}': 0.0,
                     'kvserve:steps_total{executor="eager",model_name="tiny"}': 1.0}
    assert "# TYPE kvserve:steps_total counter" in text


def test_a_prompt_whose_last_chunk_is_one_token_forks_its_samples_before_several_steps_a_call(tiny_llama):
    """A prompt cut into chunks of 8, 8 and 1 tokens: its last token is scheduled as a decode, but its n samples fork
    from it, so the several-steps call waits for the next step; both samples decode, as one sample does alone."""
    prompt = {"prompt_token_ids": list(range(5, 22))}
    kw = dict(block_size=4, num_kv_blocks=64, long_prefill_token_threshold=8)
    one = LLM(str(tiny_llama), **kw).generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                                               use_tqdm=False)[0].outputs[0].token_ids
    llm = LLM(str(tiny_llama), **kw)
    engine, done = llm.engine, []
    engine.add_request("r", prompt, SamplingParams(n=2, max_tokens=12, temperature=0, ignore_eos=True), final_only=True)
    for _ in range(40):                 # (a lost sample would leave the request unfinished for ever)
        done += [o for o in engine.step() if o.finished]
        if done:
            break
    assert done and [c.token_ids for c in done[0].outputs] == [one, one]
    assert llm.stats()["steps"]["native_multi_step"] > 0
