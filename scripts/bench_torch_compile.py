"""torch.compile as a decode-step executor, against the native C step (csrc/decode_step.c), on the CPU.

gpt-fast answers Python's dispatch overhead with torch.compile over a static KV cache; the engine's CPU
answer is one C call per step. This measures both on the same paged cache and the same weights: a decode
step of `batch` sequences, each `context` tokens into its context, by

  native    the engine's C step (NativeDecode.run: weights packed for csrc/gemm.c, on huge pages)
  compiled  torch.compile (inductor's C++/OpenMP code) of the step written in torch ops: the model's
            layers over its plain weights, the step's K/V written into the pages, and attention over
            each sequence's pages gathered by its block table (static shapes, as gpt-fast's; a mask
            for the context)
  eager     the same torch function, not compiled

Runs alternate (native, compiled, eager, native, ...) and each figure is the median of `--repeats`
runs of `--steps` steps; the compiled step's logits are checked against the native step's first.

    PYTHONPATH=src python scripts/bench_torch_compile.py [--model PATH] [--random-large] [--batches 1 64]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kvserve import LLM
from kvserve.attention import AttentionBatch
from kvserve.bench.common import save_random_model
from kvserve.config import ModelConfig
from kvserve.model.decoder import CausalLM
from kvserve.model.loader import load_model, resolve_model


class TorchDecode(torch.nn.Module):
    """One decode step of a Llama-family CausalLM in torch ops, over its plain (unpacked) weights."""

    def __init__(self, model: CausalLM):
        super().__init__()
        self.model = model
        cfg = model.config
        self.nh, self.nkv, self.d, self.eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm, rounded where the model's RMSNorm rounds."""
        if x.dtype == torch.float32:
            return F.rms_norm(x, weight.shape, weight, self.eps)
        return weight * F.rms_norm(x.float(), weight.shape, eps=self.eps).to(x.dtype)

    def forward(self, input_ids, positions, slots, block_tables, context_lens, caches: list[torch.Tensor]):
        """Logits [batch, vocab] of one token per sequence at `positions`; its K/V go to `slots` of the caches."""
        m = self.model
        b, d = len(input_ids), self.d
        x = m.model.embed_tokens.weight[input_ids]
        cos, sin = (t[positions].unsqueeze(1).to(x.dtype) for t in (m.rope.cos, m.rope.sin))
        width = block_tables.shape[1] * caches[0].shape[3]
        mask = (torch.arange(width) < context_lens[:, None])[:, None, None, :]
        residual = x
        h = self.norm(x, m.model.layers[0].input_layernorm.weight)
        for i, layer in enumerate(m.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            qkv = F.linear(h, attn.qkv_proj.weight, attn.qkv_proj.bias)
            qk = qkv[:, :self.q_size + self.kv_size].view(b, self.nh + self.nkv, d)
            if attn.qk_norm:
                qk = torch.cat((self.norm(qk[:, :self.nh], attn.q_norm.weight),
                                self.norm(qk[:, self.nh:], attn.k_norm.weight)), 1)
            qk = qk * cos + qk.roll(d // 2, -1) * sin
            kv = torch.stack((qk[:, self.nh:], qkv[:, self.q_size + self.kv_size:].view(b, self.nkv, d)), 1)
            cache = caches[i]
            pages = cache.view(2, self.nkv, -1, d)
            pages.index_copy_(2, slots, kv.permute(1, 2, 0, 3))
            keys, values = (cache[j][:, block_tables].permute(1, 0, 2, 3, 4).reshape(b, self.nkv, width, d)
                            for j in (0, 1))
            q = qk[:, :self.nh].unsqueeze(2)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
            x = F.linear(out.reshape(b, self.q_size), attn.o_proj.weight, attn.o_proj.bias)
            residual = residual + x
            h = self.norm(residual, layer.post_attention_layernorm.weight)
            gate, up = F.linear(h, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias).chunk(2, -1)
            x = F.linear(F.silu(gate) * up, mlp.down_proj.weight, mlp.down_proj.bias)
            residual = residual + x
            nxt = m.model.layers[i + 1].input_layernorm.weight if i + 1 < len(m.model.layers) else m.model.norm.weight
            h = self.norm(residual, nxt)
        return F.linear(h, m.lm_head.weight)


def large_random_model(directory: Path) -> Path:
    """A Llama of about 150M parameters (hidden 1024, 8 layers, GQA 16/4, vocab 32000), random weights."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                      num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048,
                      bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)
    return save_random_model(directory / "llama-150m", cfg)


def timed_steps(fn, steps: int) -> float:
    """Seconds per step, over `steps` steps."""
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - start) / steps


@torch.inference_mode()
def measure(path: Path, dtype: torch.dtype, batch: int, context: int, steps: int, repeats: int) -> dict:
    """Tokens/s of each way of running the step (medians of alternating runs), and how far the compiled
    step's logits are from the native step's."""
    bs = 16
    width = -(-(context + 1) // bs)
    llm = LLM(str(path), dtype=str(dtype).removeprefix("torch."), block_size=bs, num_kv_blocks=batch * width + 1,
              max_num_seqs=max(batch, 1), max_model_len=context + 1, num_scheduler_steps=1)
    engine = llm.engine
    native, storage = engine.runner.native, engine.storage
    native.max_batch = None         # (where csrc/gemm.c does not multiply the dtype: the matrix-vector products)
    for layer in storage.layers:
        layer.normal_(generator=torch.Generator().manual_seed(0))
    plain = load_model(resolve_model(str(path)), ModelConfig.from_path(resolve_model(str(path))), dtype,
                       torch.device("cpu"), context + 1, pack_weights=False)
    g = torch.Generator().manual_seed(batch)
    input_ids = torch.randint(3, plain.config.vocab_size, (batch,), generator=g)
    positions = torch.full((batch,), context - 1, dtype=torch.int64)
    tables = torch.arange(batch * width, dtype=torch.int64).view(batch, width)
    context_lens = torch.full((batch,), context, dtype=torch.int64)
    slots = tables[:, (context - 1) // bs] * bs + (context - 1) % bs
    attn_batch = AttentionBatch(num_decodes=batch, slot_mapping=slots, block_tables=tables, context_lens=context_lens,
                                query_lens=[1] * batch, context_lens_list=[context] * batch, has_prefix=False)
    step = TorchDecode(plain).eval()
    compiled = torch.compile(step, dynamic=False, fullgraph=True)
    args = (input_ids, positions, slots, tables, context_lens, storage.layers)
    runners = {"native": lambda: native.run(input_ids, positions, attn_batch),
               "compiled": lambda: compiled(*args), "eager": lambda: step(*args)}
    start = time.perf_counter()
    ours, theirs = runners["native"]().float(), runners["compiled"]().float()
    compile_s = time.perf_counter() - start
    agree = (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item()
    diff = (ours - theirs).abs().max().item()
    for fn in runners.values():
        timed_steps(fn, 2)
    runs = {name: [] for name in runners}
    for _ in range(repeats):
        for name, fn in runners.items():
            runs[name].append(timed_steps(fn, steps))
    s = {name: statistics.median(r) for name, r in runs.items()}
    return {"model": path.name, "dtype": str(dtype).removeprefix("torch."), "batch": batch,
            "tok_s": {name: batch / v for name, v in s.items()}, "compiled_over_native": s["native"] / s["compiled"],
            "eager_over_native": s["native"] / s["eager"], "argmax_agreement": agree, "max_logit_diff": diff,
            "first_call_s": compile_s, "runs_s": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint (default: the bundled demo model)")
    parser.add_argument("--random-large", action="store_true", help="also a random ~150M-parameter Llama")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    models = [resolve_model(args.model)]
    with tempfile.TemporaryDirectory() as tmp:
        if args.random_large:
            models.append(large_random_model(Path(tmp)))
        print(f"decode step of B sequences at context {args.context}; median of {args.repeats} alternating runs "
              f"of {args.steps} steps; {args.threads} threads")
        print("model          dtype     B   native tok/s  compiled tok/s  eager tok/s  compiled/native  "
              "eager/native  argmax agree  max |logit diff|  first compiled call s")
        for path in models:
            for dtype in args.dtypes:
                for batch in args.batches:
                    r = measure(Path(path), getattr(torch, dtype), batch, args.context, args.steps, args.repeats)
                    t = r["tok_s"]
                    print(f"{r['model'][:13]:13}  {r['dtype']:8}  {batch:2}  {t['native']:12.0f}  {t['compiled']:14.0f}"
                          f"  {t['eager']:11.0f}  {r['compiled_over_native']:15.2f}x  {r['eager_over_native']:11.2f}x"
                          f"  {r['argmax_agreement']:12.0%}  {r['max_logit_diff']:16.3g}  {r['first_call_s']:21.1f}",
                          flush=True)


if __name__ == "__main__":
    main()
