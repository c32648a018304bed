"""SamplingParams checks every field: a bad value of any kind is a ValueError naming the field."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvserve import SamplingParams

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=NAN), "temperature"), (dict(temperature=INF), "temperature"),
    (dict(temperature=True), "temperature"), (dict(temperature="0.5"), "temperature"),
    (dict(temperature=10**400), "temperature"), (dict(logit_bias={1: -10**400}), "logit_bias"),
    (dict(top_p=NAN), "top_p"), (dict(top_p=0), "top_p"), (dict(top_p=True), "top_p"),
    (dict(min_p=-INF), "min_p"), (dict(min_p=NAN), "min_p"),
    (dict(top_k=1.5), "top_k"), (dict(top_k=2.0), "top_k"), (dict(top_k=True), "top_k"), (dict(top_k=-2), "top_k"),
    (dict(max_tokens=2.5), "max_tokens"), (dict(max_tokens=True), "max_tokens"), (dict(max_tokens="8"), "max_tokens"),
    (dict(n="2"), "n"), (dict(n=2.0), "n"), (dict(n=False), "n"), (dict(n=None), "n"),
    (dict(seed=1.5), "seed"), (dict(seed=True), "seed"), (dict(seed="1"), "seed"),
    (dict(logprobs=1.5), "logprobs"), (dict(logprobs=True), "logprobs"),
    (dict(prompt_logprobs=-1), "prompt_logprobs"), (dict(prompt_logprobs=0.0), "prompt_logprobs"),
    (dict(stop=123), "stop"), (dict(stop=[1]), "stop"), (dict(stop=["a", ""]), "stop"), (dict(stop=""), "stop"),
    (dict(stop={"a": 1}), "stop"),
    (dict(stop_token_ids=5), "stop_token_ids"), (dict(stop_token_ids=[1.0]), "stop_token_ids"),
    (dict(stop_token_ids=[True]), "stop_token_ids"), (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(stop_token_ids="12"), "stop_token_ids"),
    (dict(ignore_eos=1), "ignore_eos"), (dict(ignore_eos="yes"), "ignore_eos"), (dict(ignore_eos=None), "ignore_eos"),
    (dict(skip_special_tokens=0), "skip_special_tokens"),
    (dict(logit_bias=[1]), "logit_bias"), (dict(logit_bias={"5": 1.0}), "logit_bias"),
    (dict(logit_bias={True: 1.0}), "logit_bias"), (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={5: 100.5}), "logit_bias"), (dict(logit_bias={5: NAN}), "logit_bias"),
    (dict(logit_bias={5: "1"}), "logit_bias"), (dict(logit_bias={5: False}), "logit_bias"),
    (dict(eviction=["sink"]), "eviction"),
])
def test_bad_values_raise_value_errors_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_good_values_are_kept_in_their_plain_types():
    p = SamplingParams(temperature=np.float32(0.5), top_p=1, max_tokens=np.int64(3), seed=np.int32(7), stop="x",
                       stop_token_ids=(5, np.int64(6)), logprobs=0, logit_bias={np.int64(3): 2, 4: -100.0})
    assert (p.temperature, p.top_p, p.max_tokens, p.seed, p.stop, p.stop_token_ids) == (0.5, 1.0, 3, 7, ["x"], [5, 6])
    assert p.logit_bias == {3: 2.0, 4: -100.0}
    assert all(type(v) is float for v in (p.temperature, p.top_p, *p.logit_bias.values()))
    assert all(type(v) is int for v in (p.max_tokens, p.seed, *p.stop_token_ids, *p.logit_bias))
    # vLLM's -1 for "no top-k" is stored as 0
    assert SamplingParams(top_k=-1).top_k == 0 == SamplingParams().top_k and SamplingParams(top_k=1).top_k == 1


NOT_NUMBERS = st.one_of(st.booleans(), st.none(), st.text(max_size=3), st.lists(st.integers(), max_size=2),
                        st.just(INF), st.just(-INF), st.just(NAN))
NOT_FLOATS = NOT_NUMBERS | st.just(10**400)     # an int, but past the floats
NON_INTEGERS = st.one_of(NOT_NUMBERS, st.floats(allow_nan=False, allow_infinity=False))
SCALAR_NON_INTEGERS = NON_INTEGERS.filter(lambda v: not isinstance(v, list))     # hashable: dict keys, list items
# (field, bad values): wrong types, NaN/inf, out of range
BAD = {
    "n": st.one_of(NON_INTEGERS, st.integers(max_value=0)),
    "max_tokens": st.one_of(NON_INTEGERS.filter(lambda v: v is not None), st.integers(max_value=0)),
    "top_k": st.one_of(NON_INTEGERS, st.integers(max_value=-2)),
    "seed": st.one_of(NON_INTEGERS.filter(lambda v: v is not None), st.integers(max_value=-1),
                      st.integers(min_value=2**63 - 1)),
    "logprobs": st.one_of(NON_INTEGERS.filter(lambda v: v is not None), st.integers(max_value=-1)),
    "prompt_logprobs": st.one_of(NON_INTEGERS.filter(lambda v: v is not None), st.integers(max_value=-1)),
    "temperature": st.one_of(NOT_FLOATS, st.floats(max_value=-1e-300)),
    "top_p": st.one_of(NOT_FLOATS, st.floats(max_value=0.0), st.floats(min_value=1.0, exclude_min=True)),
    "min_p": st.one_of(NOT_FLOATS, st.floats(max_value=-1e-300), st.floats(min_value=1.0, exclude_min=True)),
    "ignore_eos": st.one_of(st.integers(), st.none(), st.text(max_size=2), st.floats()),
    "skip_special_tokens": st.one_of(st.integers(), st.none(), st.text(max_size=2), st.floats()),
    "stop": st.one_of(st.integers(), st.floats(), st.lists(st.one_of(st.integers(), st.just("")), min_size=1)),
    "stop_token_ids": st.one_of(st.integers(), st.text(),
                                st.lists(SCALAR_NON_INTEGERS | st.integers(max_value=-1), min_size=1)),
    "logit_bias": st.one_of(
        st.lists(st.integers(), min_size=1), st.integers(),
        st.dictionaries(SCALAR_NON_INTEGERS | st.integers(max_value=-1), st.floats(-100, 100), min_size=1),
        st.dictionaries(st.integers(0, 1000), NOT_FLOATS | st.floats(min_value=100.0, exclude_min=True)
                        | st.floats(max_value=-100.0, exclude_max=True), min_size=1)),
}


@given(st.sampled_from(sorted(BAD)).flatmap(lambda f: st.tuples(st.just(f), BAD[f])))
def test_any_bad_value_of_any_field_is_a_value_error_naming_it(case):
    field, value = case
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})
