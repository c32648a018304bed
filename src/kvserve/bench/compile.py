"""Decode-step tok/s on the CPU: the engine's native C step against torch.compile of the same step.

gpt-fast answers Python's dispatch overhead with torch.compile over a static KV cache; the engine's CPU
answer is one C call per step (csrc/decode_step.c). This measures both on the same paged cache and the
same weights: a decode step of B sequences, each `--context` tokens into its context, by

  native    the engine's C step (NativeDecode.run, over the weights the engine prepared for it)
  compiled  torch.compile (inductor's C++/OpenMP code) of the step written in torch ops: the model's
            layers over its plain weights, the step's K/V written into the pages, and attention over
            each sequence's pages gathered by its block table (static shapes, as gpt-fast's; a mask
            for the context)
  eager     the same torch function, not compiled: what the compiler itself adds is compiled / eager

Runs alternate (native, compiled, eager, native, ...) and each figure is the median of `--repeats` runs
of `--steps` steps; the fastest run of each is given too. The compiled step's logits are first checked
against the native step's: where they differ, the two compute different steps and the suite fails.
float32 checks the step's math (a mask one position off fails it); bfloat16, whose rounding differs
between the two, only a grossly different step.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from kvserve.arg_utils import write_json
from kvserve.attention import AttentionBatch
from kvserve.bench.common import add_model_args, describe_shape, make_checkpoint, model_shape, print_table
from kvserve.config import ModelConfig, parse_dtype
from kvserve.kernels import function
from kvserve.llm import LLM
from kvserve.model.decoder import CausalLM
from kvserve.model.loader import load_model, resolve_model

NAME = "compile"
DTYPES = ("float32", "bfloat16")
RUNNERS = ("native", "compiled", "eager")
# The compiled step matches the native one where no logit differs by more than this share of the largest
# |logit|. In float32 the two differ by the order of their sums alone. In bfloat16 they round in different
# places (the C step fuses what torch's ops round one by one, such as SwiGLU into the GEMM's output), and
# the layers carry each step's rounding on: both differ from the step computed in float32 by some percent,
# growing with depth. A step that computes something else (a norm or a mask left out) differs by the whole.
LOGIT_TOLERANCE = {"float32": 1e-4, "bfloat16": 2.0 ** -3}
_BLOCK_SIZE = 16
_WARMUP_STEPS = 2


@dataclass
class Workload:
    batches: list[int]
    dtypes: list[str]
    context: int
    steps: int
    repeats: int
    threads: int


def add_args(p: argparse.ArgumentParser) -> None:
    source = p.add_mutually_exclusive_group()
    source.add_argument("--model", default=None, help="checkpoint (default: the bundled demo model)")
    source.add_argument("--random-model", action="store_true",
                        help="a random-weight Llama of --hidden-size, --num-layers, ... instead of --model")
    p.add_argument("--batches", type=int, nargs="+", default=None, help="sequences a step (default 1 64; quick: 1)")
    p.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES))
    p.add_argument("--context", type=int, default=256, help="tokens each sequence attends to")
    p.add_argument("--steps", type=int, default=None, help="steps a timed run (default 10; quick: 3)")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed runs of each side; the median is reported (default 5; quick: 3)")
    p.add_argument("--threads", type=int, default=None, help="torch's threads (default: torch's own)")
    add_model_args(p)


def workload(args: argparse.Namespace) -> Workload:
    w = Workload(args.batches or ([1] if args.quick else [1, 64]), args.dtypes, args.context,
                 args.steps or (3 if args.quick else 10), args.repeats or (3 if args.quick else 5),
                 args.threads or torch.get_num_threads())
    for name in ("context", "steps", "repeats", "threads"):
        if getattr(w, name) < 1:
            raise ValueError(f"--{name} must be at least 1, got {getattr(w, name)}")
    if min(w.batches) < 1:
        raise ValueError(f"--batches must all be at least 1, got {w.batches}")
    return w


class TorchDecode(torch.nn.Module):
    """One decode step of a Llama-family CausalLM in torch ops, over its plain (unpacked) weights."""

    def __init__(self, model: CausalLM):
        super().__init__()
        self.model = model
        cfg = model.config
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size, self.eps = cfg.q_size, cfg.kv_size, cfg.rms_norm_eps

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm, rounded where the model's RMSNorm rounds."""
        if x.dtype == torch.float32:
            return F.rms_norm(x, weight.shape, weight, self.eps)
        return weight * F.rms_norm(x.float(), weight.shape, eps=self.eps).to(x.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                block_tables: torch.Tensor, context_lens: torch.Tensor, caches: list[torch.Tensor]) -> torch.Tensor:
        """Logits [batch, vocab] of one token per sequence at `positions`; its K/V go to `slots` of the caches."""
        m = self.model
        b, d, nh, nkv = len(input_ids), self.head_dim, self.num_heads, self.num_kv_heads
        x = m.model.embed_tokens.weight[input_ids]
        cos, sin = (t[positions].unsqueeze(1).to(x.dtype) for t in (m.rope.cos, m.rope.sin))
        width = block_tables.shape[1] * caches[0].shape[3]
        mask = (torch.arange(width) < context_lens[:, None])[:, None, None, :]
        residual = x
        h = self.norm(x, m.model.layers[0].input_layernorm.weight)
        for i, layer in enumerate(m.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            qkv = F.linear(h, attn.qkv_proj.weight, attn.qkv_proj.bias)
            qk = qkv[:, :self.q_size + self.kv_size].view(b, nh + nkv, d)
            if attn.qk_norm:
                qk = torch.cat((self.norm(qk[:, :nh], attn.q_norm.weight),
                                self.norm(qk[:, nh:], attn.k_norm.weight)), 1)
            qk = qk * cos + qk.roll(d // 2, -1) * sin
            kv = torch.stack((qk[:, nh:], qkv[:, self.q_size + self.kv_size:].view(b, nkv, d)), 1)
            cache = caches[i]
            cache.view(2, nkv, -1, d).index_copy_(2, slots, kv.permute(1, 2, 0, 3))
            keys, values = (cache[j][:, block_tables].permute(1, 0, 2, 3, 4).reshape(b, nkv, width, d) for j in (0, 1))
            out = F.scaled_dot_product_attention(qk[:, :nh].unsqueeze(2), keys, values, attn_mask=mask, enable_gqa=True)
            residual = residual + F.linear(out.reshape(b, self.q_size), attn.o_proj.weight, attn.o_proj.bias)
            h = self.norm(residual, layer.post_attention_layernorm.weight)
            gate, up = F.linear(h, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias).chunk(2, -1)
            residual = residual + F.linear(F.silu(gate) * up, mlp.down_proj.weight, mlp.down_proj.bias)
            last = i + 1 == len(m.model.layers)
            h = self.norm(residual, m.model.norm.weight if last else m.model.layers[i + 1].input_layernorm.weight)
        return F.linear(h, m.lm_head.weight)


def seconds_per_step(fn: Callable[[], object], steps: int) -> float:
    """Mean seconds of `steps` calls of fn."""
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - start) / steps


def compare_logits(native: torch.Tensor, compiled: torch.Tensor, dtype: str) -> dict:
    """How far the compiled step's logits are from the native step's, and whether within LOGIT_TOLERANCE."""
    native, compiled = native.float(), compiled.float()
    relative = ((native - compiled).abs().max() / native.abs().max()).item()
    return {"max_logit_diff_relative": relative, "logits_match": relative <= LOGIT_TOLERANCE[dtype],
            "top1_agreement": (native.argmax(-1) == compiled.argmax(-1)).float().mean().item()}


@torch.inference_mode()
def measure(path: Path, dtype: str, batch: int, w: Workload) -> dict:
    """Tokens/s of each way of running the step (medians of alternating runs), and how far the compiled
    step's logits are from the native step's."""
    width = -(-(w.context + 1) // _BLOCK_SIZE)
    llm = LLM(str(path), dtype=dtype, device="cpu", block_size=_BLOCK_SIZE, num_kv_blocks=batch * width + 1,
              max_num_seqs=batch, max_model_len=w.context + 1, num_scheduler_steps=1)
    native, storage = llm.engine.runner.native, llm.engine.storage
    if native is None:
        raise RuntimeError(f"the engine built no native C step for {path} in {dtype}: nothing to compare with")
    for layer in storage.layers:     # a cache of random K/V: attention reads the whole context
        layer.pages.normal_(generator=torch.Generator().manual_seed(0))
    torch_dtype = parse_dtype(dtype)
    plain = load_model(path, ModelConfig.from_path(path), torch_dtype, torch.device("cpu"), w.context + 1,
                       weight_format="plain")
    g = torch.Generator().manual_seed(batch)
    input_ids = torch.randint(3, plain.config.vocab_size, (batch,), generator=g)
    positions = torch.full((batch,), w.context - 1, dtype=torch.int64)
    tables = torch.arange(batch * width, dtype=torch.int64).view(batch, width)
    context_lens = torch.full((batch,), w.context, dtype=torch.int64)
    slots = tables[:, (w.context - 1) // _BLOCK_SIZE] * _BLOCK_SIZE + (w.context - 1) % _BLOCK_SIZE
    attn_batch = AttentionBatch(num_decodes=batch, slot_mapping=slots, block_tables=tables, context_lens=context_lens,
                                query_lens=[1] * batch, context_lens_list=[w.context] * batch, has_prefix=False)
    step = TorchDecode(plain).eval()
    # each measurement compiles afresh: dynamo would otherwise reuse the graphs of earlier ones, and past its
    # recompile limit run the step uncompiled
    torch._dynamo.reset()
    compiled = torch.compile(step, dynamic=False, fullgraph=True)
    args = (input_ids, positions, slots, tables, context_lens, [layer.pages for layer in storage.layers])
    runners = {"native": lambda: native.run(input_ids, positions, attn_batch),
               "compiled": lambda: compiled(*args), "eager": lambda: step(*args)}
    ours = runners["native"]()
    start = time.perf_counter()
    theirs = runners["compiled"]()
    first_call_s = time.perf_counter() - start
    check = compare_logits(ours, theirs, dtype)
    for fn in runners.values():
        seconds_per_step(fn, _WARMUP_STEPS)
    runs: dict[str, list[float]] = {name: [] for name in RUNNERS}
    for _ in range(w.repeats):
        for name in RUNNERS:
            runs[name].append(seconds_per_step(runners[name], w.steps))
    s = {name: statistics.median(r) for name, r in runs.items()}
    return {"dtype": dtype, "batch": batch, "tok_s": {name: batch / v for name, v in s.items()},
            "best_tok_s": {name: batch / min(r) for name, r in runs.items()},
            "compiled_over_native": s["native"] / s["compiled"], "eager_over_native": s["native"] / s["eager"],
            "compiled_over_eager": s["eager"] / s["compiled"], **check, "first_compiled_call_s": first_call_s,
            "native_gemm": native.packed, "runs_s": runs}


def compiled_wins(results: list[dict]) -> list[dict]:
    """The rows where the compiled step beats both the native step and the uncompiled function."""
    return [r for r in results if r["compiled_over_native"] > 1 and r["compiled_over_eager"] > 1]


def report(results: list[dict]) -> None:
    rows = [[r["dtype"], str(r["batch"]), *(f"{r['tok_s'][name]:.1f}" for name in RUNNERS),
             f"{r['compiled_over_native']:.2f}x", f"{r['eager_over_native']:.2f}x", f"{r['compiled_over_eager']:.2f}x",
             f"{r['max_logit_diff_relative']:.1e} ({'match' if r['logits_match'] else 'DIFFER'})",
             f"{r['top1_agreement']:.0%}", f"{r['first_compiled_call_s']:.1f}"] for r in results]
    print_table(["dtype", "B", "native tok/s", "compiled tok/s", "eager tok/s", "compiled / native", "eager / native",
                 "compiled / eager", "logits: max diff / max |logit|", "top-1 agree", "compile s"], rows)
    # where other work shares the cores, a run whose threads lose theirs waits at every barrier: the fastest
    # runs are the least disturbed
    print("\nthe fastest run of each")
    print_table(["dtype", "B", "native tok/s", "compiled tok/s", "eager tok/s", "compiled / native", "eager / native"],
                [[r["dtype"], str(r["batch"]), *(f"{r['best_tok_s'][name]:.1f}" for name in RUNNERS),
                  *(f"{r['best_tok_s'][name] / r['best_tok_s']['native']:.2f}x" for name in ("compiled", "eager"))]
                 for r in results])
    wins = compiled_wins(results)
    print("torch.compile faster than both the native step and the uncompiled function: "
          + (", ".join(f"{r['dtype']} B={r['batch']}" for r in wins) or "nowhere"))
    if not all(r["native_gemm"] for r in results):
        print("the native step multiplied by matrix-vector products (no csrc/gemm.c for the dtype here): past "
              "native_decode.MAX_BATCH sequences the engine itself runs op by op")


@contextmanager
def torch_threads(n: int):
    """torch's threads set to n inside the block, and back after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run(args: argparse.Namespace) -> int:
    w = workload(args)
    if function("decode_step") is None:
        print("kvserve: error: bench compile measures torch.compile against the engine's native C decode step, "
              "which is not available here (its kernels could not be built: is there a C compiler?)", file=sys.stderr)
        return 2
    shape = model_shape(args) if args.random_model else None
    with tempfile.TemporaryDirectory(prefix="kvserve-bench-") as tmp, torch_threads(w.threads):
        path = make_checkpoint(Path(tmp), shape, w.context + 1) if shape else resolve_model(args.model)
        model = describe_shape(shape) if shape else path.name
        print(f"compile: decode step of B sequences at context {w.context}, {model}; median of {w.repeats} "
              f"alternating runs of {w.steps} steps; {w.threads} threads")
        results = [measure(path, dtype, batch, w) for dtype in w.dtypes for batch in w.batches]
    report(results)
    write_json(args.json_path, {"model": model, "shape": shape, "workload": asdict(w),
                                "logit_tolerance": LOGIT_TOLERANCE, "results": results,
                                "compiled_wins": [{"dtype": r["dtype"], "batch": r["batch"]}
                                                  for r in compiled_wins(results)]})
    differ = [f"{r['dtype']} B={r['batch']}" for r in results if not r["logits_match"]]
    if differ:
        print(f"kvserve: error: the compiled step's logits differ from the native step's ({', '.join(differ)}): "
              f"it computes another step, and its rates compare nothing", file=sys.stderr)
        return 1
    return 0
