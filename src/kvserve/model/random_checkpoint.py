"""A Hugging Face checkpoint with seeded random weights and a small trained BPE tokenizer: the models the benches
measure and the tests check against transformers, built without a download."""
from __future__ import annotations

from pathlib import Path

import torch


def make_tokenizer(corpus: list[str] | None = None, vocab_size: int = 300, total: int | None = None):
    """A byte-level BPE trained on a few lines: enough for random-weight models fed token ids. `total`: the
    ids past the trained ones, up to it, are placeholder words (" w301"), so that every id a model of that
    vocabulary emits decodes to text, as with a real checkpoint's tokenizer (else its random outputs are
    mostly ids the tokenizer does not know, whose text never completes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = corpus or ["The quick brown fox jumps over the lazy dog.", "def f(x):\n    return x"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>", "<pad>"],
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    if total is not None:
        fast.add_tokens([f" w{i}" for i in range(len(fast), total)])
    return fast


def save_random_model(path: Path, config, dtype: torch.dtype = torch.float32, seed: int = 0,
                      tokenizer=None) -> Path:
    """Save a model of a transformers `config` with seeded random weights, and a tokenizer, as a checkpoint.
    Biases and norm scales are random too (transformers starts them at 0 and 1), so that a path that
    skips one gives other numbers."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.1)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
    model.to(dtype).save_pretrained(path)
    (tokenizer or make_tokenizer()).save_pretrained(path)
    return Path(path)
