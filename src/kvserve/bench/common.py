"""What the benches share: a random-weight Llama checkpoint, timers, the machine's measured limits, output."""
from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from kvserve.config import ModelConfig
from kvserve.engine.cpu_memory import huge_page_buffer
from kvserve.engine.native_decode import linear_rows
from kvserve.kernels import COMPUTE_DTYPES, library
from kvserve.model.layers import (NEVER, QUANTIZED_KERNELS, Linear, gemm, gemm_kernels, gemm_pack, onednn_linear,
                                  onednn_pack)
from kvserve.model.random_checkpoint import make_tokenizer, save_random_model
from kvserve.sampling import SamplingParams

# bench flag -> LlamaConfig field
SHAPE_FIELDS = {"hidden_size": "hidden_size", "intermediate_size": "intermediate_size",
                "num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
                "num_kv_heads": "num_key_value_heads", "vocab_size": "vocab_size"}
# 23M parameters in the decoder layers, 16M in lm_head
DEFAULT_SHAPE = {"hidden_size": 512, "intermediate_size": 1408, "num_layers": 8, "num_heads": 8,
                 "num_kv_heads": 2, "vocab_size": 32000}
# --shape: the published shapes of small models (their configs' fields as bench flags; Qwen2.5 as Qwen2, whose q,
# k, v have biases; the two tie their embeddings), built with random weights
SHAPES = {
    "tinyllama-1.1b": {"hidden_size": 2048, "intermediate_size": 5632, "num_layers": 22, "num_heads": 32,
                       "num_kv_heads": 4, "vocab_size": 32000},
    "llama-3.2-1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_layers": 16, "num_heads": 32,
                     "num_kv_heads": 8, "vocab_size": 128256, "tie_word_embeddings": True},
    "qwen2.5-0.5b": {"hidden_size": 896, "intermediate_size": 4864, "num_layers": 24, "num_heads": 14,
                     "num_kv_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True, "architecture": "qwen2"},
    # Gemma 3 1B's text model: five in six layers attend within 512 tokens (a hybrid KV cache past them)
    "gemma3-1b": {"hidden_size": 1152, "intermediate_size": 6912, "num_layers": 26, "num_heads": 4,
                  "num_kv_heads": 1, "vocab_size": 262144, "tie_word_embeddings": True, "architecture": "gemma3",
                  "config": dict(head_dim=256, sliding_window=512, sliding_window_pattern=6,
                                 query_pre_attn_scalar=256)},
}
_BOS, _EOS, _PAD = 0, 1, 2


def add_model_args(p: argparse.ArgumentParser, defaults: dict[str, int] | None = None) -> None:
    """--hidden-size, --num-layers, ...: the shape of the random-weight Llama the bench builds; or --shape, a
    published one (SHAPES)."""
    for name, default in (defaults or DEFAULT_SHAPE).items():
        p.add_argument("--" + name.replace("_", "-"), type=int, default=default,
                       help=f"of the random-weight Llama (default {default})")
    p.add_argument("--shape", default=None, choices=sorted(SHAPES),
                   help="a published model's shape, with random weights (instead of the flags above)")


def model_shape(args: argparse.Namespace) -> dict:
    if getattr(args, "shape", None):
        return dict(SHAPES[args.shape])
    return {name: getattr(args, name) for name in DEFAULT_SHAPE}


def describe_shape(shape: dict) -> str:
    text = ("{arch} hidden {hidden_size}, {num_layers} layers, {num_heads} heads ({num_kv_heads} KV), "
            "intermediate {intermediate_size}, vocab {vocab_size}").format(
        arch=shape.get("architecture", "llama").capitalize(), **shape)
    return text + (", tied embeddings" if shape.get("tie_word_embeddings") else "")


def make_checkpoint(path: Path, shape: dict, max_positions: int,
                    dtype: torch.dtype = torch.float32, seed: int = 0) -> Path:
    """A random-weight Llama (or the shape's "architecture", qwen2 or gemma3) of `shape` (bench flags, whether it
    ties its embeddings, and its "config": the config's other fields) as a Hugging Face checkpoint."""
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen2Config

    families = {"llama": LlamaConfig, "qwen2": Qwen2Config, "gemma3": Gemma3TextConfig}
    config = families[shape.get("architecture", "llama")]
    cfg = config(**{SHAPE_FIELDS[k]: v for k, v in shape.items() if k in SHAPE_FIELDS}, **shape.get("config", {}),
                 max_position_embeddings=max_positions, bos_token_id=_BOS, eos_token_id=_EOS, pad_token_id=_PAD,
                 tie_word_embeddings=shape.get("tie_word_embeddings", False))
    return save_random_model(path, cfg, dtype, seed, make_tokenizer(total=shape["vocab_size"]))


def random_prompts(n: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """n prompts of `length` random token ids, past the special tokens."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(_PAD + 1, vocab_size, (n, length), generator=g).tolist()


def pick_device(device: str | None) -> torch.device:
    """The engine's own default: cuda when present."""
    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds of one call of fn, device work included."""
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def step_times(engine, prompt: list[int], tokens: int, request_id: str = "bench") -> list[float]:
    """Seconds of each engine step of one greedy request; step i yields generated token i + 1."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times


def decode_rate(llm, prompts: list[list[int]], tokens: int, repeats: int = 3) -> float:
    """Decode tokens/s of the batch: once every prompt has its first token, the engine steps that
    generate the next `tokens` of each are timed, and the tokens they made counted. The fastest of
    `repeats` runs is taken: on a busy machine a run that another job slowed says nothing of the engine."""
    return max(_timed_decode(llm.engine, prompts, tokens) for _ in range(repeats))


_decode_runs = itertools.count()      # request ids unique across runs on one engine


def _timed_decode(engine, prompts: list[list[int]], tokens: int) -> float:
    params = SamplingParams(max_tokens=tokens + 1, temperature=0, ignore_eos=True)
    # final-only, as LLM.generate adds them: the engine may run several decode steps a call
    seqs = [engine.add_request(f"decode-rate-{next(_decode_runs)}", {"prompt_token_ids": p}, params,
                               final_only=True) for p in prompts]
    while any(s.num_output_tokens == 0 for s in seqs):
        engine.step()
    before = sum(s.num_output_tokens for s in seqs)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return (sum(s.num_output_tokens for s in seqs) - before) / (time.perf_counter() - start)


def _linears(w: torch.Tensor) -> list[Callable[[torch.Tensor], torch.Tensor]]:
    """x @ w.T by each GEMM the engine may run here: F.linear, oneDNN's prepacked one and csrc/gemm.c's
    kernels (on the CPU, where built)."""
    linears = [lambda x: F.linear(x, w)]
    if w.device.type == "cpu" and w.dtype in COMPUTE_DTYPES:
        if (prepacked := onednn_pack(w)) is not None:
            linears.append(lambda x: onednn_linear(x, prepacked, None))
        if (own := gemm_pack(w)) is not None:
            for kernel in (k for k in gemm_kernels(w.dtype) if k not in QUANTIZED_KERNELS):   # w is not quantized
                amx_from = 1 if kernel == "amx" else NEVER
                linears.append(lambda x, amx_from=amx_from: gemm(x, own, None, w.shape[0], amx_from=amx_from))
    return linears


def matmul_rate(dtype: torch.dtype, m: int, k: int, n: int, device: torch.device, repeats: int = 5) -> float:
    """Best FLOP/s of x[m, k] @ w[n, k].T over the GEMMs of _linears."""
    x = torch.randn(m, k, dtype=dtype, device=device)
    w = torch.randn(n, k, dtype=dtype, device=device)
    best = 0.0
    for fn in _linears(w):
        fn(x)
        best = max(best, 2 * m * k * n / min(timed(lambda: fn(x), device) for _ in range(repeats)))
    return best


@dataclass
class LinearStep:
    """What a model's linear layers alone take for one decode step of `rows` sequences."""
    rows: int
    seconds: float      # the best of the timed runs
    flops: int

    @property
    def flop_s(self) -> float:
        """The GEMMs' rate alone: their FLOPs over their best time."""
        return self.flops / self.seconds


def linear_step(model: torch.nn.Module, rows: int, repeats: int = 5) -> LinearStep:
    """Time the model's own Linear modules (their weights, format and GEMM choice, as its decode step runs
    them) on random inputs of `rows` rows, each called once, as a decode step calls it: the best of `repeats`
    runs after a warm-up one. FLOPs: 2 x rows x each layer's in x out features (a fused gate_up layer's
    activation is part of its call, as in the step, but not counted)."""
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    device = next(model.parameters()).device
    dtype = next(m.weight.dtype for m in layers)
    inputs = [torch.randn(rows, m.in_features, dtype=dtype, device=device) for m in layers]

    @torch.inference_mode()
    def run() -> None:
        for layer, x in zip(layers, inputs):
            layer(x)

    run()
    seconds = min(timed(run, device) for _ in range(repeats))
    return LinearStep(rows, seconds, sum(2 * rows * m.in_features * m.out_features for m in layers))


class ReadBandwidth:
    """Best bytes/s read from a buffer much larger than the caches: by a sum, and by matrix-vector products
    (the GEMMs of _linears, and on the CPU the native decode step's). On the CPU the buffer is on huge pages,
    as the native decode step's weights are. The buffer and its packed copies are made once: a bench that
    measures again around each of its runs (a shared machine's bandwidth moves from minute to minute) pays for the
    reads alone."""

    @torch.inference_mode()
    def __init__(self, device: torch.device, nbytes: int = 512 * 2**20, repeats: int = 5):
        if device.type == "cpu":
            x = huge_page_buffer(nbytes).view(torch.float32).fill_(1.0)
        else:
            x = torch.ones(nbytes // 4, device=device)
        w = x.view(-1, 1024)
        v = torch.ones(1, 1024, device=device)
        self.readers = [x.sum, *(lambda gemv=gemv: gemv(v) for gemv in _linears(w))]
        if device.type == "cpu" and library() is not None:
            self.readers.append(lambda: linear_rows(w, v))
        self.device, self.nbytes, self.repeats = device, nbytes, repeats

    @torch.inference_mode()
    def measure(self) -> float:
        """The best rate of the moment over every reader (each run once to warm, then timed `repeats` times)."""
        best = 0.0
        for fn in self.readers:
            fn()
            best = max(best, self.nbytes / min(timed(fn, self.device) for _ in range(self.repeats)))
        return best


_MEMORY_CHILD = """
import json, sys
import torch
job = json.loads(sys.argv[1])

def status(key):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key))

if job["side"] == "kvserve":
    from kvserve import LLM, SamplingParams
    before = status("VmRSS:")
    llm = LLM(job["path"], **job["kwargs"])
    loaded = status("VmRSS:")
    params = SamplingParams(max_tokens=job["tokens"], temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in job["prompts"]], params, use_tqdm=False)
else:
    from transformers import AutoModelForCausalLM
    before = status("VmRSS:")
    model = AutoModelForCausalLM.from_pretrained(job["path"], dtype=getattr(torch, job["dtype"]),
                                                 attn_implementation="sdpa").eval()
    loaded = status("VmRSS:")
    ids = torch.tensor(job["prompts"])
    model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=job["tokens"],
                   min_new_tokens=job["tokens"])
print(json.dumps({"before_load": before, "after_load": loaded, "peak": status("VmHWM:")}))
"""


def process_memory(side: str, path: Path, prompts: list[list[int]], tokens: int, dtype: str,
                   kwargs: dict | None = None) -> dict[str, int]:
    """Resident memory (bytes) of a fresh process that loads the checkpoint by `side` ("kvserve", LLM(path,
    **kwargs); or "transformers", in dtype) and generates `tokens` greedy tokens for the prompts as one batch:
    before loading (its libraries imported), after loading, and at its peak (VmHWM: what the system must have
    free for it). A process of its own, so that neither side's memory, nor the bench's, counts in the other's."""
    job = {"side": side, "path": str(path), "prompts": prompts, "tokens": tokens, "dtype": dtype,
           "kwargs": kwargs or {}}
    out = subprocess.run([sys.executable, "-c", _MEMORY_CHILD, json.dumps(job)], capture_output=True, text=True,
                         check=False)
    if out.returncode:
        raise RuntimeError(f"the {side} memory measurement failed: {out.stderr.strip()[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def linear_bytes(cfg: ModelConfig, dtype: torch.dtype, quantization: str | None = None) -> int:
    """Bytes of the linear layers' weights, lm_head's included: what a decode step reads (int8: a byte a number,
    and a float32 scale per output column; int4: half a byte, and 4 bytes a group of 32)."""
    layers, head = linear_params(cfg)
    if quantization is None:
        return (layers + head) * dtype.itemsize
    if quantization == "int4":
        return (layers + head) // 2 + (layers + head) // 8
    columns = cfg.num_layers * (cfg.q_size + 2 * cfg.kv_size + 2 * cfg.hidden_size + 2 * cfg.intermediate_size)
    return layers + head + 4 * (columns + cfg.vocab_size)


def linear_params(cfg: ModelConfig) -> tuple[int, int]:
    """Weights of the decoder layers' linear layers, and of lm_head (the embedding table is only indexed)."""
    attn = cfg.hidden_size * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * cfg.hidden_size
    mlp = 3 * cfg.hidden_size * cfg.intermediate_size
    return cfg.num_layers * (attn + mlp), cfg.hidden_size * cfg.vocab_size


def print_table(headers: list[str], rows: list[list[str]]) -> None:
    """Columns left-aligned to their widest cell."""
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]
    for row in [headers, ["-" * w for w in widths], *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())
