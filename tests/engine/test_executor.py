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
