"""Sparse decode attention (Quest) against dense attention and the eviction policies: quality and step time.

Quality, on the demo model (or --model) at its full context, every policy at a budget of a share of it
(default 1/8):
- passkey accuracy of full-context prompts (the prompt computed densely, the answer's tokens decoded) for dense
  attention, Quest (its dense_layers as given, and 0), and at the same budget sink+window, h2o and snapkv (bench
  eviction's policies);
- held-out text decoded token by token (each step fed the text's next token): its perplexity, the KL divergence of
  each step's next-token distribution from dense attention's, and (Quest) the share of each decode's dense
  attention probabilities that the blocks it chose hold, per layer and KV head.
Speed, at a real model's shape with random weights (--shape, default TinyLlama-1.1B's): the C decode step of
B sequences of C cached tokens, dense and Quest (budget C/8 unless --speed-budget) run alternately in one process,
the median of --repeats steps each, and the read bandwidth measured beside them. The caches hold random keys and
values written straight into the pages (prefilling 16 x 32K tokens on a CPU takes hours; a step's time does not
depend on what the pages hold, only on how many of them it reads); a configuration whose cache would pass
--kv-memory keeps fewer of the model's layers, and says so.
"""
from __future__ import annotations

import argparse
import gc
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kvserve.arg_utils import write_json
from kvserve.attention.batch import AttentionBatch
from kvserve.attention.gather import gather_context
from kvserve.attention.sparse import SparseDecode, choose_blocks
from kvserve.bench.common import (SHAPES, ReadBandwidth, add_model_args, describe_shape, linear_bytes,
                                  make_checkpoint, model_shape, print_table)
from kvserve.bench.eviction import DEPTHS, policies
from kvserve.config import ModelConfig
from kvserve.eval.data import held_out_text
from kvserve.eval.retrieval import passkey_accuracy
from kvserve.llm import LLM
from kvserve.sampling import SamplingParams

NAME = "sparse"
PASSKEY_TARGET = 0.95         # Quest at a budget of 1/8 of the context
SPEEDUP_TARGET = 3.0          # 16 sequences of 32K at a budget of 1/8: dense step time / Quest's
CONTEXTS = (4096, 16384, 32768)
BATCHES = (1, 16)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="the quality part's checkpoint (default: the bundled demo model)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--budget-share", type=float, default=1 / 8, help="every policy's budget, a share of the context")
    p.add_argument("--recent", type=int, default=None, help="Quest's recent window (default: a quarter of the budget)")
    p.add_argument("--sinks", type=int, default=16)
    p.add_argument("--dense-layers", type=int, default=2)
    p.add_argument("--passkey-trials", type=int, default=None, help="per depth (default 8; quick: 2)")
    p.add_argument("--texts", type=int, default=None, help="held-out windows decoded (default 2; quick: 1)")
    p.add_argument("--prefill", type=int, default=256, help="tokens of each window computed as its prompt")
    p.add_argument("--contexts", default=None, help="cached tokens per sequence (default 4096,16384,32768; quick: "
                                                    "4096)")
    p.add_argument("--batches", default=None, help="sequences (default 1,16; quick: 1,4)")
    p.add_argument("--speed-budget", type=int, default=None, help="Quest's budget in the speed part (default C/8)")
    p.add_argument("--kv-memory", default="2.5GiB", help="the most KV a speed configuration holds; past it, fewer "
                                                        "layers")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="the speed part's threads (default: torch's)")
    p.add_argument("--skip", choices=("quality", "speed"), default=None)
    add_model_args(p, SHAPES["tinyllama-1.1b"])     # the speed part's model: TinyLlama-1.1B's shape by default


def quest(budget: int, recent: int, sinks: int, dense_layers: int) -> str:
    return f"quest:budget={budget},recent={recent},sinks={sinks},dense_layers={dense_layers}"


def run(args: argparse.Namespace) -> int:
    out: dict = {"budget_share": args.budget_share}
    if args.skip != "quality":
        out["quality"] = quality(args)
    if args.skip != "speed":
        out["speed"] = speed(args)
    write_json(args.json_path, out)
    return 0


# ---- quality ------------------------------------------------------------------------------------------------------

def quality(args: argparse.Namespace) -> dict:
    trials = args.passkey_trials or (2 if args.quick else 8)
    texts = args.texts or (1 if args.quick else 2)
    probe = LLM(args.model, block_size=args.block_size, num_kv_blocks=1)
    context, layers = probe.engine.max_model_len, probe.engine.model_config.num_layers
    ids = probe.get_tokenizer().encode(held_out_text(), add_special_tokens=False)
    windows = [ids[i * context:(i + 1) * context] for i in range(texts)]
    del probe
    budget = int(args.budget_share * context)
    recent = args.recent or budget // 4
    setups = {"dense": {}, f"quest (dense_layers={args.dense_layers})": {
        "sparse_attention": quest(budget, recent, args.sinks, args.dense_layers)}}
    if args.dense_layers:
        setups["quest (dense_layers=0)"] = {"sparse_attention": quest(budget, recent, args.sinks, 0)}
    evictions = policies(budget, args.block_size)
    setups.update({name: {"eviction": evictions[name]} for name in ("sink", "h2o", "snapkv")})
    print(f"sparse quality: {args.model or 'demo model'} ({layers} layers), context {context}, budget {budget} "
          f"tokens ({args.budget_share:.3g} of it); passkey {trials} x {len(DEPTHS)} depths at {context} tokens; "
          f"{texts} held-out window(s) of {context} tokens decoded from token {args.prefill}")
    rows, reference = [], None
    for name, kw in setups.items():
        llm = LLM(args.model, block_size=args.block_size, enable_prefix_caching=False, **kw)
        cells = passkey_accuracy(llm, [context], list(DEPTHS), trials)
        row = {"policy": name, "spec": kw.get("sparse_attention") or kw.get("eviction"),
               "passkey": sum(c.correct for c in cells) / sum(c.trials for c in cells)}
        # (the probe decodes op by op, where the others take the C step: the two compute the same numbers up to
        # the order of their sums, far below the differences measured)
        probe = MassProbe.attach(llm) if "sparse_attention" in kw else None
        logits = forced_decode(llm, windows, args.prefill)
        reference = logits if reference is None else reference
        row.update(text_scores(logits, reference, windows, args.prefill))
        if probe is not None:
            # (None where no layer selects: every layer among the dense_layers)
            row["mass_share"] = statistics.fmean(probe.shares) if probe.shares else None
            stats = llm.stats()
            row["blocks_read"] = stats["sparse_blocks_read"] / max(1, stats["sparse_blocks_total"])
        rows.append(row)
        print(f"  {name}: passkey {row['passkey']:.0%}, perplexity {row['perplexity']:.3f}, KL {row['kl']:.4f}"
              + (f", dense mass held {row['mass_share']:.1%}" if row.get("mass_share") is not None else ""),
              flush=True)
    print_table(["policy", "passkey", "perplexity", "KL from dense (nats)", "dense mass held", "blocks read"],
                [[r["policy"], f"{r['passkey']:.0%}", f"{r['perplexity']:.3f}", f"{r['kl']:.4f}",
                  f"{r['mass_share']:.1%}" if r.get("mass_share") is not None else "-",
                  f"{r['blocks_read']:.1%}" if "blocks_read" in r else "-"] for r in rows])
    main = rows[1]
    print(f"target {main['policy']} at {args.budget_share:.3g} of the context: passkey >= {PASSKEY_TARGET:.0%} "
          f"({main['passkey']:.0%}, dense {rows[0]['passkey']:.0%}): "
          f"{'met' if main['passkey'] >= PASSKEY_TARGET else 'NOT met'}")
    return {"context": context, "budget": budget, "recent": recent, "sinks": args.sinks, "rows": rows}


def forced_decode(llm: LLM, windows: list[list[int]], prefill: int) -> list[torch.Tensor]:
    """Each window's logits [len - prefill, vocab] (float32) of the decode steps that follow its first `prefill`
    tokens computed as a prompt, each step fed the window's next token (not the one it sampled): the windows
    decoded together, one step at a time (the C step where it runs)."""
    engine = llm.engine
    seqs = [engine.add_request(f"text-{i}", {"prompt_token_ids": w[:prefill]},
                               SamplingParams(max_tokens=len(w) - prefill, temperature=0, ignore_eos=True))
            for i, w in enumerate(windows)]
    rows: dict[int, list[torch.Tensor]] = {id(s.params): [] for s in seqs}
    sampler = engine.sampler

    def recording(logits, params, generators, histories=None, mask=None):    # each sampling row's logits, by params
        for p, row in zip(params, logits.float()):
            rows[id(p)].append(row.clone())
        return sampler(logits, params, generators, histories, mask)

    engine.sampler = recording
    try:
        while engine.has_unfinished_requests():
            engine.step()
            for seq, window in zip(seqs, windows):
                if not seq.is_finished:     # the text's next token, in place of the one sampled
                    seq.token_ids[-1] = window[len(seq.token_ids) - 1]
    finally:
        engine.sampler = sampler
    return [torch.stack(rows[id(s.params)]) for s in seqs]


def text_scores(logits: list[torch.Tensor], reference: list[torch.Tensor], windows: list[list[int]],
                prefill: int) -> dict:
    """Perplexity of the windows' decoded tokens, and the mean KL divergence of each step's next-token distribution
    from the reference's (dense attention), KL(reference || this)."""
    nll, kl = [], []
    for mine, ref, w in zip(logits, reference, windows):
        logp, ref_logp = mine.log_softmax(-1), ref.log_softmax(-1)
        targets = torch.tensor(w[prefill:])
        nll.append(-logp.gather(1, targets[:, None]).squeeze(1))
        kl.append((ref_logp.exp() * (ref_logp - logp)).sum(-1))
    return {"perplexity": math.exp(torch.cat(nll).mean().item()), "kl": torch.cat(kl).mean().item()}


class MassProbe:
    """Beside the eager backend of an engine under sparse attention: for each decode that selects, the share of its
    dense attention probabilities (per layer and KV head, over its query heads) that the blocks its selection reads
    hold (attention/sparse.py's select_blocks, the C kernels' choice)."""

    def __init__(self, backend):
        self.backend, self.shares = backend, []

    @classmethod
    def attach(cls, llm: LLM) -> MassProbe:
        """A probe in front of the engine's eager executor's backend (its C step, which calls no backend, off)."""
        engine = llm.engine
        engine.runner.executors = [e for e in engine.runner.executors if hasattr(e, "backend")]
        probe = cls(engine.runner.executors[0].backend)
        for executor in engine.runner.executors:
            executor.backend = probe
        return probe

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def forward(self, q, k, v, kv_cache, batch: AttentionBatch, scale: float, sliding_window=None,
                logits_soft_cap=None):
        out = self.backend.forward(q, k, v, kv_cache, batch, scale, sliding_window, logits_soft_cap)
        nd = batch.num_decodes
        if batch.sparse is not None and sliding_window is None and nd:
            self._measure(q[:nd], kv_cache, batch, nd, scale)
        return out

    def _measure(self, q, kv_cache, batch: AttentionBatch, nd: int, scale: float) -> None:
        params = batch.sparse.params[:nd]
        chosen = choose_blocks(q, kv_cache, batch.block_tables[:nd], batch.context_lens[:nd], params)
        bs = kv_cache.shape[3]
        for s in range(nd):
            ctx = batch.context_lens_list[s]
            if not 0 < params[s, 0] < ctx:
                continue
            keys = gather_context(kv_cache, batch.block_tables[s:s + 1], ctx)[0, :, 0].float()     # [KVH, L, D]
            heads = q[s].float().view(keys.shape[0], -1, q.shape[-1])
            probs = (torch.einsum("hgd,hld->hgl", heads, keys) * scale).softmax(-1)               # [KVH, G, L]
            read = chosen[s].repeat_interleave(bs, -1)[:, None, :ctx]                             # [KVH, 1, L]
            self.shares += (probs * read).sum(-1).mean(-1).tolist()


# ---- speed --------------------------------------------------------------------------------------------------------

def speed(args: argparse.Namespace) -> dict:
    from kvserve.config import parse_bytes

    contexts = [int(c) for c in (args.contexts or ("4096" if args.quick else ",".join(map(str, CONTEXTS)))).split(",")]
    batches = [int(b) for b in (args.batches or ("1,4" if args.quick else ",".join(map(str, BATCHES)))).split(",")]
    shape, bs = model_shape(args), args.block_size
    kv_memory = parse_bytes(args.kv_memory)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    reader = ReadBandwidth(torch.device("cpu"))
    print(f"sparse speed: the C decode step, {describe_shape(shape)}, bfloat16, random weights and caches; "
          f"Quest budget {'C/8' if args.speed_budget is None else args.speed_budget}, recent 128 and sinks 16 (a "
          f"quarter of a smaller budget each), dense_layers 0; median of {args.repeats} steps each, dense and Quest "
          f"alternating; threads {torch.get_num_threads()}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvserve-bench-") as tmp:
        for context in contexts:
            for batch in batches:
                budget = args.speed_budget or context // 8
                page = page_bytes(shape)
                per_layer = batch * (context + bs) * (page + page // bs)         # pages and their summaries
                layers = max(1, min(shape["num_layers"], kv_memory // per_layer))
                row = measure_step(Path(tmp), shape, layers, context, max(contexts), batch, budget, bs, args.repeats,
                                   reader)
                rows.append(row)
                print(f"  C {context} x {batch}: {layers} layers, dense {row['dense_ms']:.1f} ms, quest "
                      f"{row['quest_ms']:.1f} ms ({row['speedup']:.2f}x); dense reads {row['dense_gb_s']:.1f} GB/s "
                      f"of the {row['bandwidth_gb_s']:.1f} GB/s measured", flush=True)
    print_table(["context", "seqs", "layers", "dense ms", "quest ms", "dense / quest", "KV read dense / quest",
                 "dense GB/s", "bandwidth GB/s"],
                [[r["context"], r["batch"], r["layers"], f"{r['dense_ms']:.1f}", f"{r['quest_ms']:.1f}",
                  f"{r['speedup']:.2f}x", f"{r['kv_read_ratio']:.1f}x", f"{r['dense_gb_s']:.1f}",
                  f"{r['bandwidth_gb_s']:.1f}"] for r in rows])
    target = next((r for r in rows if r["context"] == 32768 and r["batch"] == 16), None)
    if target is not None:
        print(f"target 16 x 32K at a budget of 1/8: >= {SPEEDUP_TARGET:.0f}x ({target['speedup']:.2f}x, "
              f"{target['layers']} layers): {'met' if target['speedup'] >= SPEEDUP_TARGET else 'NOT met'}")
    slower = [r for r in rows if r["speedup"] < 1.0]
    print(f"target never slower than dense: {'met' if not slower else 'NOT met'}"
          + "".join(f"; {r['context']} x {r['batch']}: {r['speedup']:.2f}x" for r in slower))
    return {"shape": shape, "rows": rows}


def page_bytes(shape: dict) -> int:
    """One token's K and V in one layer, in bfloat16 (a block's summaries: as much as one of its tokens)."""
    return 2 * shape["num_kv_heads"] * shape["hidden_size"] // shape["num_heads"] * 2


def measure_step(tmp: Path, shape: dict, layers: int, context: int, longest: int, batch: int, budget: int, bs: int,
                 repeats: int, reader: ReadBandwidth) -> dict:
    """Dense and Quest step times (ms, medians of alternating steps) of `batch` sequences of `context` cached
    tokens each (one more written by the step), at `layers` of the shape's layers (a checkpoint of positions up
    to `longest`, made once per layer count)."""
    shape = {**shape, "num_layers": layers}
    path = tmp / f"layers-{layers}"
    if not path.exists():
        make_checkpoint(path, shape, longest + bs, torch.bfloat16)
    per_seq = -(-(context + 1) // bs)
    recent, sinks = min(128, budget // 4), min(16, budget // 4)
    llm = LLM(str(path), dtype="bfloat16", block_size=bs, num_kv_blocks=batch * per_seq,
              sparse_attention=quest(budget, recent, sinks, 0), max_model_len=context + 1, enable_prefix_caching=False)
    engine = llm.engine
    native = engine.runner.native
    if native is None:
        raise RuntimeError("the C decode step does not run here (no C compiler, or enforce_eager)")
    storage = engine.storage
    tables = torch.arange(batch * per_seq).view(batch, per_seq)
    g = torch.Generator().manual_seed(0)
    for pages in storage.kv:
        pages.normal_(generator=g)              # random K/V, as RoPE'd keys and values go
    every = torch.arange(storage.num_blocks)
    for i in range(layers):
        storage.layer(i).summarize_blocks(every)
    step = decode_batch(tables, context, bs)
    params = torch.tensor([[budget, sinks, recent, 0]] * batch)
    ids = torch.randint(3, shape["vocab_size"], (batch,), generator=g)
    positions = torch.full((batch,), context)
    bandwidth = reader.measure()
    times: dict[str, list[float]] = {"dense": [], "quest": []}
    sparse = SparseDecode(params, torch.zeros(2, dtype=torch.int64), None)
    for i in range(repeats + 1):             # the first of each: a warm-up, not counted
        for name in ("dense", "quest"):
            step.sparse = sparse if name == "quest" else None
            start = time.perf_counter()
            native.run(ids, positions, step)
            if i:
                times[name].append(time.perf_counter() - start)
    bandwidth = max(bandwidth, reader.measure())
    read, total = sparse.counts.tolist()
    cfg = ModelConfig.from_path(path)
    weights = linear_bytes(cfg, torch.bfloat16)
    kv = batch * (context + 1) * layers * page_bytes(shape)
    dense_s, quest_s = statistics.median(times["dense"]), statistics.median(times["quest"])
    del llm, engine, native, storage
    gc.collect()
    return {"context": context, "batch": batch, "layers": layers, "budget": budget, "dense_ms": dense_s * 1e3,
            "quest_ms": quest_s * 1e3, "speedup": dense_s / quest_s, "kv_read_ratio": total / max(1, read),
            "dense_gb_s": (weights + kv) / dense_s / 1e9, "bandwidth_gb_s": bandwidth / 1e9,
            "dense_steps_ms": [t * 1e3 for t in times["dense"]], "quest_steps_ms": [t * 1e3 for t in times["quest"]]}


def decode_batch(tables: torch.Tensor, context: int, bs: int) -> AttentionBatch:
    """A decode step's batch: each sequence's token at position `context` (its slot), over its block table."""
    batch = len(tables)
    slots = tables[:, context // bs] * bs + context % bs
    lens = [context + 1] * batch
    return AttentionBatch(num_decodes=batch, slot_mapping=slots, block_tables=tables, context_lens=torch.tensor(lens),
                          query_lens=[1] * batch, context_lens_list=lens, has_prefix=False)
