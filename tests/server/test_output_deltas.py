"""The engine core's pipe carries deltas: applied in order, they rebuild every cumulative output."""
from __future__ import annotations

import copy
import pickle

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.sampling import Logprob
from kvserve.server.output_deltas import DeltaEncoder, apply_delta


def outputs_over_steps(growth: list[list[int]], n: int, logprobs: bool, cut: int) -> list[RequestOutput]:
    """Cumulative outputs of one request: completion i gains growth[step][i] tokens a step (samples
    past the first appear after the first step, as forks do); the last step finishes every one,
    cutting `cut` characters off the text (a stop string)."""
    outs, comps = [], []
    for step, gains in enumerate(growth):
        width = 1 if step == 0 else n
        while len(comps) < width:
            comps.append(CompletionOutput(len(comps), "", [], None, [] if logprobs else None))
        last = step == len(growth) - 1
        for c, gain in zip(comps, gains):
            for _ in range(gain):
                t = len(c.token_ids) + 10 * c.index
                c.token_ids.append(t)
                c.text += f" w{t}"
                if logprobs:
                    c.logprobs.append({t: Logprob(-0.5, 1, f" w{t}")})
            if last:
                c.text, c.finish_reason, c.stop_reason = c.text[:max(0, len(c.text) - cut)], "stop", "w"
        outs.append(RequestOutput("r", "a prompt", [1, 2, 3], copy.deepcopy(comps), last, 2, {"arrival_time": 1.0},
                                  [None, {2: Logprob(-1.0, 1, "b")}] if last else None))
    return outs


@settings(max_examples=60, deadline=None)
@given(growth=st.lists(st.lists(st.integers(0, 4), min_size=3, max_size=3), min_size=1, max_size=8),
       n=st.integers(1, 3), logprobs=st.booleans(), cut=st.integers(0, 5))
def test_deltas_rebuild_every_cumulative_output(growth, n, logprobs, cut):
    encoder, state = DeltaEncoder(), None
    for out in outputs_over_steps(growth, n, logprobs, cut):
        delta = pickle.loads(pickle.dumps(encoder.encode(out)))     # as through the pipe
        assert sum(len(c.token_ids) for c in delta.outputs) <= 4 * 3   # only what the step added
        state = apply_delta(state, delta)
        assert state == out
    assert encoder._sent == {}          # a finished request is forgotten


def test_a_long_generation_sends_only_its_new_tokens():
    encoder = DeltaEncoder()
    comp = CompletionOutput(0, "x" * 5000, list(range(5000)))
    first = encoder.encode(RequestOutput("r", "p", [1], [comp]))
    comp.token_ids.append(5000)
    comp.text += "y"
    second = encoder.encode(RequestOutput("r", "p", [1], [comp]))
    assert second.outputs[0].token_ids == [5000] and second.outputs[0].text == "y" and second.prompt_token_ids == []
    assert len(pickle.dumps(second)) < len(pickle.dumps(first)) / 20
