"""Build tiny Llama-family checkpoints (config.json, model.safetensors, tokenizer) for the tests."""
from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 384
_CORPUS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "The quick brown fox jumps over the lazy dog. Once upon a time there was a cache.",
    "import os\nimport sys\nfor i in range(10):\n    print(i, os.getcwd())\n",
    "Paged attention splits the KV cache into blocks, like pages of memory. Ünïcödé ✓ 日本語",
]

ARCHS = {
    "llama": dict(cls="LlamaConfig", model="LlamaForCausalLM"),
    "mistral": dict(cls="MistralConfig", model="MistralForCausalLM"),
    "qwen2": dict(cls="Qwen2Config", model="Qwen2ForCausalLM"),
    "qwen3": dict(cls="Qwen3Config", model="Qwen3ForCausalLM"),
}


def make_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    fast.chat_template = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}assistant:{% endif %}")
    return fast


def make_config(arch: str = "llama", **overrides):
    import transformers

    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              bos_token_id=0, eos_token_id=1, initializer_range=0.2, tie_word_embeddings=False)
    kw.update(overrides)
    return getattr(transformers, ARCHS[arch]["cls"])(**kw)


def make_checkpoint(path: Path, arch: str = "llama", seed: int = 0, dtype=torch.float32, **overrides) -> Path:
    """Save a random-weight model of `arch` and a small BPE tokenizer to `path`."""
    import transformers

    torch.manual_seed(seed)
    cfg = make_config(arch, **overrides)
    model = getattr(transformers, ARCHS[arch]["model"])(cfg).to(dtype)
    model.save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return Path(path)


def hf_model(path: Path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager").eval()
