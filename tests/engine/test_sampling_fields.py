"""vLLM's request fields beyond OpenAI's, offline, as vLLM defines them: min_tokens, include_stop_str_in_output,
spaces_between_special_tokens, allowed_token_ids, bad_words, truncate_prompt_tokens; vLLM's caps on a request's
lists; and the prompts the offline API refuses."""
from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from kvserve import LLM, SamplingParams
from kvserve.engine.detokenizer import Detokenizer
from kvserve.engine.sequence import Sequence
from kvserve.sampling import Sampler

EOS = 1                                 # the tiny models' eos_token_id
PROMPT = [67, 68, 69, 70]               # "abcd"
FORCED = 90                             # "x": a token a logit_bias of 100 makes the greedy choice at every step


@pytest.fixture(scope="module")
def llm(checkpoint):
    path = checkpoint("llama", max_position_embeddings=128)
    return LLM(str(path), block_size=4, num_kv_blocks=64, max_model_len=128)


def generate(llm: LLM, prompt, **params):
    return llm.generate(prompt, SamplingParams(**params), use_tqdm=False)[0]


def first(llm: LLM, prompt, **params):
    return generate(llm, prompt, **params).outputs[0]


# ---- min_tokens ------------------------------------------------------------------------

@pytest.mark.parametrize("stop", [dict(), dict(stop_token_ids=[FORCED])], ids=["eos", "stop-token"])
def test_min_tokens_holds_back_eos_and_stop_tokens(llm, stop):
    token = FORCED if stop else EOS
    bias = {token: 100.0}
    assert first(llm, PROMPT, temperature=0, max_tokens=10, logit_bias=bias, **stop).token_ids == [token]
    out = first(llm, PROMPT, temperature=0, max_tokens=10, logit_bias=bias, min_tokens=4, **stop)
    assert len(out.token_ids) == 5 and token not in out.token_ids[:4] and out.token_ids[4] == token
    assert out.finish_reason == "stop"


def test_min_tokens_holds_back_eos_also_with_ignore_eos_and_in_sampling():
    """As vLLM's MinTokensLogitsProcessor: EOS is forbidden before min_tokens even where ignore_eos lets it be
    sampled, and for every kind of row in a batch."""
    logits = torch.zeros(3, 16)
    logits[:, EOS] = 50.0
    params = [SamplingParams(temperature=0, min_tokens=2, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=1, min_tokens=2), SamplingParams(temperature=0)]
    sampler = Sampler(torch.Generator().manual_seed(0), eos_token_ids={EOS})
    early = sampler(logits, params, [None, torch.Generator().manual_seed(1), None], [([3, 4], 2)] * 3)
    assert early.token_ids[0] != EOS and early.token_ids[1] != EOS and early.token_ids[2] == EOS
    late = sampler(logits, params, [None] * 3, [([3, 4, 7, 8], 2)] * 3)
    assert late.token_ids == [EOS] * 3


def test_min_tokens_defers_stop_strings_to_the_text_after_them(llm):
    text = llm.get_tokenizer().decode([FORCED])
    forced = dict(temperature=0, max_tokens=10, logit_bias={FORCED: 100.0}, stop=[text])
    assert first(llm, PROMPT, **forced).text == ""
    out = first(llm, PROMPT, min_tokens=3, **forced)
    assert out.token_ids == [FORCED] * 4 and out.text == text * 3 and out.finish_reason == "stop"


def test_min_tokens_is_at_most_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    assert SamplingParams(max_tokens=None, min_tokens=500).min_tokens == 500


# ---- include_stop_str_in_output --------------------------------------------------------

def test_include_stop_str_in_output_keeps_the_stop_string_and_the_stop_token(llm):
    text = llm.get_tokenizer().decode([FORCED])
    forced = dict(temperature=0, max_tokens=10, logit_bias={FORCED: 100.0})
    for stop in (dict(stop=[text]), dict(stop_token_ids=[FORCED])):
        assert first(llm, PROMPT, **forced, **stop).text == ""
        kept = first(llm, PROMPT, **forced, **stop, include_stop_str_in_output=True)
        assert kept.text == text and kept.finish_reason == "stop"


def test_include_stop_str_in_output_cuts_after_the_stop_string(llm):
    base = first(llm, PROMPT, temperature=0, max_tokens=16, ignore_eos=True).text
    stop = base[3:6]
    cut = base.find(stop)
    kw = dict(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop])
    assert first(llm, PROMPT, **kw).text == base[:cut]
    assert first(llm, PROMPT, **kw, include_stop_str_in_output=True).text == base[:cut + len(stop)]


# ---- allowed_token_ids and bad_words ----------------------------------------------------

@pytest.mark.parametrize("kind", [dict(temperature=0), dict(temperature=1.0, seed=3)], ids=["greedy", "sampled"])
def test_allowed_token_ids_are_the_only_tokens_sampled(llm, kind):
    allowed = [7, 50, 200, 301]
    out = generate(llm, [PROMPT, list(range(20, 40))],
                   **kind, max_tokens=12, ignore_eos=True, allowed_token_ids=allowed, logprobs=1)
    assert set(out.outputs[0].token_ids) <= set(allowed) and len(out.outputs[0].token_ids) == 12
    free = first(llm, PROMPT, **kind, max_tokens=12, ignore_eos=True)
    assert not set(free.token_ids) <= set(allowed)


def test_allowed_token_ids_in_a_greedy_batch_are_not_skipped_by_multi_step_decoding(llm):
    """Offline greedy batches may decode several steps in one C call that takes the plain argmax: a request whose
    logits are changed keeps a step at a time."""
    allowed = [7, 50]
    outs = llm.generate([PROMPT, list(range(20, 40))],
                        [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, allowed_token_ids=allowed),
                         SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)], use_tqdm=False)
    assert set(outs[0].outputs[0].token_ids) <= set(allowed)


def test_allowed_token_ids_are_checked_against_the_vocabulary(llm):
    with pytest.raises(ValueError, match=r"allowed_token_ids token ids out of the vocabulary \[0, 384\): \[384\]"):
        llm.engine.add_request("r", PROMPT, SamplingParams(allowed_token_ids=[3, 384]))
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])


def contains(tokens: list[int], word: list[int]) -> bool:
    return any(tokens[i:i + len(word)] == word for i in range(len(tokens) - len(word) + 1))


def test_bad_words_are_never_completed(llm):
    """vLLM's rule: a word's last token is forbidden where the outputs end with the rest of it (a word of one token,
    always); its tokens are the word's alone, and after a space where that makes as many other tokens."""
    tok = llm.get_tokenizer()
    x_or_a = dict(temperature=0, max_tokens=16, ignore_eos=True, logit_bias={FORCED: 100.0, 67: 100.0})
    assert first(llm, PROMPT, **x_or_a).token_ids == [FORCED] + [67] * 15          # "xaaa...": "xa" once
    params = SamplingParams(**x_or_a, bad_words=["xa"])
    out = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids
    assert tok.encode("xa", add_special_tokens=False) == [FORCED, 67] and len(tok.encode(" xa")) == 3
    assert params.bad_words_token_ids == [[FORCED, 67]]
    assert not contains(out, [FORCED, 67]) and out == [FORCED] * 16
    assert FORCED not in first(llm, PROMPT, **x_or_a, bad_words=["x"]).token_ids


def test_bad_words_fit_vllm_s_caps(llm):
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=["   "])
    with pytest.raises(ValueError, match="bad_words has 129 entries"):
        SamplingParams(bad_words=[f"w{i}" for i in range(129)])
    with pytest.raises(ValueError, match="bad_words make"):   # 128 words, but over 1,024 tokens
        llm.engine.add_request("r", PROMPT, SamplingParams(bad_words=[f"q{i:03d}zqzqzqzq" for i in range(128)]))
    assert not llm.engine.requests


# ---- truncate_prompt_tokens ------------------------------------------------------------

def test_truncate_prompt_tokens_keeps_the_prompt_s_last_tokens(llm):
    long = list(range(10, 60))
    kw = dict(temperature=0, max_tokens=6, ignore_eos=True)
    cut = generate(llm, long, truncate_prompt_tokens=8, **kw)
    assert cut.prompt_token_ids == long[-8:]
    assert cut.outputs[0].token_ids == first(llm, long[-8:], **kw).token_ids
    text = generate(llm, "def fibonacci(n):", truncate_prompt_tokens=3, **kw)
    assert text.prompt_token_ids == llm.get_tokenizer().encode("def fibonacci(n):")[-3:]
    assert generate(llm, long, truncate_prompt_tokens=-1, **kw).prompt_token_ids == long   # max_model_len: all
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        generate(llm, long, truncate_prompt_tokens=129, **kw)
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=0)


# ---- spaces_between_special_tokens -----------------------------------------------------

def wordpiece_tokenizer() -> PreTrainedTokenizerFast:
    """A tokenizer whose decoder writes a space before a word, added tokens included."""
    vocab = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "hello": 3, "world": 4, "##s": 5}
    tk = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer, tk.decoder = pre_tokenizers.Whitespace(), decoders.WordPiece()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]",
                                   clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("skip, spaces, text", [
    (False, True, " [CLS] [SEP] world [SEP] [CLS]s"), (False, False, " [CLS][SEP] world [SEP][CLS]s"),
    (True, False, " worlds"),
])
def test_spaces_between_special_tokens(skip, spaces, text):
    """vLLM's: without spaces between them, an added token that follows another output one is its bare text."""
    tok = wordpiece_tokenizer()
    params = SamplingParams(skip_special_tokens=skip, spaces_between_special_tokens=spaces)
    seq = Sequence(0, "r", None, [3, 1], params, 100, 0.0)      # the prompt ends with an added token
    detokenize = Detokenizer(tok)
    for token in (1, 2, 4, 2, 1, 5):
        seq.token_ids.append(token)
        detokenize(seq)
    assert seq.output_text == text


# ---- the caps on a request's lists, and the prompts refused -----------------------------

@pytest.mark.parametrize("kwargs, text", [
    (dict(stop_token_ids=list(range(1_500_000))), "stop_token_ids has 1500000 entries, more than 128"),
    (dict(stop=["a", "b", "c", "d", "e"]), "stop has 5 entries, more than 4"),
    (dict(logit_bias={t: 1.0 for t in range(1025)}), "logit_bias has 1025 entries, more than 1024"),
    (dict(allowed_token_ids=list(range(1025))), "allowed_token_ids has 1025 entries, more than 1024"),
    (dict(stop=["a\ud800"]), "stop: not valid Unicode"),
])
def test_a_request_s_lists_have_vllm_s_caps(kwargs, text):
    with pytest.raises(ValueError, match=text):
        SamplingParams(**kwargs)


class Unscannable(list):
    def __contains__(self, item):
        raise AssertionError("a sampled token was looked for in the list of stop_token_ids")


def test_stop_token_ids_are_kept_once_each_and_looked_up_in_a_set(llm):
    params = SamplingParams(stop_token_ids=[5, 6, 5, *range(100, 225)])
    assert params.stop_token_ids == [5, 6, *range(100, 225)]
    assert isinstance(params.stop_token_set, frozenset) and params.stop_token_set == set(params.stop_token_ids)
    # the engine looks every sampled token up in the set
    params = SamplingParams(temperature=0, max_tokens=4, stop_token_ids=[FORCED, 3], logit_bias={FORCED: 100.0})
    params.stop_token_ids = Unscannable(params.stop_token_ids)
    out = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [FORCED] and out.finish_reason == "stop" and out.stop_reason == FORCED


@pytest.mark.parametrize("prompt, text", [
    ("", "the prompt is empty"), ({"prompt": ""}, "the prompt is empty"),
    ("a\ud800b", r"the prompt is not valid Unicode \(a lone surrogate at character 1\)"),
    ({"prompt": 5}, "a text prompt must be a string"),
])
def test_a_prompt_the_engine_cannot_take_is_a_value_error(llm, prompt, text):
    with pytest.raises(ValueError, match=text):
        llm.generate(prompt, use_tqdm=False)
    assert not llm.engine.requests
