"""Sampling, stops, logprobs, detokenization and chat."""
from __future__ import annotations

import ctypes

import pytest
import torch

from kvserve import LLM, SamplingParams, kernels
from kvserve.engine.detokenizer import Detokenizer
from kvserve.engine.sequence import Sequence
from kvserve.sampling import Sampler, argmax
from tiny_models import hf_model

PROMPTS = [{"prompt_token_ids": [5, 17, 42]}, {"prompt_token_ids": list(range(10, 30))},
           {"prompt_token_ids": [7]}]


@pytest.fixture(scope="module")
def ckpt(checkpoint):
    # A flatter distribution than the parity tests' so that sampling has choices to make.
    return checkpoint("llama", initializer_range=0.02)


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(str(ckpt), block_size=4, num_kv_blocks=128)


def gen(llm, prompts, params):
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def test_seed_is_reproducible_whatever_else_is_in_the_batch(llm):
    seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=42, ignore_eos=True)
    other = SamplingParams(max_tokens=12, temperature=0.8, ignore_eos=True)
    alone = gen(llm, PROMPTS[1], seeded)[0].token_ids
    batch = gen(llm, PROMPTS, [other, seeded, SamplingParams(max_tokens=5, temperature=1.0, seed=1)])
    assert batch[1].token_ids == alone
    assert gen(llm, PROMPTS[1], SamplingParams(max_tokens=12, temperature=1.0, seed=43,
                                               ignore_eos=True))[0].token_ids != alone


def test_engine_seed_makes_unseeded_sampling_reproducible(ckpt):
    params = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
    runs = [[o.token_ids for o in gen(LLM(str(ckpt), num_kv_blocks=64, seed=s), PROMPTS, params)]
            for s in (3, 3, 4)]
    assert runs[0] == runs[1] != runs[2]


@pytest.mark.parametrize("params", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)])
def test_filters_that_leave_one_token_equal_greedy(llm, params):
    greedy = gen(llm, PROMPTS, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    sampled = gen(llm, PROMPTS, SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True, **params))
    assert [o.token_ids for o in sampled] == [o.token_ids for o in greedy]


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]).repeat(2000, 1)
    sampler = Sampler(torch.Generator().manual_seed(0))
    top_k = sampler(logits, [SamplingParams(temperature=1.0, top_k=2)] * 2000, [None] * 2000).token_ids
    assert set(top_k) == {0, 1}
    # probabilities 0.64, 0.24, 0.09, ...: a nucleus of 0.85 needs the first two tokens
    top_p = sampler(logits, [SamplingParams(temperature=1.0, top_p=0.85)] * 2000, [None] * 2000).token_ids
    assert set(top_p) == {0, 1}
    free = sampler(logits, [SamplingParams(temperature=1.0)] * 2000, [None] * 2000).token_ids
    assert set(free) == {0, 1, 2, 3, 4}
    counts = torch.bincount(torch.tensor(free), minlength=5).float() / 2000
    torch.testing.assert_close(counts, logits[0].softmax(-1), atol=0.04, rtol=0)


def test_logprobs_match_transformers(llm, ckpt):
    out = gen(llm, PROMPTS[0], SamplingParams(max_tokens=4, temperature=0, logprobs=3, ignore_eos=True))[0]
    ids = PROMPTS[0]["prompt_token_ids"]
    with torch.inference_mode():
        ref = hf_model(ckpt)(torch.tensor([ids + out.token_ids])).logits[0, len(ids) - 1:-1].log_softmax(-1)
    assert len(out.logprobs) == 4
    for step, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        assert entry[token].rank == 1
        top = ref[step].topk(3)
        assert list(entry) == top.indices.tolist()
        for t, lp in zip(top.indices.tolist(), top.values.tolist()):
            assert entry[t].logprob == pytest.approx(lp, abs=1e-4)
            assert entry[t].decoded_token == llm.get_tokenizer().decode([t])


def test_stop_string_truncates_text(llm):
    base = gen(llm, PROMPTS[1], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
    stop = base.text[6:9]
    assert stop and base.text.find(stop) >= 0
    out = gen(llm, PROMPTS[1], SamplingParams(max_tokens=20, temperature=0, stop=[stop], ignore_eos=True))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == base.text[:base.text.find(stop)]


def test_stop_token_and_eos(llm):
    base = gen(llm, PROMPTS[1], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    stop_tok = base.token_ids[3]
    first = base.token_ids.index(stop_tok)
    out = gen(llm, PROMPTS[1], SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[stop_tok]))[0]
    assert out.token_ids == base.token_ids[:first + 1] and out.finish_reason == "stop"
    assert out.stop_reason == stop_tok
    outputs = llm.engine.outputs
    eos = outputs.eos_token_ids
    try:
        outputs.eos_token_ids = {stop_tok}
        out = gen(llm, PROMPTS[1], SamplingParams(max_tokens=10, temperature=0))[0]
        assert out.token_ids == base.token_ids[:first + 1] and out.finish_reason == "stop"
        ignored = gen(llm, PROMPTS[1], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
        assert ignored.token_ids == base.token_ids and ignored.finish_reason == "length"
    finally:
        outputs.eos_token_ids = eos


def metaspace_tokenizer():
    """A SentencePiece-style tokenizer, whose decode drops the space before the first word."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer, tk.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    tk.train_from_iterator(["def f(x): return x more", "x = 1 more text here"] * 3,
                           trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tk, clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("stream", [True, False], ids=["decode-stream", "windows"])
@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("kind", ["byte-level", "metaspace"])
def test_incremental_detokenization_equals_full_decode(llm, stream, skip, kind):
    tok = llm.get_tokenizer() if kind == "byte-level" else metaspace_tokenizer()
    detokenize = Detokenizer(tok)
    assert detokenize.stream_of is not None      # a fast tokenizer that keeps spaces as they are
    if not stream:
        detokenize.stream_of = None
    text = "def f(x):\n    return 'Ünïcödé ✓ 日本語'  # done" if kind == "byte-level" else " return x more"
    eos = tok.convert_tokens_to_ids("</s>")
    ids = [*tok.encode(text, add_special_tokens=False), eos, *tok.encode(" more", add_special_tokens=False)]
    # the first output token's space shows only after the prompt's last tokens
    seq = Sequence(0, "r", None, tok.encode("x =", add_special_tokens=False), SamplingParams(skip_special_tokens=skip),
                   100, 0.0)
    pieces = []
    for t in ids:
        seq.token_ids.append(t)
        pieces.append(detokenize(seq))
        assert "\ufffd" not in pieces[-1]
    full = tok.decode(seq.token_ids, skip_special_tokens=skip)
    prompt = tok.decode(seq.prompt_token_ids, skip_special_tokens=skip)
    assert "".join(pieces) == seq.output_text == full[len(prompt):]
    assert seq.output_text.startswith(" ") == text.startswith(" ")


@pytest.mark.parametrize("kind", ["byte-level", "metaspace"])
def test_text_caught_up_at_once_is_the_streamed_text(llm, kind):
    """A deferred text, all its tokens in one call, is the text streamed token by token: also where the tokens
    end inside a character (the text before that character stays)."""
    tok = llm.get_tokenizer() if kind == "byte-level" else metaspace_tokenizer()
    detokenize = Detokenizer(tok)
    prompt = tok.encode("x =", add_special_tokens=False)
    ids = tok.encode(" 'Ünïcödé ✓ 日本語' done" if kind == "byte-level" else " return x more", add_special_tokens=False)
    inside_a_character = 0
    for cut in range(1, len(ids) + 1):
        streamed, at_once = (Sequence(i, "r", None, prompt, SamplingParams(), 100, 0.0) for i in range(2))
        for t in ids[:cut]:
            streamed.token_ids.append(t)
            detokenize(streamed)
        at_once.token_ids += ids[:cut]
        assert detokenize(at_once, len(at_once.token_ids)) == at_once.output_text == streamed.output_text
        inside_a_character += tok.decode(ids[:cut]).endswith("\ufffd") and bool(streamed.output_text)
    assert inside_a_character or kind == "metaspace"


def test_chat_applies_the_template(llm):
    out = llm.chat([{"role": "user", "content": "hi there"}], SamplingParams(max_tokens=3), use_tqdm=False)[0]
    assert out.prompt == "<s>user: hi there\nassistant:"
    assert out.prompt_token_ids == llm.get_tokenizer().encode(out.prompt, add_special_tokens=False)
    assert len(out.outputs[0].token_ids) >= 1


def test_generate_accepts_strings_in_order(llm):
    outs = llm.generate(["def fibonacci(n):", "Once upon a time"], SamplingParams(max_tokens=3), use_tqdm=False)
    assert [o.prompt for o in outs] == ["def fibonacci(n):", "Once upon a time"]
    assert outs[0].prompt_token_ids == llm.get_tokenizer().encode("def fibonacci(n):")


def test_cli_generate(ckpt, capsys):
    from kvserve.cli import main
    assert main(["generate", "def fibonacci(n):", "--model", str(ckpt), "--max-tokens", "5",
                 "--num-kv-blocks", "16"]) == 0
    assert capsys.readouterr().out.startswith("def fibonacci(n):")
    assert main(["generate", "x", "--model", str(ckpt), "--max-tokens", "5", "--stream"]) == 0
    assert main(["generate", "x", "--model", str(ckpt), "--max-tokens", "0"]) == 2
    assert "max_tokens must be at least 1" in capsys.readouterr().err


@pytest.mark.parametrize("kwargs", [dict(), dict(max_num_batched_tokens=3), dict(cache_mode="none"),
                                    dict(num_kv_blocks=9, max_num_batched_tokens=5)])
def test_prompt_logprobs_match_transformers(ckpt, kwargs):
    """Every prompt token's logprob, also when the prompt streams through the cache in chunks."""
    llm = LLM(str(ckpt), block_size=4, **{"num_kv_blocks": 64, **kwargs})
    prompts = [{"prompt_token_ids": list(range(10, 30))}, {"prompt_token_ids": [7, 8, 9, 10, 11, 12, 13]}]
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, prompt_logprobs=2, ignore_eos=True), use_tqdm=False)
    hf = hf_model(ckpt)
    for prompt, out in zip(prompts, outs):
        ids = prompt["prompt_token_ids"]
        with torch.inference_mode():
            ref = hf(torch.tensor([ids])).logits[0, :-1].log_softmax(-1)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
        for pos, entry in enumerate(out.prompt_logprobs[1:]):
            token = ids[pos + 1]
            assert list(entry)[0] == token and len(entry) <= 3
            assert entry[token].logprob == pytest.approx(ref[pos, token].item(), abs=1e-4)
            assert entry[token].rank == int((ref[pos] > ref[pos, token]).sum()) + 1
            top = ref[pos].topk(2).indices.tolist()
            assert set(top) <= set(entry)


def test_out_of_range_seed_is_rejected_and_huge_top_k_is_clamped(llm):
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=2**63 - 2, n=4)
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=-1)
    out = gen(llm, PROMPTS[0], SamplingParams(max_tokens=3, temperature=1.0, top_k=2**62, logprobs=10**6, seed=1))
    assert len(out[0].token_ids) == 3 and len(out[0].logprobs[0]) <= 384 + 1


def test_an_interrupted_generate_leaves_nothing_behind(llm):
    engine, step = llm.engine, llm.engine.step
    calls = []

    def interrupted():
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return step()

    engine.step = interrupted
    with pytest.raises(KeyboardInterrupt):
        gen(llm, PROMPTS, SamplingParams(max_tokens=5))
    del engine.step
    assert not engine.has_unfinished_requests() and not engine.requests
    assert len(gen(llm, PROMPTS, SamplingParams(max_tokens=5, ignore_eos=True))) == 3


@pytest.mark.parametrize("rows, n", [(1, 32000), (64, 32000), (5, 151936), (3, 1024), (4, 1025), (3, 1151), (6, 100),
                                     (0, 4096)])
def test_tiled_argmax_equals_torch_argmax(rows, n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(rows, n, generator=g)
    if rows == 0:                                      # a step where nothing samples
        assert argmax(x).shape == (0,)
        return
    x[0, [7, n - 1]] = x[0].max() + 1                  # a tie: the first wins
    if rows > 1:
        x[1, n - 1] = x[1].max() + 1                   # the maximum in the last, maybe partial, tile
    if rows > 2:
        x[2, n // 2] = float("nan")                    # NaN counts as the largest, as in torch
    if rows > 3:
        x[3] = float("-inf")                           # nothing but -inf: the first
    assert torch.equal(argmax(x), x.argmax(-1))
    assert torch.equal(argmax(x.bfloat16().float()), x.bfloat16().float().argmax(-1))
    # bfloat16 logits as the model wrote them, and rows of a wider tensor
    assert torch.equal(argmax(x.bfloat16()), x.bfloat16().float().argmax(-1))
    assert torch.equal(argmax(x[:, : n - 3]), x[:, : n - 3].argmax(-1))


def test_argmax_of_empty_rows_raises_as_torch_does():
    with pytest.raises(IndexError):
        argmax(torch.empty(2, 0))


def test_argmax_without_avx512(tmp_path, monkeypatch):
    """The plain C loop that CPUs without AVX-512 run: torch's answer too, NaN and ties included."""
    if kernels.library() is None:
        pytest.skip("no C compiler")
    wrapper = tmp_path / "cc-no-avx512"
    wrapper.write_text('#!/bin/sh\nexec cc -mno-avx512f "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("CC", str(wrapper))
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path / "cache"))
    fn = kernels.typed(ctypes.CDLL(str(kernels.build())), "argmax_rows")
    x = torch.randn(4, 1000, generator=torch.Generator().manual_seed(0))
    x[0, [3, 900]] = 10.0
    x[1, 500] = float("nan")
    x[2] = float("-inf")
    for rows, dtype in ((x, 0), (x.bfloat16(), 1)):
        out = torch.empty(4, dtype=torch.int64)
        fn(rows.data_ptr(), 4, 1000, 1000, dtype, out.data_ptr(), 1)
        assert torch.equal(out, rows.float().argmax(-1))
