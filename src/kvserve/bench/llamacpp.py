"""llama.cpp beside kvserve in `bench throughput` and `bench spec`, on the same checkpoint (the `peers` extra).

The checkpoint is written to a BF16 GGUF (`write_gguf`, with the `gguf` package) and quantized by llama.cpp
itself to the types users download for these sizes: Q8_0 beside kvserve's int8 weights, Q4_0 beside int4.
For `bench throughput` llama.cpp runs through llama-cpp-python's C API (`LlamaCpp`), not its Python `Llama`
class, so that a batch of sequences decodes together, one token each a step, as the engine's does. For
`bench spec` it runs through the `Llama` class (batch 1), whose prompt lookup decoding is llama-cpp-python's
(LOOKUP_ROUTE). Only the Llama architecture is converted: the bench's other shapes (Qwen2's biases) have no
peer column.
"""
from __future__ import annotations

import ctypes
import importlib.util
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

# llama.cpp's file type for each of the bench's weight formats (llama_ftype: BF16 32, Q8_0 7, Q4_0 2)
PEER_TYPES = {None: ("bf16", 32), "int8": ("q8_0", 7), "int4": ("q4_0", 2)}
_BATCH = 512            # llama.cpp's logical batch: prompt tokens per llama_decode call
_QUIET = None           # the log callback that drops llama.cpp's lines, made on first use (kept: C holds it)
# What `bench spec`'s llama.cpp column runs, as it prints it: not llama.cpp's own lookup decoding
LOOKUP_ROUTE = ("llama-cpp-python's Llama.generate with llama_cpp.llama_speculative.LlamaPromptLookupDecoding: "
                "llama-cpp-python's numpy port of apoorvumang/prompt-lookup-decoding (the earliest match of the "
                "longest suffix n-gram), each step's token and drafts verified by one llama_decode; not llama.cpp's "
                "own lookup decoding (examples/lookup, common_ngram_cache)")


def available() -> bool:
    """Whether llama-cpp-python and gguf are installed (`pip install kvserve[peers]`)."""
    return all(importlib.util.find_spec(name) is not None for name in ("llama_cpp", "gguf"))


def _to_ggml_rope(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """q_proj / k_proj rows from Hugging Face's RoPE layout (channel i pairs with i + head_dim / 2) to GGML's
    (channel 2i with 2i + 1), as llama.cpp's own converter reorders them."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _tensors(config: dict):
    """(GGUF name, checkpoint name, heads to reorder for RoPE or 0) of each tensor of a Llama."""
    yield "token_embd.weight", "model.embed_tokens.weight", 0
    yield "output_norm.weight", "model.norm.weight", 0
    if not config.get("tie_word_embeddings"):
        yield "output.weight", "lm_head.weight", 0
    names = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
             "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    for i in range(config["num_hidden_layers"]):
        for ours, theirs in names.items():
            yield f"blk.{i}.{ours}.weight", f"model.layers.{i}.{theirs}.weight", heads.get(ours, 0)


def model_type(checkpoint: Path) -> str | None:
    """The checkpoint's model_type (config.json's): write_gguf converts "llama" alone."""
    return json.loads((checkpoint / "config.json").read_text()).get("model_type")


def write_gguf(checkpoint: Path, out: Path) -> Path:
    """A BF16 GGUF (norms in float32, as llama.cpp keeps them) of the Llama checkpoint at `checkpoint`, with no
    tokenizer ("no_vocab": token ids in, logits out). ValueError for another architecture."""
    import gguf

    config = json.loads((checkpoint / "config.json").read_text())
    if model_type(checkpoint) != "llama":
        raise ValueError(f"the llama.cpp peer converts Llama checkpoints only, not {model_type(checkpoint)!r}")
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer = gguf.GGUFWriter(out, "llama")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float((config.get("rope_parameters") or config).get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    writer.add_tokenizer_model("no_vocab")
    writer.add_vocab_size(config["vocab_size"])
    with safe_open(checkpoint / "model.safetensors", "pt") as f:
        for name, source, heads in _tensors(config):
            w = f.get_tensor(source)
            if heads:
                w = _to_ggml_rope(w, heads)
            if w.dim() == 1:
                writer.add_tensor(name, w.float().numpy())
            else:
                bits = w.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
                writer.add_tensor(name, bits, raw_dtype=gguf.GGMLQuantizationType.BF16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _library():
    """llama_cpp, its log (a line per tensor loaded or quantized) silenced."""
    import llama_cpp

    global _QUIET
    if _QUIET is None:
        _QUIET = llama_cpp.llama_log_callback(lambda level, text, data: None)
    llama_cpp.llama_log_set(_QUIET, ctypes.c_void_p(0))
    return llama_cpp


def quantize(source: Path, out: Path, ftype: int, threads: int) -> Path:
    """`source` (a GGUF) quantized by llama.cpp to llama_ftype `ftype` (its defaults for every other choice)."""
    llama_cpp = _library()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = ftype, threads
    if llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {source} to file type {ftype}")
    return out


class LlamaCpp:
    """A llama.cpp model and context for up to `max_seqs` sequences of `max_len` tokens, on `threads` threads."""

    def __init__(self, path: Path, max_seqs: int, max_len: int, threads: int):
        self.lib = llama_cpp = _library()
        llama_cpp.llama_backend_init()
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), llama_cpp.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        params = llama_cpp.llama_context_default_params()
        params.n_ctx, params.n_seq_max = max_seqs * max_len, max_seqs
        params.n_batch = params.n_ubatch = _BATCH
        params.n_threads = params.n_threads_batch = threads
        self.ctx = llama_cpp.llama_init_from_model(self.model, params)
        self.vocab_size = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.batch = llama_cpp.llama_batch_init(max(_BATCH, max_seqs), 0, 1)

    def close(self) -> None:
        """Frees the batch, context and model."""
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)
        self.lib.llama_model_free(self.model)

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> list[int]:
        """One llama_decode of (token, position, sequence, wants logits) entries; the greedy next token of
        each entry that wants logits, in order."""
        b = self.batch
        for i, (token, pos, seq, logits) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, logits
            b.seq_id[i][0] = seq
        b.n_tokens = len(entries)
        if self.lib.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")
        return [int(self.logits(i).argmax()) for i, e in enumerate(entries) if e[3]]

    def logits(self, i: int) -> np.ndarray:
        """The logits of entry `i` of the last decode (a view of llama.cpp's buffer)."""
        return np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.ctx, i), shape=(self.vocab_size,))

    def prompt_logits(self, prompt: list[int]) -> np.ndarray:
        """The logits after `prompt` (prefilled alone; the cache is cleared first), as a view of llama.cpp's
        buffer until the next decode."""
        self.generate([prompt], 1)
        return self.logits(-1)

    def generate(self, prompts: list[list[int]], tokens: int) -> tuple[list[list[int]], list[float]]:
        """Greedy `tokens` new tokens for each prompt, the prompts prefilled in batches of up to _BATCH tokens
        and then decoded together, one token each a step; the outputs, and the seconds of each step (the
        prefill as one, then each decode step). The cache is cleared first."""
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)
        entries = [(t, pos, s, pos == len(p) - 1) for s, p in enumerate(prompts) for pos, t in enumerate(p)]
        start = time.perf_counter()
        last = [tok for i in range(0, len(entries), _BATCH) for tok in self._decode(entries[i:i + _BATCH])]
        times = [time.perf_counter() - start]
        outs = [[t] for t in last]
        for step in range(tokens - 1):
            start = time.perf_counter()
            last = self._decode([(t, len(p) + step, s, True) for s, (t, p) in enumerate(zip(last, prompts))])
            times.append(time.perf_counter() - start)
            for out, t in zip(outs, last):
                out.append(t)
        return outs, times


@dataclass
class CountedDrafts:
    """A draft model for llama-cpp-python's `Llama(draft_model=...)`: `draft`'s drafts, counted. Llama.generate asks
    it once before each llama_decode of the next token (with the drafts)."""

    draft: Callable
    calls: int = 0
    tokens: int = 0

    def __call__(self, input_ids: np.ndarray, /, **kwargs) -> np.ndarray:
        drafts = self.draft(input_ids, **kwargs)
        self.calls += 1
        self.tokens += len(drafts)
        return drafts


def lookup_llama(path: Path, n_ctx: int, threads: int, lookup: tuple[int, int] | None):
    """llama-cpp-python's `Llama` over the GGUF at `path`, on `threads` threads (prompt and decode alike), with
    `lookup` = (max n-gram, drafts) a CountedDrafts of its LlamaPromptLookupDecoding (LOOKUP_ROUTE) as its draft
    model, or none."""
    llama_cpp = _library()
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    draft = None if lookup is None else CountedDrafts(LlamaPromptLookupDecoding(*lookup))
    # logits_all with a draft model: Llama turns it on itself then, but sizes its logits buffer by the argument
    # (n_batch rows), which a prompt and its outputs past n_batch tokens overflow
    return llama_cpp.Llama(str(path), n_ctx=n_ctx, n_batch=_BATCH, n_threads=threads, n_threads_batch=threads,
                           logits_all=draft is not None, draft_model=draft, verbose=False)


def greedy_decode(llama, prompt: list[int], tokens: int) -> tuple[list[int], float]:
    """`Llama.generate`'s greedy tokens after `prompt`, from an empty cache: the first (after the prompt's
    evaluation, untimed) and `tokens` more, and the seconds those took."""
    llama.reset()
    gen = llama.generate(prompt, temp=0.0, reset=True)
    out = [next(gen)]
    start = time.perf_counter()
    out += [next(gen) for _ in range(tokens)]
    seconds = time.perf_counter() - start
    gen.close()
    return out, seconds
