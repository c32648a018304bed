"""kvserve plan: the KV cache arithmetic as a tool. How many users fit on my card?

bytes per token = layers x 2 (K and V) x kv_heads x head_dim x bytes per number. A card holds the
weights plus every active request's cache; what is left after the weights bounds the users. Users
are counted twice: with requests of a chat length mix (each holds what its tokens need while it
runs), and with every request at the full context.
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from kvserve.arg_utils import layer_list
from kvserve.config import (KV_CACHE_DTYPES, QUANTIZATIONS, QUANTIZED_KV_CACHE_DTYPES, ModelConfig, parse_bytes,
                            parse_dtype)
from kvserve.parallel.sharding import check_tensor_parallel, shard_config
from kvserve.kv.eviction import Sink
from kvserve.kv.groups import LayerGroup, is_hybrid, layer_groups, window_blocks
from kvserve.kv.quant import resolve_kv_cache_dtype
from kvserve.kv.sparse import parse_sparse_attention
from kvserve.kv.spec import KVSpec
from kvserve.kv.storage import block_spec

# Published configs of popular open models (config.json fields that size weights and cache).
MODELS = {
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
                         max_position_embeddings=131072),
    "llama-3.2-3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                         num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=True,
                         max_position_embeddings=131072),
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072),
    "llama-3.1-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                          num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072),
    "mistral-7b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=32768, max_position_embeddings=32768,
                       architectures=["MistralForCausalLM"]),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768,
                       architectures=["Qwen2ForCausalLM"]),
    "qwen2.5-72b": dict(hidden_size=8192, intermediate_size=29568, num_hidden_layers=80, num_attention_heads=64,
                        num_key_value_heads=8, vocab_size=152064, max_position_embeddings=32768,
                        architectures=["Qwen2ForCausalLM"]),
    # sliding-window and hybrid models: Gemma 3's five local layers (window 512) to one global
    "gemma3-1b": dict(hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
                      num_key_value_heads=1, head_dim=256, vocab_size=262144, max_position_embeddings=32768,
                      sliding_window=512, sliding_window_pattern=6, query_pre_attn_scalar=256,
                      rope_theta=1000000.0, rope_local_base_freq=10000.0, architectures=["Gemma3ForCausalLM"]),
    "gemma2-2b": dict(hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
                      num_key_value_heads=4, head_dim=256, vocab_size=256000, max_position_embeddings=8192,
                      sliding_window=4096, query_pre_attn_scalar=256, architectures=["Gemma2ForCausalLM"]),
    "mistral-7b-v0.1": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                            num_key_value_heads=8, vocab_size=32000, max_position_embeddings=32768,
                            sliding_window=4096, architectures=["MistralForCausalLM"]),
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                     architectures=["Qwen3ForCausalLM"]),
}
# Nominal memory of common cards, GiB.
GPUS = {"h100": 80, "h200": 141, "a100-40": 40, "a100-80": 80, "l4": 24, "l40s": 48, "rtx-4090": 24, "rtx-3090": 24}
# The capacity bench's request-length mix: log-normal prompt and output lengths.
MIX = dict(prompt_median=160, output_median=340, sigma=1.0, samples=100_000, seed=0)


@dataclass
class Plan:
    model: str
    weight_bytes: int
    kv_bytes_per_token: float
    kv_bytes_per_request: float
    kv_memory: int
    context: int
    max_users: dict[str, int]                  # requests of the length mix
    mean_tokens_held: float
    mean_tokens_held_sink_window: float        # the same requests, each holding at most the sink+window cache
    max_users_at_full_context: dict[str, int]  # every request holding `context` tokens
    # a model with sliding-window layers: the hybrid cache's layer groups (GroupPlan.as_dict each); the users
    # rows "hybrid" count requests whose every group holds min(length, its window)
    kv_groups: list[dict] = field(default_factory=list)
    offload_bytes: int | None = None           # a second tier (kv_offload_size) ...
    offload_tokens: int | None = None          # ... and the prefix tokens it keeps beyond the card's

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def load_model_config(model: str) -> tuple[str, ModelConfig]:
    """A built-in table name, a checkpoint directory, a config.json, or a hub id (with a network)."""
    key = model.lower()
    if key in MODELS:
        cfg = {"architectures": ["LlamaForCausalLM"], **MODELS[key]}
        return key, ModelConfig.from_dict(cfg)
    path = Path(model)
    if path.exists():
        return model, ModelConfig.from_path(path)
    if model.count("/") == 1:
        from kvserve.model.loader import resolve_model
        return model, ModelConfig.from_path(resolve_model(model))
    raise ValueError(f"unknown model {model!r}: give a checkpoint directory, a config.json, a hub id, "
                     f"or one of {', '.join(MODELS)}")


def weight_bytes(cfg: ModelConfig, bytes_per_number: int, quantization: str | None = None) -> int:
    """Bytes of the weights; quantized, each linear layer's numbers (lm_head's too, and so a tied embedding
    table's) take a byte and a float32 scale per output column (int8), or half a byte and a float16 scale and
    minimum per output column and group of 32 (int4)."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    attn = h * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * h
    layer = attn + 3 * h * i + 2 * h
    embed = cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2)
    total = (cfg.num_layers * layer + embed + h) * bytes_per_number
    if quantization is None:
        return total
    linear = cfg.num_layers * (attn + 3 * h * i) + cfg.vocab_size * h
    # (out, in) of the linear layers, and how many of each
    shapes = [(cfg.q_size + 2 * cfg.kv_size, h, cfg.num_layers), (h, cfg.q_size, cfg.num_layers),
              (2 * i, h, cfg.num_layers), (h, i, cfg.num_layers), (cfg.vocab_size, h, 1)]
    if quantization == "int4":      # a group's scale and minimum: 4 bytes
        groups = sum(out * -(-in_ // 32) * n for out, in_, n in shapes)
        return total - linear * bytes_per_number + linear // 2 + 4 * groups
    columns = sum(out * n for out, _, n in shapes)
    return total - linear * (bytes_per_number - 1) + 4 * columns


def mean_tokens_held(context: int, avg_prompt: float | None, avg_output: float | None,
                     cap: int | None = None) -> float:
    """Time-averaged tokens a request holds while it runs: its prompt plus half its output, or with a
    `cap` on the tokens it holds (an evicting cache), min(prompt + t, cap) over its output tokens t."""
    if avg_prompt is not None and avg_output is not None:
        prompt, output = np.array([avg_prompt]), np.array([avg_output])
    else:
        rng = np.random.default_rng(MIX["seed"])
        prompt = np.maximum(1, rng.lognormal(math.log(MIX["prompt_median"]), MIX["sigma"], MIX["samples"]))
        output = np.maximum(1, rng.lognormal(math.log(MIX["output_median"]), MIX["sigma"], MIX["samples"]))
    prompt = np.minimum(prompt, context - 1)
    output = np.minimum(output, context - prompt)
    cap = context if cap is None else min(cap, context)
    below = np.clip(cap - prompt, 0, output)         # output tokens added while the request is under the cap
    held = (np.minimum(prompt, cap) * below + below ** 2 / 2 + (output - below) * cap) / output
    return float(np.mean(held))


def plan(model: str, memory: int, context: int, dtype: str = "bfloat16", tensor_parallel: int = 1,
         utilization: float = 0.9, block_size: int = 16, avg_prompt: float | None = None,
         avg_output: float | None = None, sinks: int = 4, window: int = 1020, kv_dtype: str = "auto",
         offload_size: int | None = None, quantization: str | None = None,
         kv_dtype_skip_layers: tuple[int, ...] = (), sparse_attention: str | None = None) -> Plan:
    """Users that fit with each cache option; contiguous, paged and sink_window store `kv_dtype`; the weights
    are quantized as `quantization` says (weight_bytes). Quantized pages keep the layers `kv_dtype_skip_layers` in
    `dtype` (kv_cache_dtype_skip_layers). With `offload_size`, the prefix tokens a second tier of that many bytes
    keeps (kv_offload). With `sparse_attention`, every block also holds its page summaries (kv/summaries.py)."""
    if context < 1:
        raise ValueError(f"context must be at least 1 token, got {context}")
    if not 0 < utilization <= 1:
        raise ValueError(f"memory utilization must be in (0, 1], got {utilization}")
    name, cfg = load_model_config(model)
    kv_dtype = resolve_kv_cache_dtype(kv_dtype, parse_dtype(dtype))
    spec = KVSpec.from_model(cfg, parse_dtype(dtype), block_size)
    weights = weight_bytes(cfg, spec.bytes_per_number, quantization) // tensor_parallel
    usable = int(memory * utilization)
    if usable <= weights:
        need = math.ceil(weights * tensor_parallel / usable)
        raise ValueError(f"the weights need {weights / 2**30:.1f} GiB per card, more than the "
                         f"{usable / 2**30:.1f} GiB usable ({utilization:.0%} of {memory / 2**30:.1f} GiB); "
                         f"try --tensor-parallel {need} or more, or a smaller dtype")
    kv_memory = usable - weights   # activations are not counted: leave room through --memory-utilization
    # the most a sink+window cache holds: the sink blocks, the window and the blocks it straddles, and the
    # original sink blocks kept beside their rotated copies
    policy = Sink(sinks, window)
    bounded = policy.max_cache_tokens(block_size) + policy.sink_blocks(block_size) * block_size
    held = mean_tokens_held(context, avg_prompt, avg_output)
    held_sink = mean_tokens_held(context, avg_prompt, avg_output, bounded)
    summaries = parse_sparse_attention(sparse_attention) is not None
    per_card = {kd: KVSpec.from_model(cfg, parse_dtype(dtype), block_size, kd, kv_dtype_skip_layers, summaries)
                for kd in ("auto", *QUANTIZED_KV_CACHE_DTYPES)}
    cards = min(tensor_parallel, cfg.num_kv_heads)   # tensor parallelism splits the KV heads (never one head)
    per_token = per_card[kv_dtype].bytes_per_token / cards

    def users(kd: str, tokens: float) -> int:
        return int(kv_memory // _paged_bytes_per_user(per_card[kd], tokens, cards))

    def users_at(kd: str, tokens: int) -> int:
        return int(kv_memory // (per_card[kd].bytes_held(tokens) / cards))

    contiguous = int(kv_memory // (context * per_token))
    mix = {"contiguous": contiguous, "paged": users(kv_dtype, held), "sink_window": users(kv_dtype, held_sink)}
    mix.update({f"paged_{kd}": users(kd, held) for kd in QUANTIZED_KV_CACHE_DTYPES})
    full = {"contiguous": contiguous, "paged": users_at(kv_dtype, context),
            "sink_window": users_at(kv_dtype, min(context, bounded))}
    full.update({f"paged_{kd}": users_at(kd, context) for kd in QUANTIZED_KV_CACHE_DTYPES})
    groups = layer_groups(cfg.sliding_windows or (None,) * cfg.num_layers, context)
    kv_groups = []
    if is_hybrid(groups):
        slots = block_spec(per_card[kv_dtype], groups)
        kv_groups = [GroupPlan.of(g, slots, context, avg_prompt, avg_output, cards) for g in groups]
        per_user = sum(_paged_bytes_per_user(slots, g.mean_tokens_held, cards) for g in kv_groups)
        mix["hybrid"] = int(kv_memory // per_user)
        full["hybrid"] = int(kv_memory // sum(g.bytes_at_full_context for g in kv_groups))
    offload = None if offload_size is None else offload_tokens(per_card[kv_dtype], offload_size, cards)
    return Plan(name, weights, per_token, context * per_token, kv_memory, context, mix, held, held_sink, full,
                [g.as_dict() for g in kv_groups], offload_size, offload)


@dataclass
class GroupPlan:
    """One layer group of a hybrid cache: a block holds group_size layers' pages whatever its group (a group of
    fewer layers leaves the rest unused), and a request holds min(its length, the window) tokens in it."""

    sliding_window: int | None
    num_layers: int
    padded_layers: int             # the layers' pages a block of the group holds: group_size (block_spec's layers)
    full_precision_layers: int     # those of them in the model's dtype (all, or with quantized pages the skipped)
    bytes_per_token: float         # per card
    mean_tokens_held: float        # a request of the length mix, over its life: min(its tokens, the window)
    # the most a request of `context` tokens holds, per card: every block in a full-attention group; in a sliding
    # one, the blocks that its window touches (one more than the window's where it straddles a block edge)
    bytes_at_full_context: float

    @classmethod
    def of(cls, group: LayerGroup, slots: KVSpec, context: int, avg_prompt: float | None,
           avg_output: float | None, cards: int) -> GroupPlan:
        """The group's plan; `slots`: the spec of one block (block_spec's)."""
        cap, bs = group.sliding_window, slots.block_size
        blocks = -(-context // bs) if cap is None else window_blocks(cap, bs, context)
        full = slots.num_layers - len(slots.quantized_layers)
        return cls(cap, len(group.layers), slots.num_layers, full, slots.bytes_per_token / cards,
                   mean_tokens_held(context, avg_prompt, avg_output, cap),
                   blocks * slots.bytes_per_block / cards)

    def as_dict(self) -> dict:
        return asdict(self)


def offload_tokens(spec: KVSpec, size: int, cards: int = 1) -> int:
    """Prefix tokens a second tier of `size` bytes (per card) keeps: whole blocks' pages as the pool stores them,
    quantized pages with their scales (the small header of each block's file left out; page summaries are made
    again from the pages)."""
    return int(size // (spec.page_bytes_per_block / cards)) * spec.block_size


def _paged_bytes_per_user(spec: KVSpec, held: float, cards: int) -> float:
    """Bytes a paged request holds on average, per card: its `held` tokens and the places its last block
    has left ((block_size - 1) / 2 on average). Exactly the mean of KVSpec.bytes_held over a block's fill
    levels."""
    slack = (spec.block_size - 1) / 2
    return (held + slack) * spec.bytes_per_token / cards


def num_blocks(model: str, kv_cache_memory: int | str, block_size: int = 16, dtype: str = "float32",
               kv_dtype: str = "auto", tensor_parallel: int = 1, kv_dtype_skip_layers: tuple[int, ...] = (),
               max_model_len: int | None = None, summaries: bool = False) -> int:
    """The engine's pool size for a kv_cache_memory budget: the same formula the allocator uses (per rank under
    tensor parallelism, whose ranks hold their KV heads' pages of the same blocks). A model whose sliding windows
    bind within max_model_len (default: its positions) gets the hybrid cache's blocks, each holding the pages of
    one layer group's layers (block_spec); with `summaries` (sparse attention), their page summaries too."""
    _, cfg = load_model_config(model)
    check_tensor_parallel(cfg, tensor_parallel)
    spec = KVSpec.from_model(shard_config(cfg, tensor_parallel), parse_dtype(dtype), block_size, kv_dtype,
                             kv_dtype_skip_layers, summaries)
    groups = layer_groups(cfg.sliding_windows or (None,) * cfg.num_layers,
                          max_model_len or cfg.max_position_embeddings)
    if is_hybrid(groups):
        spec = block_spec(spec, groups)
    return spec.num_blocks_for(parse_bytes(kv_cache_memory))


def add_plan_parser(sub) -> None:
    p = sub.add_parser("plan", help="how many users fit on a card: the KV cache arithmetic")
    p.add_argument("--model", required=True, help=f"checkpoint, config.json, hub id, or one of {', '.join(MODELS)}")
    mem = p.add_mutually_exclusive_group(required=True)
    mem.add_argument("--gpu-memory", help="e.g. 80GiB")
    mem.add_argument("--gpu", choices=sorted(GPUS), help="a card by name")
    p.add_argument("--context", type=int, default=4096, help="max tokens per request")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--kv-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="pages of the contiguous, paged and sink+window rows (int8/fp8/int4 rows are always "
                        "shown); bfloat16, bf16, float16, fp16 name the model's --dtype, as auto does")
    p.add_argument("--kv-dtype-skip-layers", type=layer_list, default=(),
                   help="comma-separated layers whose quantized pages stay in --dtype, e.g. 0,31")
    p.add_argument("--quantization", default=None, choices=QUANTIZATIONS, help="weight-only quantization")
    p.add_argument("--tensor-parallel", type=int, default=1)
    p.add_argument("--memory-utilization", type=float, default=0.9)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--avg-prompt", type=float, default=None, help="instead of the log-normal chat mix")
    p.add_argument("--avg-output", type=float, default=None)
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--window", type=int, default=1020)
    p.add_argument("--kv-offload-size", default=None,
                   help="a second tier of this size (e.g. 64GiB of disk or host memory): the prefix tokens it keeps")
    p.add_argument("--sparse-attention", default=None, metavar="SPEC",
                   help="as the engine's flag (e.g. quest:budget=2048): every block then holds its page summaries too")
    p.add_argument("--json", dest="json_path", default=None)
    p.add_argument("--plot", default=None, help="PNG of users against context length")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    memory = parse_bytes(args.gpu_memory) if args.gpu_memory else GPUS[args.gpu] * 2**30
    kw = dict(dtype=args.dtype, tensor_parallel=args.tensor_parallel, utilization=args.memory_utilization,
              block_size=args.block_size, avg_prompt=args.avg_prompt, avg_output=args.avg_output,
              sinks=args.sinks, window=args.window, kv_dtype=args.kv_dtype, quantization=args.quantization,
              kv_dtype_skip_layers=args.kv_dtype_skip_layers, sparse_attention=args.sparse_attention)
    offload = None
    if args.kv_offload_size is not None:
        try:
            offload = parse_bytes(args.kv_offload_size)
        except ValueError as e:
            raise ValueError(f"--kv-offload-size: {e}") from None
    result = plan(args.model, memory, args.context, **kw, offload_size=offload)
    _, cfg = load_model_config(args.model)
    gib = 2**30
    print(f"{result.model}: weights {result.weight_bytes / gib:.2f} GiB per card ({args.quantization or args.dtype}, "
          f"tensor parallel {args.tensor_parallel})")
    spec = KVSpec.from_model(cfg, parse_dtype(args.dtype), args.block_size, args.kv_dtype, args.kv_dtype_skip_layers)
    cards = min(args.tensor_parallel, cfg.num_kv_heads)
    number = (f"{spec.bytes_per_number} bytes" if spec.kv_cache_dtype == "auto" else
              f"{spec.bytes_per_block / (cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * args.block_size):.4g} "
              f"bytes ({args.kv_dtype} with its scales"
              f"{f', layers {_layers(spec.skip_layers)} in {args.dtype}' if spec.skip_layers else ''})")
    print(f"KV bytes per token = {cfg.num_layers} layers x 2 (K, V) x {cfg.num_kv_heads} kv_heads x "
          f"{cfg.head_dim} head_dim x {number}{f' / {cards} cards' if cards > 1 else ''}"
          f"{summary_term(spec, cfg, cards) if args.sparse_attention else ''} = {result.kv_bytes_per_token:,.0f} bytes")
    for g in result.kv_groups:
        kind = "full attention" if g["sliding_window"] is None else f"window {g['sliding_window']}"
        print(f"  layer group ({kind}, {g['num_layers']} layers, pages of {g['padded_layers']} per block): "
              f"{_block_formula(g, cfg, spec)} = "
              f"{g['bytes_per_token']:,.0f} bytes per token, holding min(length, "
              f"{g['sliding_window'] or args.context}) tokens: {g['mean_tokens_held']:.0f} on average at the mix")
    print(f"per full {args.context}-token request: {result.kv_bytes_per_request / gib:.3f} GiB; "
          f"KV memory on the card: {result.kv_memory / gib:.2f} GiB")
    if args.tensor_parallel > 1:
        blocks = num_blocks(args.model, result.kv_memory, args.block_size, args.dtype, args.kv_dtype,
                            args.tensor_parallel, args.kv_dtype_skip_layers, args.context,
                            summaries=args.sparse_attention is not None)
        print(f"per rank: --kv-cache-memory {result.kv_memory} --tensor-parallel-size {args.tensor_parallel} gives "
              f"each rank {blocks:,} blocks of {args.block_size} tokens ({args.kv_dtype} pages)")
    print(f"concurrent users: requests of the length mix (mean {result.mean_tokens_held:.0f} tokens held, "
          f"{result.mean_tokens_held_sink_window:.0f} with sink+window), and every request at {args.context} tokens")
    rows = {"contiguous": "contiguous max-length reservation", "paged": f"paged, {spec.kv_cache_dtype} pages",
            "paged_int8": "paged, int8 pages", "paged_fp8": "paged, fp8 pages", "paged_int4": "paged, int4 pages",
            "sink_window": f"sink+window ({args.sinks}+{args.window})"}
    if result.kv_groups:
        rows["hybrid"] = f"paged per layer group, {spec.kv_cache_dtype}"
    print(f"  {'':<36} {'length mix':>12} {'full context':>14}")
    for key, label in rows.items():
        print(f"  {label:<36} {result.max_users[key]:>12,} {result.max_users_at_full_context[key]:>14,}")
    if result.offload_tokens is not None:
        print(f"offload tier of {result.offload_bytes / gib:.2f} GiB{' per card' if cards > 1 else ''}: keeps "
              f"{result.offload_tokens:,} more prefix tokens ({result.offload_tokens // args.context:,} prefixes of "
              f"{args.context} tokens) at {spec.page_bytes_per_block / spec.block_size / cards:,.0f} bytes per token, "
              f"{spec.kv_cache_dtype} pages")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result.as_dict(), indent=2) + "\n")
    if args.plot:
        _plot(args, memory, kw)
    return 0


def summary_term(spec: KVSpec, cfg: ModelConfig, cards: int) -> str:
    """The page summaries' share of a token's bytes: per block, layer and KV head a minimum and a maximum of head_dim
    numbers in the model's dtype, over the block's tokens."""
    share = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * spec.bytes_per_number / spec.block_size / cards
    per_card = f" / {cards} cards" if cards > 1 else ""
    return (f" + page summaries {cfg.num_layers} layers x 2 (min, max) x {cfg.num_kv_heads} kv_heads x {cfg.head_dim} "
            f"head_dim x {spec.bytes_per_number} bytes / {spec.block_size} tokens a block{per_card} "
            f"({share:,.0f} bytes)")


def _layers(layers: tuple[int, ...]) -> str:
    return ",".join(map(str, sorted(layers)))


def _block_formula(group: dict, cfg: ModelConfig, spec: KVSpec) -> str:
    """A layer group's bytes per token: its block's page tensors in the model's dtype, then its quantized ones."""
    dims = f"2 x {cfg.num_kv_heads} x {cfg.head_dim}"
    full = group["full_precision_layers"]
    quantized = group["padded_layers"] - full
    terms = [f"{full} x {dims} x {spec.bytes_per_number} bytes"] if full else []
    if quantized:
        one = replace(spec, num_layers=1, skip_layers=())        # a quantized layer's pages and scales
        number = one.bytes_per_block / (2 * cfg.num_kv_heads * cfg.head_dim * spec.block_size)
        terms.append(f"{quantized} x {dims} x {number:.4g} bytes ({spec.kv_cache_dtype} with its scales)")
    return " + ".join(terms)


def _plot(args, memory: int, kw: dict) -> None:
    from kvserve.extras import pyplot

    plt = pyplot("kvserve plan --plot")
    contexts = (512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
    plans = [plan(args.model, memory, c, **kw) for c in contexts]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for option in plans[0].max_users:
        ax.plot(contexts, [max(p.max_users[option], 0.5) for p in plans], marker="o", label=option)
    ax.set(xscale="log", yscale="log", xlabel="context length (tokens)", ylabel="concurrent users",
           title=f"{plans[0].model}, {args.dtype}, {memory / 2**30:.0f} GiB x {args.memory_utilization:.0%}")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=110)
