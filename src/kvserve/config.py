"""Configuration: the model's shape (from config.json), the cache, the scheduler."""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Phi3ForCausalLM",
)
GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
# the MLP's gate activation: SwiGLU's, or GeGLU's with tanh-approximated GELU (Gemma's)
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")
CACHE_MODES = ("paged", "contiguous", "none")
ATTENTION_BACKENDS = ("auto", "sdpa", "native", "flash", "triton", "textbook")
QUANTIZED_KV_CACHE_DTYPES = ("int8", "fp8", "int4")
# weight-only quantizations of the linear layers (vLLM's --quantization), CPU only: csrc/gemm.c's panels
QUANTIZATIONS = ("int8", "int4")
# full-precision pages: auto, or the model's dtype by name (vLLM's --kv-cache-dtype bfloat16, and the short names)
KV_CACHE_DTYPES = ("auto", "bfloat16", "bf16", "float16", "fp16", *QUANTIZED_KV_CACHE_DTYPES)
_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: int | float | str) -> int:
    """Bytes from an int or a string such as '2GiB', '512MB', '1e9'."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"memory size must be a finite positive number, got {value}")
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot parse memory size {value!r}: use bytes or a number with a unit "
                         f"such as 512MiB, 2GiB, 1.5GB")
    return parse_bytes(float(m.group(1)) * _UNITS[m.group(2).lower()])


def resolve_device(device: str | None) -> torch.device:
    """The engine's device: `device` (cpu, cuda or cuda:N) where this machine has it, else ValueError saying why;
    None: cuda where torch sees a GPU, else cpu."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: kvserve runs on cpu or cuda (cuda:N)")
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if dev.index is not None and dev.index >= count or not count:
            raise ValueError(f"device {device!r}: this machine has {count or 'no'} CUDA GPU{'s' * (count != 1)} "
                             f"that torch can use; use device cpu")
    return dev


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose auto, float32, bfloat16 or float16")
    return _DTYPES[dtype]


@dataclass
class ModelConfig:
    """The decoder's shape, read from a Hugging Face config.json."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    torch_dtype: torch.dtype | None
    # per layer: the window W of a sliding-window layer, whose query at position p attends to the positions
    # (p - W, p] (transformers' convention), or None for a layer that attends to the whole context
    sliding_windows: tuple[int | None, ...] = ()
    hidden_act: str = "silu"                        # the MLP's gate activation (HIDDEN_ACTS)
    attn_logit_softcapping: float | None = None     # attention scores s become c * tanh(s / c) (Gemma 2)
    final_logit_softcapping: float | None = None    # the same on the logits
    query_pre_attn_scalar: float | None = None      # attention scale 1/sqrt(this), not 1/sqrt(head_dim) (Gemma)
    # Gemma's norms: a norm scales by (1 + weight), each sublayer's output is normed before it joins the
    # residual stream (post_attention_layernorm, post_feedforward_layernorm) and the MLP's input by
    # pre_feedforward_layernorm
    gemma_norms: bool = False
    embed_scale: float = 1.0                        # the embeddings are multiplied by it (Gemma: sqrt(hidden_size))
    rope_local_base_freq: float | None = None       # the RoPE base of sliding-window layers (Gemma 3), unscaled
    partial_rotary_factor: float = 1.0              # RoPE rotates this share of a head's channels (Phi-4-mini)
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(f"unsupported architecture {archs or cfg.get('model_type')!r}; "
                             f"kvserve supports {', '.join(SUPPORTED_ARCHITECTURES)}")
        gemma = arch in GEMMA_ARCHITECTURES
        num_heads = cfg["num_attention_heads"]
        num_kv_heads = cfg.get("num_key_value_heads") or num_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads ({num_heads}) must be a multiple of "
                             f"num_key_value_heads ({num_kv_heads})")
        # Gemma's configs name it hidden_activation, GeGLU's by default (their hidden_act is not what runs)
        act = (cfg.get("hidden_activation") or "gelu_pytorch_tanh") if gemma else cfg.get("hidden_act", "silu")
        if act not in HIDDEN_ACTS:
            raise ValueError(f"unsupported hidden_act {act!r}; supported: {', '.join(HIDDEN_ACTS)}")
        if cfg.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention is set: an embedding model, not a causal LM")
        rope, theta, local_theta = _rope(cfg, arch)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        rope_scaling = None if rope_type == "default" else {**rope, "rope_type": rope_type}
        eos = cfg.get("eos_token_id")
        num_layers = cfg["num_hidden_layers"]
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", gemma),     # Gemma's configs tie by default
            # Qwen2 always has q/k/v biases; the others say so in attention_bias.
            qkv_bias=arch == "Qwen2ForCausalLM" or cfg.get("attention_bias", False),
            o_bias=arch != "Qwen2ForCausalLM" and cfg.get("attention_bias", False),
            mlp_bias=cfg.get("mlp_bias", False),
            qk_norm=arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"),
            torch_dtype=_DTYPES.get(cfg.get("torch_dtype") or cfg.get("dtype") or "", None),
            sliding_windows=_sliding_windows(cfg, arch, num_layers),
            hidden_act=act,
            attn_logit_softcapping=cfg.get("attn_logit_softcapping") if gemma else None,
            final_logit_softcapping=cfg.get("final_logit_softcapping") if gemma else None,
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar") if gemma else None,
            gemma_norms=gemma,
            embed_scale=cfg["hidden_size"] ** 0.5 if gemma else 1.0,
            rope_local_base_freq=local_theta,
            partial_rotary_factor=float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))),
            eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
            bos_token_id=cfg.get("bos_token_id"),
        )

    @classmethod
    def from_path(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        return cls.from_dict(json.loads(path.read_text()))

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def rotary_dim(self) -> int:
        """The channels of a head that RoPE rotates (the first ones)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def has_sliding_window(self) -> bool:
        """Whether some layer attends within a sliding window."""
        return any(w is not None for w in self.sliding_windows)


# what config.json says of sliding windows, by architecture: Mistral and Phi-3 window every layer; Qwen2/3 the
# layers from max_window_layers on, once use_sliding_window (default off) turns it on; Gemma 2 every other layer
# and Gemma 3 five in six (sliding_window_pattern), unless layer_types names each layer's kind
_WINDOWED = ("MistralForCausalLM", "Phi3ForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", *GEMMA_ARCHITECTURES)
_LAYER_TYPES = ("sliding_attention", "full_attention")


def _sliding_windows(cfg: dict[str, Any], arch: str, num_layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: full attention), as transformers reads config.json."""
    window = cfg.get("sliding_window") if arch in _WINDOWED else None
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not cfg.get("use_sliding_window", False):
        window = None
    if window is None:
        return (None,) * num_layers
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ValueError(f"sliding_window must be a positive integer, got {window!r}")
    types = cfg.get("layer_types") if arch not in ("MistralForCausalLM", "Phi3ForCausalLM") else None
    if types is None:
        if arch == "Gemma2ForCausalLM":
            types = [_LAYER_TYPES[i % 2] for i in range(num_layers)]
        elif arch == "Gemma3ForCausalLM":
            pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6
            types = [_LAYER_TYPES[(i + 1) % pattern == 0] for i in range(num_layers)]
        elif arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
            first = cfg.get("max_window_layers", 28)
            types = [_LAYER_TYPES[i < first] for i in range(num_layers)]
        else:
            types = [_LAYER_TYPES[0]] * num_layers
    if len(types) != num_layers or any(t not in _LAYER_TYPES for t in types):
        raise ValueError(f"layer_types must name {num_layers} layers, each one of {', '.join(_LAYER_TYPES)}; "
                         f"got {types!r}")
    return tuple(window if t == "sliding_attention" else None for t in types)


def _rope(cfg: dict[str, Any], arch: str) -> tuple[dict[str, Any], float, float | None]:
    """The RoPE parameters of the full-attention layers (rope_scaling's keys, less rope_theta), their base, and
    the base of the sliding layers where it differs (Gemma 3; None elsewhere)."""
    # transformers 5 folds rope_theta and rope_scaling into rope_parameters, per layer type for Gemma 3
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    local_theta = None
    if arch == "Gemma3ForCausalLM":
        local = {"rope_theta": cfg.get("rope_local_base_freq", 10000.0)}
        if "full_attention" in rope or "sliding_attention" in rope:
            local = dict(rope.get("sliding_attention") or local)
            rope = dict(rope.get("full_attention") or {})
        if local.get("rope_type", local.get("type", "default")) != "default":
            raise ValueError(f"unsupported RoPE of Gemma 3's sliding layers {local!r}: only their rope_theta")
        local_theta = float(local.get("rope_theta", 10000.0))
    theta = rope.pop("rope_theta", None) or cfg.get("rope_theta", 1000000.0 if arch == "Gemma3ForCausalLM" else 10000.0)
    if arch == "Phi3ForCausalLM" and rope.get("rope_type", rope.get("type")) in ("su", "yarn"):
        rope["rope_type"] = "longrope"         # transformers' names of Phi-3's rope before longrope
    if rope.get("rope_type", rope.get("type")) == "longrope":
        original = rope.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
        if original is None:
            raise ValueError("longrope needs original_max_position_embeddings")
        # transformers' default factor: the context the model was extended to over the original one
        factor = rope.get("factor") or cfg.get("max_position_embeddings", original) / original
        rope.update(original_max_position_embeddings=original, factor=factor)
    return rope, theta, local_theta


@dataclass
class CacheConfig:
    """How the KV pool is laid out and sized."""

    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int | str | None = None
    cache_mode: str = "paged"
    watermark: float = 0.01

    def __post_init__(self):
        if self.cache_mode not in CACHE_MODES:
            raise ValueError(f"cache_mode must be one of {CACHE_MODES}, got {self.cache_mode!r}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory is not None:
            try:
                self.kv_cache_memory = parse_bytes(self.kv_cache_memory)
            except ValueError as e:
                raise ValueError(f"kv_cache_memory: {e}") from None
        if not 0 <= self.watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 2048
    long_prefill_token_threshold: int | None = None   # most prompt tokens of one sequence per step

    def __post_init__(self):
        if self.long_prefill_token_threshold is None:
            self.long_prefill_token_threshold = self.max_model_len
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "long_prefill_token_threshold"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def option(default: Any, help_text: str, **flag: Any) -> Any:
    """A field of EngineConfig: its default and its help text, which the `kvserve` command's flag shows, and what
    the flag needs beyond the field's type (kvserve.arg_utils): its choices (a tuple, or a function returning
    one), aliases, metavar, or a cli_default where the command's default is not the library's."""
    return field(default=default, metadata={"help": help_text, **flag})


def _preemption_modes() -> tuple[str, ...]:
    from kvserve.kv.tiers import PREEMPTION_MODES    # kvserve.kv imports this module

    return PREEMPTION_MODES


@dataclass
class EngineConfig:
    """Everything LLM(...) accepts, validated; the model itself is resolved by the engine."""

    model: str | None = option(None, "checkpoint directory or hub id (default: the bundled demo model)")
    dtype: str = option("auto", "the weights' and activations' dtype (auto: the checkpoint's; float16 runs as float32 "
                                "on the CPU)", choices=("auto", "float32", "bfloat16", "float16"))
    device: str | None = option(None, "cpu or cuda (default: cuda when present)")
    seed: int = option(0, "seed of the sampling of requests that give no seed of their own")
    max_model_len: int | None = option(None, "most tokens of a sequence, prompt and output (default: the model's "
                                             "trained positions)")
    block_size: int = option(16, "tokens of a KV cache block")
    num_kv_blocks: int | None = option(None, "blocks of the KV pool (default: as many as --kv-cache-memory holds)")
    kv_cache_memory: int | str | None = option(None, "the KV pool's size: bytes, or a size such as 2GiB (default: on "
                                                     "the CPU 2GiB, at most what --max-num-seqs sequences of "
                                                     "--max-model-len use; on a GPU, --gpu-memory-utilization's share)")
    max_num_seqs: int = option(256, "most sequences of one step")
    max_num_batched_tokens: int | None = option(None, "most tokens of one step (default: 8192, or --max-model-len "
                                                      "where longer)")
    long_prefill_token_threshold: int | None = option(None, "most prompt tokens of one sequence per step (chunked "
                                                            "prefill)")
    cache_mode: str = option("paged", "paged: blocks taken on demand; contiguous: one max-length block a sequence; "
                                      "none: no cache, a sequence is computed whole each step", choices=CACHE_MODES)
    attention_backend: str = option("auto", "the attention kernels (auto: triton on CUDA, native on the CPU)",
                                    choices=ATTENTION_BACKENDS)
    enable_prefix_caching: bool = option(True, "reuse the computed full blocks of earlier prompts, keyed by their "
                                               "tokens")
    kv_cache_dtype: str = option("auto", "store K/V as int8, fp8 or int4 pages (auto: the model's dtype)",
                                 choices=KV_CACHE_DTYPES)
    kv_cache_dtype_skip_layers: tuple[int, ...] = option((), "comma-separated layers kept in the model's dtype, "
                                                             "e.g. 0,31")
    eviction: str | dict | None = option(None, 'KV eviction of every request that asks for none of its own: '
                                               '"sink:sinks=4,window=1020", '
                                               '"h2o:budget=512,recent=64,score=max" or "snapkv:budget=512,window=32"')
    sparse_attention: str | dict | None = option(None, 'sparse decode attention of every request that asks for none '
                                                       'of its own, over page summaries the cache then keeps: '
                                                       '"quest:budget=2048,recent=128,sinks=16,dense_layers=2" (a '
                                                       'request may set its own, or "none")')
    allow_long_max_model_len: bool = option(False, "accept a --max-model-len past the model's trained positions")
    gpu_memory_utilization: float = option(0.9, "share of the GPU for weights, activations and the KV cache (when "
                                                "its size is not given)")
    enforce_eager: bool = option(False, "decode op by op: no CUDA graphs on a GPU; on the CPU, no native decode step")
    num_scheduler_steps: int = option(8, "decode steps one native CPU call may run where nobody sees the steps "
                                         "between (offline greedy batches); 1: one a call")
    cpu_allocator_tuning: bool = option(False, "on the CPU, keep freed memory in the process for the next step's "
                                               "tensors (glibc malloc settings, process-wide: so LLM(...) leaves "
                                               "them alone unless asked, and the command sets them)",
                                        cli_default=True)
    skip_tokenizer_init: bool = option(False, "load no tokenizer: prompts must be token ids, and outputs have token "
                                              "ids but no text (vLLM's skip_tokenizer_init)")
    tensor_parallel_size: int = option(1, "ranks the model and the KV cache are split across: this process and N-1 "
                                          "spawned workers (gloo on the CPU, NCCL on CUDA); --kv-cache-memory is "
                                          "then per rank", aliases=("-tp",))
    disable_hybrid_kv_cache_manager: bool = option(False, "one block table for all layers of a sliding-window model: "
                                                          "every layer keeps every token (default: each layer group "
                                                          "its own, a sliding group only its window)")
    kv_offload: str | None = option(None, "a second tier for the blocks the prefix cache evicts: disk:PATH keeps them "
                                          "in files that a restarted engine finds; cpu (CUDA only) in pinned host "
                                          "memory; redis://HOST:PORT[/DB] in a Redis server that replicas share "
                                          "(written through: each full block as soon as it is computed)",
                                    metavar="disk:PATH|cpu|redis://HOST:PORT")
    kv_offload_size: int | str | None = option(None, "the tier's size, e.g. 16GiB (default 16GiB); per rank under "
                                                     "tensor parallelism, each keeping its KV heads' pages")
    preemption_mode: str | None = option(None, "with --kv-offload, what a preempted sequence's blocks do: swap "
                                               "(written to the tier and read back when it resumes) or recompute; "
                                               "by default, whichever a prefill and a transfer timed at start-up "
                                               "say costs less", choices=_preemption_modes)
    kv_events_endpoint: str | None = option(None, "publish KV cache events (vLLM's format: ZeroMQ PUB, msgpack) on "
                                                  "this address, bound, e.g. tcp://*:5557 (default: none published)")
    kv_events_replay_endpoint: str | None = option(None, "answer replay requests of missed events on this address "
                                                         "(ZeroMQ ROUTER), e.g. tcp://*:5558")
    kv_events_topic: str = option("", "the topic of every KV events message")
    kv_events_buffer_steps: int = option(10_000, "KV event batches kept for replay")
    kv_events_hwm: int = option(100_000, "the high-water mark of the KV events socket: messages queued per "
                                         "subscriber before ZeroMQ drops them")
    kv_events_max_queue_size: int = option(100_000, "KV events waiting for the publisher thread; past it an event is "
                                                    "dropped and counted (a step never waits)")
    quantization: str | None = option(None, "weight-only quantization of every linear layer (lm_head too) at load, "
                                            "CPU only: int8 per output channel, int4 in groups of 32 with a scale "
                                            "and a minimum each", choices=QUANTIZATIONS)
    step_timeout: float | None = option(None, "seconds a tensor-parallel step may take before its ranks are taken "
                                              "to hang: they are killed and the engine fails as for a dead rank (a "
                                              "server starts a new one); default: the largest of 120 s, 20x the "
                                              "slowest step seen, and 20x the slowest time per token seen for the "
                                              "step's tokens", metavar="SECONDS")
    speculative_config: str | dict | None = option(None, 'speculative decoding, vLLM\'s JSON: {"method": "ngram", '
                                                        '"num_speculative_tokens": 4, "prompt_lookup_min": 2, '
                                                        '"prompt_lookup_max": 4} (drafts copied from earlier text) or '
                                                        '{"model": PATH, "num_speculative_tokens": 4} (a draft model '
                                                        'sharing the tokenizer); "disable_by_batch_size": no drafts '
                                                        'while more sequences run', metavar="JSON")

    def __post_init__(self):
        from kvserve.engine.speculative import SpeculativeConfig, check_eviction   # they import this module
        from kvserve.kv.eviction import parse_eviction
        from kvserve.kv.sparse import parse_sparse_attention
        from kvserve.kv.tiers import PREEMPTION_MODES, parse_kv_offload

        eviction = parse_eviction(self.eviction)
        parse_sparse_attention(self.sparse_attention)
        if SpeculativeConfig.parse(self.speculative_config) is not None:
            if self.cache_mode == "none":
                raise ValueError("speculative_config verifies drafts over the KV cache: it needs cache_mode 'paged' or "
                                 "'contiguous' (none computes every token of a sequence at each step)")
            check_eviction(eviction)
        parse_kv_offload(self.kv_offload)
        if self.kv_offload_size is not None:
            try:
                self.kv_offload_size = parse_bytes(self.kv_offload_size)
            except ValueError as e:
                raise ValueError(f"kv_offload_size: {e}") from None
        if self.kv_offload is not None and not (self.cache_mode == "paged" and self.enable_prefix_caching):
            raise ValueError("kv_offload keeps blocks of the prefix cache: it needs cache_mode 'paged' and "
                             "enable_prefix_caching")
        if self.preemption_mode not in (None, *PREEMPTION_MODES):
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES} or None, got {self.preemption_mode!r}")
        if self.preemption_mode == "swap" and self.kv_offload is None:
            raise ValueError("preemption_mode 'swap' moves a preempted sequence's blocks to the second tier: it "
                             "needs kv_offload")
        if self.eviction is not None and self.cache_mode != "paged":
            raise ValueError(f"eviction needs cache_mode 'paged' (it drops blocks), got {self.cache_mode!r}")
        if self.sparse_attention is not None and self.cache_mode == "none":
            raise ValueError("sparse_attention reads some of a sequence's cached blocks: it needs a KV cache "
                             "(cache_mode 'paged' or 'contiguous')")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype in QUANTIZED_KV_CACHE_DTYPES and self.cache_mode != "paged":
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype!r} needs cache_mode 'paged', "
                             f"got {self.cache_mode!r}")
        self.kv_cache_dtype_skip_layers = tuple(self.kv_cache_dtype_skip_layers)
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                             f"got {self.attention_backend!r}")
        if self.dtype != "auto":
            parse_dtype(self.dtype)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS} (or None), got {self.quantization!r}")
        if self.num_scheduler_steps < 1:
            raise ValueError(f"num_scheduler_steps must be >= 1, got {self.num_scheduler_steps}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        CacheConfig(self.block_size, self.num_kv_blocks, self.kv_cache_memory, self.cache_mode)
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.step_timeout is not None and not self.step_timeout > 0:
            raise ValueError(f"step_timeout must be a positive number of seconds (or None), got {self.step_timeout}")
        self.kv_events_config()
        if self.kv_events_endpoint is not None and not (self.cache_mode == "paged" and self.enable_prefix_caching):
            raise ValueError("kv_events_endpoint publishes the prefix cache's blocks: it needs cache_mode 'paged' and "
                             "enable_prefix_caching")


    def kv_events_config(self):
        """vLLM's KVEventsConfig of the kv_events_* fields (kv/events.py), or None without an endpoint."""
        from kvserve.kv.events import KVEventsConfig     # kvserve.kv imports this module

        if self.kv_events_endpoint is None:
            if self.kv_events_replay_endpoint is not None:
                raise ValueError("kv_events_replay_endpoint replays published events: it needs kv_events_endpoint")
            return None
        return KVEventsConfig(self.kv_events_endpoint, self.kv_events_replay_endpoint, self.kv_events_topic,
                              self.kv_events_buffer_steps, self.kv_events_hwm, self.kv_events_max_queue_size)


@dataclass
class ServerConfig:
    """The HTTP side's options: `kvserve serve`'s flags beside the engine's."""

    api_key: str | None = None              # every path but /health needs 'Authorization: Bearer KEY'
    max_queue: int | None = None            # requests in flight before 429
    max_body_bytes: int = 8 * 2**20
    request_read_timeout: float = 30.0      # seconds for a request's head, and then for its body
    max_connections: int = 2048             # open connections; a new one past it gets a 503
    max_n_sequences: int = 128              # the largest n of a request (vLLM's VLLM_MAX_N_SEQUENCES)
    max_completion_prompts: int = 128       # prompts of one /v1/completions request (VLLM_MAX_COMPLETION_PROMPTS)
    # the work of one request: its sequences (prompts x n; vLLM's default max_num_seqs, a batch), and the tokens
    # they may generate together (max_tokens, or what max_model_len leaves, each)
    max_request_sequences: int = 256
    max_request_tokens: int = 2**20
    chat_template: str | None = None        # the template's text, over the model's own (load_chat_template)
    # the format of the tool calls the model writes, for tool_choice "auto" (server/tool_calls.py's
    # TOOL_CALL_PARSERS); None: the one its chat template teaches, if any
    tool_call_parser: str | None = None
    enable_docs: bool = False               # /docs, /redoc and /openapi.json
    kv_dashboard: bool = True               # /dashboard, /v1/kv/state and /v1/kv/blocks/{id}: the cache's structure
    kv_dashboard_content: bool = False      # a block's tokens too, to a caller presenting its cache salt
    engine_start_attempts: int = 3          # tries to start a new engine process after one dies

    def __post_init__(self):
        for name in ("max_body_bytes", "request_read_timeout", "max_connections", "max_n_sequences",
                     "max_completion_prompts", "max_request_sequences", "max_request_tokens", "engine_start_attempts"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.tool_call_parser not in (None, "hermes", "llama3_json"):
            raise ValueError(f"tool_call_parser must be hermes or llama3_json, got {self.tool_call_parser!r}")
        if self.max_queue is not None and self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")
