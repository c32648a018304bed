"""Tiny checkpoints of every supported family (config.json, model.safetensors, tokenizer) for the tests."""
from __future__ import annotations

from pathlib import Path

import torch

from kvserve.model.random_checkpoint import make_tokenizer, save_random_model

VOCAB = 384
_CORPUS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "The quick brown fox jumps over the lazy dog. Once upon a time there was a cache.",
    "import os\nimport sys\nfor i in range(10):\n    print(i, os.getcwd())\n",
    "Paged attention splits the KV cache into blocks, like pages of memory. Ünïcödé ✓ 日本語",
] * 4
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
CONFIG_CLASSES = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config",
                  "gemma2": "Gemma2Config", "gemma3": "Gemma3TextConfig", "phi3": "Phi3Config"}
# Phi3Config's default pad_token_id (32000) lies outside the tiny vocabulary
_ARCH_DEFAULTS = {"phi3": dict(pad_token_id=2)}


# The hybrid shapes tests of several layers run (conftest's fixtures of the same names): sliding layers of window 8
HYBRID = {
    # three layers: two sliding, one global: three layer groups of one layer
    "gemma3": dict(arch="gemma3", sliding_window=8, head_dim=16, num_hidden_layers=3, sliding_window_pattern=3),
    # two layers: a sliding one and a global one: two layer groups
    "gemma2": dict(arch="gemma2", sliding_window=8, head_dim=16, query_pre_attn_scalar=24,
                   attn_logit_softcapping=2.0, final_logit_softcapping=5.0),
    # every layer sliding: one layer group, no global one to evict from
    "mistral": dict(arch="mistral", sliding_window=8),
}


def make_config(arch: str = "llama", **overrides):
    import transformers

    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              bos_token_id=0, eos_token_id=1, initializer_range=0.2, tie_word_embeddings=False,
              **_ARCH_DEFAULTS.get(arch, {}))
    kw.update(overrides)
    return getattr(transformers, CONFIG_CLASSES[arch])(**kw)


def make_checkpoint(path: Path, arch: str = "llama", seed: int = 0, dtype=torch.float32, **overrides) -> Path:
    """Save a random-weight model of `arch` and a small BPE tokenizer with a chat template to `path`."""
    tokenizer = make_tokenizer(_CORPUS, VOCAB)
    tokenizer.chat_template = CHAT_TEMPLATE
    return save_random_model(path, make_config(arch, **overrides), dtype, seed, tokenizer)


def hf_model(path: Path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager").eval()
