"""Checkpoints as users have them: with a sentencepiece tokenizer.model only, with no tokenizer at all
(skip_tokenizer_init: token ids in and out), or with the tokenizer files missing by mistake."""
from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from kvserve import LLM, SamplingParams
from kvserve.cli import build_parser, engine_kwargs, main
from tiny_models import _CORPUS, make_checkpoint

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
PROMPTS = [{"prompt_token_ids": [5, 17, 42]}, {"prompt_token_ids": list(range(10, 30))}, {"prompt_token_ids": [7]}]


def without_tokenizer(path: Path) -> Path:
    for name in TOKENIZER_FILES:
        (path / name).unlink(missing_ok=True)
    return path


@pytest.fixture(scope="module")
def ckpt(checkpoint):
    # eos 5 in config.json and generation_config.json; the tokenizer's own eos ("</s>") is 1
    return checkpoint("llama", eos_token_id=5)


@pytest.fixture(scope="module")
def bare(tmp_path_factory):
    return without_tokenizer(make_checkpoint(tmp_path_factory.mktemp("bare"), "llama", eos_token_id=5))


def numbers(entry: dict) -> dict[int, tuple[float, int]]:
    return {t: (lp.logprob, lp.rank) for t, lp in entry.items()}


def test_skip_tokenizer_init_gives_token_ids_and_no_text(ckpt, bare):
    full = LLM(str(ckpt), block_size=4, num_kv_blocks=64)
    ids_only = LLM(str(bare), block_size=4, num_kv_blocks=64, skip_tokenizer_init=True)
    assert ids_only.engine.tokenizer is None
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    want = full.generate(PROMPTS, params, use_tqdm=False)
    got = ids_only.generate(PROMPTS, params, use_tqdm=False)
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids and g.outputs[0].text == ""
        assert w.outputs[0].text
        for wl, gl in zip(w.outputs[0].logprobs + w.prompt_logprobs[1:], g.outputs[0].logprobs + g.prompt_logprobs[1:]):
            assert numbers(wl) == numbers(gl)
            assert all(lp.decoded_token is None for lp in gl.values())
            assert all(lp.decoded_token is not None for lp in wl.values())
    # streamed a step at a time, as the server does: no text either
    ids_only.engine.add_request("s", PROMPTS[0], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    while ids_only.engine.has_unfinished_requests():
        for out in ids_only.engine.step():
            assert out.outputs[0].text == ""
    assert out.finished and len(out.outputs[0].token_ids) == 3


def test_without_a_tokenizer_eos_comes_from_the_model_config(ckpt, bare):
    assert LLM(str(ckpt), num_kv_blocks=16).engine.eos_token_ids == {5, 1}
    engine = LLM(str(bare), num_kv_blocks=16, skip_tokenizer_init=True).engine
    assert engine.eos_token_ids == {5}


def test_without_a_tokenizer_text_is_refused(bare):
    llm = LLM(str(bare), block_size=4, num_kv_blocks=64, skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="text prompt needs a tokenizer.*skip_tokenizer_init"):
        llm.generate("Once upon a time", use_tqdm=False)
    with pytest.raises(ValueError, match="stop strings need a tokenizer.*stop_token_ids"):
        llm.generate(PROMPTS[0], SamplingParams(stop=["\n"]), use_tqdm=False)
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.get_tokenizer()
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)
    assert not llm.engine.requests
    # a prompt dict with its text and its ids is fine: the ids are used
    out = llm.generate({"prompt": "hi", "prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=2), use_tqdm=False)
    assert out[0].prompt == "hi" and out[0].prompt_token_ids == [5, 6]


def test_cli_flag(bare, capsys):
    args = build_parser().parse_args(["generate", "x", "--skip-tokenizer-init"])
    assert engine_kwargs(args)["skip_tokenizer_init"] is True
    assert engine_kwargs(build_parser().parse_args(["generate", "x"]))["skip_tokenizer_init"] is False
    assert main(["generate", "x", "--model", str(bare), "--skip-tokenizer-init", "--num-kv-blocks", "16"]) == 2
    assert "text prompt needs a tokenizer" in capsys.readouterr().err


@pytest.mark.parametrize("keep_config", [False, True], ids=["nothing", "tokenizer_config.json only"])
def test_missing_tokenizer_files_are_named(bare, tmp_path, keep_config):
    path = tmp_path / "ckpt"
    path.mkdir()
    for f in bare.iterdir():
        (path / f.name).symlink_to(f)
    if keep_config:
        (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    with pytest.raises(FileNotFoundError) as err:
        LLM(str(path), num_kv_blocks=16)
    message = str(err.value)
    assert str(path) in message and "skip_tokenizer_init" in message
    assert all(name in message for name in ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt"))
    assert ("it has tokenizer_config.json but" in message) == keep_config


def train_sentencepiece(vocab_size: int) -> bytes:
    """A Llama-style sentencepiece model (BPE with byte fallback) trained on a few lines."""
    import sentencepiece as spm

    model = io.BytesIO()
    lines = [line for text in _CORPUS for line in text.splitlines() if line.strip()]
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model, vocab_size=vocab_size,
                                   model_type="bpe", byte_fallback=True, hard_vocab_limit=False,
                                   unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
    return model.getvalue()


@pytest.fixture(scope="module")
def sentencepiece_ckpt(tmp_path_factory):
    """An older Llama/Mistral checkpoint: tokenizer.model and a tokenizer_config.json naming LlamaTokenizer."""
    path = without_tokenizer(make_checkpoint(tmp_path_factory.mktemp("spm"), "llama", eos_token_id=2))
    (path / "tokenizer.model").write_bytes(train_sentencepiece(384))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "add_bos_token": True, "add_eos_token": False}))
    return path


def test_a_sentencepiece_only_checkpoint_runs_end_to_end(sentencepiece_ckpt):
    import sentencepiece as spm
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(sentencepiece_ckpt))
    sp = spm.SentencePieceProcessor(model_file=str(sentencepiece_ckpt / "tokenizer.model"))
    assert len(reference) == 384
    llm = LLM(str(sentencepiece_ckpt), block_size=4, num_kv_blocks=64)
    texts = ["def fibonacci(n):", "Once upon a time there was", "Paged attention 日本"]
    outs = llm.generate(texts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), use_tqdm=False)
    for text, out in zip(texts, outs):
        assert out.prompt_token_ids == [1] + sp.encode(text) == reference.encode(text)
        ids = out.prompt_token_ids + out.outputs[0].token_ids
        full = reference.decode(ids, skip_special_tokens=True)
        assert out.outputs[0].text == full[len(reference.decode(out.prompt_token_ids, skip_special_tokens=True)):]
    assert llm.engine.eos_token_ids == {2}
    # the text comes from the tokens, stop strings included
    first = outs[1].outputs[0]
    stop = first.text.strip()[:2]
    cut = llm.generate(texts[1], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.text == first.text[:first.text.find(stop)]
    assert cut.token_ids == first.token_ids[:len(cut.token_ids)]
