"""The demo model's data: the passkey prompt format and the held-out split of the standard library."""
import random
import re

import pytest

from kvserve.eval.data import HELD_OUT_MODULES, held_out_files, held_out_text, stdlib_root, training_files
from kvserve.eval.passkey import FILLER, HEADER, NEEDLE, QUESTION, build_prompt, make_passkey_prompt


def count_filler(text: str) -> int:
    return sum(text.count(sentence) for sentence in FILLER)


def count_words(text: str) -> int:
    return len(text.split())


def filler_around_needle(prompt: str, key: str) -> tuple[int, int]:
    """How many filler sentences come before and after the needle."""
    body = prompt[len(HEADER):-len("\n\n" + QUESTION)]
    before, after = body.split(NEEDLE.format(key=key))
    return count_filler(before), count_filler(after)


@pytest.mark.parametrize("length", [300, 1000, 4000])
@pytest.mark.parametrize("depth", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_passkey_prompt_format(length, depth):
    prompt, answer = make_passkey_prompt(length, depth, rng=random.Random(1))
    assert re.fullmatch(r"[1-9][0-9]{4}", answer)
    assert prompt.startswith(HEADER) and prompt.endswith("\n\n" + QUESTION)
    needle = NEEDLE.format(key=answer)
    assert prompt.count(needle) == 1 and prompt.count(answer) == needle.count(answer)
    before, after = filler_around_needle(prompt, answer)
    total = before + after
    assert total > 0 and before == round(depth * total)
    # the longest prompt whose document (prompt, space, answer) fits the budget
    assert len(prompt + " " + answer) <= length < len(build_prompt(total + 1, depth, answer) + " " + answer)


def test_passkey_prompt_counts_in_given_units():
    prompt, answer = make_passkey_prompt(200, 0.3, key="12345", count=count_words)
    assert answer == "12345"
    assert 190 < count_words(prompt + " " + answer) <= 200


def test_passkey_prompt_is_seeded():
    a = [make_passkey_prompt(500, 0.5, rng=random.Random(7)) for _ in range(2)]
    assert a[0] == a[1]
    keys = {make_passkey_prompt(500, 0.5, rng=random.Random(seed))[1] for seed in range(20)}
    assert len(keys) > 15


def test_passkey_prompt_rejects_bad_arguments():
    with pytest.raises(ValueError, match="too short"):
        make_passkey_prompt(20, 0.5, key="12345")
    with pytest.raises(ValueError, match="depth"):
        make_passkey_prompt(500, 1.5, key="12345")


def test_held_out_modules_are_never_trained_on():
    root = stdlib_root()
    held, train = held_out_files(), training_files()
    assert held and train and not set(held) & set(train)
    trained_names = {part.removesuffix(".py") for p in train for part in p.relative_to(root).parts}
    for module in HELD_OUT_MODULES:
        assert module not in trained_names and f"test_{module}" not in trained_names
        assert any(module in p.relative_to(root).parts or p.stem == module for p in held), module
    assert not any("site-packages" in p.parts for p in train)


def test_held_out_text_is_the_held_out_sources():
    text = held_out_text()
    assert len(text) > 50_000
    assert all(p.read_text(encoding="utf-8", errors="replace") in text for p in held_out_files())
