"""Speculative decoding beside plain decoding: tokens/s with n-gram lookup and a draft model, and a verification's cost.

Part 1, end to end on the demo model (or --model), greedy, at each batch of --batches: decode tokens/s of plain
decoding, n-gram lookup (4 drafts, 2- to 4-grams) and a draft model (--draft; by default the model itself with int4
weights, quantized as it loads: a draft that shares everything with it), each configuration in turn in every one of
--repeats rounds (medians; each speculating run's ratio to the plain run of its round), with the acceptance rate
(accepted / draft tokens) and the tokens a sequence gains in a step that verifies (1 + accepted / verifications),
on two workloads:
- code: a held-out standard-library chunk, then its first lines again: continuing code that is in the prompt, as
  editing does (lookup pays);
- free: a chunk to continue (free generation: lookup finds what the model repeats of it, or of itself).

Beside part 1, where the `peers` extra is installed (--llama-cpp, bench/spec_llamacpp.py): llama.cpp on a BF16 GGUF of
the same checkpoint, batch 1, the same prompts and threads, greedy decode tokens/s without and with prompt lookup (as
llama-cpp-python implements it: bench/llamacpp.py's LOOKUP_ROUTE), timed in every round after the engines.

Part 2, what a verification costs (--cost-shape, default TinyLlama-1.1B's, random weights, bfloat16: their drafts
would never be accepted, so no acceptance is measured there): the time of one step of B sequences with k drafts each
against one step of B sequences of one token, by the C step (a row per token, as the engine verifies) and op by op
(the same tokens as a prompt chunk each, through the paged prefill kernel, every position's logits), medians of
--cost-repeats. The ratio says what any acceptance is worth: a step that gains T tokens a sequence decodes T / ratio
times as fast.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kvserve.arg_utils import write_json
from kvserve.bench import spec_llamacpp
from kvserve.bench.common import (DEFAULT_SHAPE, SHAPES, decode_rate, describe_shape, make_checkpoint, print_table,
                                  random_prompts)
from kvserve.engine.scheduler import SchedulerOutput
from kvserve.eval.data import held_out_text
from kvserve.llm import LLM
from kvserve.model.loader import resolve_model
from kvserve.sampling import SamplingParams

NAME = "spec"
NUM_DRAFTS = 4
NGRAM = {"method": "ngram", "num_speculative_tokens": NUM_DRAFTS, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
COST_TARGET = 1.3          # a step of 1 + 4 tokens at batch 1 against a step of 1
WARMUP_TOKENS = 4


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint of part 1 (default: the bundled demo model)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--draft", default=None, help="the draft model's checkpoint (default: the model itself)")
    p.add_argument("--draft-quantization", default="int4", help="its weights quantized as it loads ('none': as stored)")
    p.add_argument("--batches", default="1,16", help="batch sizes (default 1,16)")
    p.add_argument("--tokens", type=int, default=None, help="decode tokens a sequence (default 128; quick: 32)")
    p.add_argument("--repeats", type=int, default=None, help="rounds of part 1 (default 5; quick: 1)")
    p.add_argument("--llama-cpp", default=True, action=argparse.BooleanOptionalAction,
                   help="beside part 1 at batch 1, llama.cpp on the same checkpoint (Llama shapes; needs the peers "
                        "extra) without and with llama-cpp-python's prompt lookup decoding")
    p.add_argument("--cost-shape", default="tinyllama-1.1b", choices=[*sorted(SHAPES), "bench", "none"],
                   help="part 2's random-weight shape ('bench': the benches' small Llama; 'none': no part 2)")
    p.add_argument("--cost-batches", default="1,2,4,8,16")
    p.add_argument("--cost-context", type=int, default=256, help="tokens each sequence holds in part 2")
    p.add_argument("--cost-repeats", type=int, default=None, help="timed steps of each kind (default 9; quick: 3)")


def workloads(tokenizer, batch: int) -> dict[str, list[list[int]]]:
    """`batch` prompts of each workload from held-out standard-library text (kvserve.eval.data)."""
    ids = tokenizer.encode(held_out_text()[:400_000])
    sep = tokenizer.encode("\n\n")
    stride = (len(ids) - 2000) // max(1, batch)
    chunks = [ids[i * stride:i * stride + 480] for i in range(batch)]
    return {"code": [c[:384] + sep + c[:96] for c in chunks], "free": [c[224:480] for c in chunks]}


def run_round(engines: dict[str, LLM], prompts: list[list[int]], tokens: int) -> dict[str, dict]:
    """Each engine's decode tokens/s of the prompts, in turn, and what its speculation did meanwhile."""
    out = {}
    for name, llm in engines.items():
        before = llm.stats()
        rate = decode_rate(llm, prompts, tokens, repeats=1)
        after = llm.stats()
        drafts, accepted, verifications = (after.get(k, 0) - before.get(k, 0) for k in
                                           ("spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
                                            "spec_decode_num_drafts"))
        out[name] = {"tok_s": rate, "acceptance": accepted / drafts if drafts else None,
                     "tokens_per_verification": 1 + accepted / verifications if verifications else None}
    return out


def end_to_end(args: argparse.Namespace, batches: list[int], tokens: int, repeats: int) -> dict:
    """Part 1: every engine and workload, `repeats` rounds at each batch size; and at batch 1 llama.cpp's rounds after
    the engines' in each (with --llama-cpp where it runs)."""
    draft = args.draft or str(resolve_model(args.model))
    quantization = None if args.draft_quantization == "none" else args.draft_quantization
    configs = {"plain": None, "ngram": NGRAM,
               "draft": {"model": draft, "num_speculative_tokens": NUM_DRAFTS, "quantization": quantization}}
    results, peer = {}, {"results": {}}
    for batch in batches:
        # speculation at every batch here, whatever the default: this is how the default is chosen
        engines = {name: LLM(args.model, dtype=args.dtype, max_num_seqs=max(batches),
                             speculative_config=None if spec is None else {**spec, "disable_by_batch_size": batch})
                   for name, spec in configs.items()}
        loads = workloads(engines["plain"].get_tokenizer(), batch)
        with tempfile.TemporaryDirectory() as tmp:
            peers = _peers(args, batches, batch, loads, tokens, Path(tmp))
            for workload, prompts in loads.items():
                rounds, peer_rounds = _rounds(engines, peers, prompts, tokens, repeats)
                results[f"{workload}, batch {batch}"] = summarize(rounds)
                if peers is not None:
                    peer["results"][workload] = spec_llamacpp.summarize(peer_rounds)
            if peers is not None:
                peer.update(peers.describe())
                peers.close()
    return {"draft": f"{draft} ({quantization or 'as stored'})", "results": results,
            "llama_cpp": peer if peer["results"] else None}


def _rounds(engines: dict[str, LLM], peers, prompts: list[list[int]], tokens: int, repeats: int) -> tuple[list, list]:
    """An untimed round (each engine's first steps set up its kernels), then `repeats` rounds of the engines, each
    followed by llama.cpp's on the first prompt where `peers` (spec_llamacpp.Peers) are given."""
    run_round(engines, prompts, WARMUP_TOKENS)
    if peers is not None:
        spec_llamacpp.run_round(peers, prompts[0], WARMUP_TOKENS)
    rounds, peer_rounds = [], []
    for _ in range(repeats):
        rounds.append(run_round(engines, prompts, tokens))
        if peers is not None:
            peer_rounds.append(spec_llamacpp.run_round(peers, prompts[0], tokens))
    return rounds, peer_rounds


def _peers(args: argparse.Namespace, batches: list[int], batch: int, loads: dict, tokens: int, tmp: Path):
    """llama.cpp's two `Llama`s at batch 1 (spec_llamacpp.Peers), with --llama-cpp where they run; else None (and,
    at the first batch, a line saying why)."""
    if not args.llama_cpp:
        return None
    checkpoint = resolve_model(args.model)
    why = spec_llamacpp.why_not(checkpoint, batches)
    if why is not None:
        if batch == batches[0]:
            print(f"llama.cpp not run: {why}")
        return None
    if batch != 1:
        return None
    n_ctx = max(len(p) for prompts in loads.values() for p in prompts) + tokens + NUM_DRAFTS + 2
    return spec_llamacpp.load(checkpoint, tmp, n_ctx, NGRAM["prompt_lookup_max"], NUM_DRAFTS)


def summarize(rounds: list[dict]) -> dict:
    """Medians over the rounds: tokens/s, and each speculating engine's ratio to plain decoding in its round."""
    out = {}
    for name in rounds[0]:
        runs = [r[name] for r in rounds]
        accepted = [r["acceptance"] for r in runs if r["acceptance"] is not None]
        gained = [r["tokens_per_verification"] for r in runs if r["tokens_per_verification"] is not None]
        out[name] = {"tok_s": statistics.median(r["tok_s"] for r in runs),
                     "vs_plain": statistics.median(r[name]["tok_s"] / r["plain"]["tok_s"] for r in rounds),
                     "acceptance": statistics.median(accepted) if accepted else None,
                     "tokens_per_verification": statistics.median(gained) if gained else None,
                     "runs_tok_s": [r["tok_s"] for r in runs]}
    return out


def step_costs(path: Path, batches: list[int], context: int, repeats: int) -> dict:
    """Part 2: the median seconds of a step of each kind at each batch size."""
    llm = LLM(str(path), dtype="bfloat16", max_num_seqs=max(batches), enable_prefix_caching=False,
              max_model_len=context + 2 * NUM_DRAFTS + 2, speculative_config=NGRAM)
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    out = {}
    for batch in batches:
        for i, prompt in enumerate(random_prompts(batch, context, vocab, seed=batch)):
            engine.add_request(f"cost-{batch}-{i}", {"prompt_token_ids": prompt},
                               SamplingParams(max_tokens=NUM_DRAFTS + 2, temperature=0, ignore_eos=True))
        while any(s.num_output_tokens == 0 for s in [*engine.scheduler.waiting, *engine.scheduler.running]):
            engine.step()
        seqs = list(engine.scheduler.running)
        for seq in seqs:   # room for the drafts' K/V, which every timed step writes at the same slots
            engine.kv.allocate(seq.seq_id, seq.num_tokens_in_cache, 1 + NUM_DRAFTS)
            seq.spec_token_ids = random_prompts(1, NUM_DRAFTS, vocab, seed=seq.seq_id)[0]
        out[batch] = {kind: _median_step(engine, seqs, kind, repeats) for kind in ("plain", "verify", "prefill")}
        for seq in seqs:
            engine.abort_request(seq.request_id)
    return out


def _median_step(engine, seqs: list, kind: str, repeats: int) -> float:
    """Median seconds of one step of the sequences: `plain` (a token each), `verify` (a token and its drafts, as the
    engine verifies them: by the C step's rows) or `prefill` (the same tokens as a prompt chunk each, op by op, the
    logits of every one)."""
    sched = SchedulerOutput()
    for seq in seqs:
        n = 1 + NUM_DRAFTS if kind != "plain" else 1
        sched.add(seq, n, NUM_DRAFTS if kind == "verify" else 0)
    sched.num_decodes = len(seqs) if kind != "prefill" else 0
    runner = engine.runner

    def step() -> None:
        if kind != "prefill":
            runner.run(sched)
            return
        for seq in seqs:
            seq.token_ids += seq.spec_token_ids
        try:
            inputs = runner.prepare(sched)
        finally:
            for seq in seqs:
                del seq.token_ids[-NUM_DRAFTS:]
        model = runner.model
        model.compute_logits(model(inputs.input_ids, inputs.positions, inputs.batch, runner.backend, runner.storage))

    times = []
    with torch.inference_mode():
        for _ in range(2 + repeats):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


def report_end_to_end(part: dict) -> None:
    """One row a workload and batch: plain decoding's tokens/s beside each speculating engine's, its ratio to
    plain decoding, its acceptance rate and the tokens a verifying step gains a sequence."""
    print(f"Part 1: greedy decode tokens/s, medians; draft model: {part['draft']}")
    names = [n for n in next(iter(part["results"].values())) if n != "plain"]
    headers = ["workload", "plain tok/s"]
    for name in names:
        headers += [f"{name} tok/s", "vs plain", "acceptance", "tokens/verification"]
    rows = []
    for where, res in part["results"].items():
        row = [where, f"{res['plain']['tok_s']:.1f}"]
        for name in names:
            r = res[name]
            row += [f"{r['tok_s']:.1f}", f"{r['vs_plain']:.2f}x",
                    "" if r["acceptance"] is None else f"{r['acceptance']:.2f}",
                    "" if r["tokens_per_verification"] is None else f"{r['tokens_per_verification']:.2f}"]
        rows.append(row)
    print_table(headers, rows)


def report_costs(costs: dict, shape: str) -> dict:
    """The cost table, and the ratios it prints."""
    print(f"\nPart 2: one step's time, {shape}, bfloat16 (random weights: no acceptance measured here)")
    rows, ratios = [], {}
    for batch, c in costs.items():
        ratio = c["verify"] / c["plain"]
        ratios[batch] = {"verify_over_plain": ratio, "prefill_over_verify": c["prefill"] / c["verify"]}
        rows.append([str(batch), f"{c['plain'] * 1e3:.1f}", f"{c['verify'] * 1e3:.1f}", f"{c['prefill'] * 1e3:.1f}",
                     f"{ratio:.2f}x", f"{c['prefill'] / c['verify']:.2f}x", f"{3 / ratio:.2f}x"])
    print_table(["batch", "plain ms", f"verify 1+{NUM_DRAFTS} ms (C step)", "op by op ms", "verify / plain",
                 "op by op / C step", "at 3 tokens a step"], rows)
    if 1 in ratios:
        ratio = ratios[1]["verify_over_plain"]
        print(f"target: a step of 1+{NUM_DRAFTS} tokens at batch 1 at most {COST_TARGET}x a plain step: "
              f"{ratio:.2f}x ({'met' if ratio <= COST_TARGET else 'NOT met'})")
    return ratios


def run(args: argparse.Namespace) -> int:
    tokens = args.tokens or (32 if args.quick else 128)
    repeats = args.repeats or (1 if args.quick else 5)
    cost_repeats = args.cost_repeats or (3 if args.quick else 9)
    batches = [int(b) for b in args.batches.split(",")]
    load = os.getloadavg()[0]
    print(f"load average {load:.1f} at the start; torch threads {torch.get_num_threads()}")
    part1 = end_to_end(args, batches, tokens, repeats)
    report_end_to_end(part1)
    if part1["llama_cpp"] is not None:
        spec_llamacpp.report(part1, part1["llama_cpp"])
    data = {"tokens": tokens, "repeats": repeats, "num_speculative_tokens": NUM_DRAFTS, "end_to_end": part1,
            "load_start": load}
    if args.cost_shape != "none":
        shape = dict(DEFAULT_SHAPE if args.cost_shape == "bench" else SHAPES[args.cost_shape])
        cost_batches = [int(b) for b in args.cost_batches.split(",")]
        with tempfile.TemporaryDirectory() as tmp:
            path = make_checkpoint(Path(tmp) / "model", shape, args.cost_context + 2 * NUM_DRAFTS + 2,
                                   dtype=torch.bfloat16)
            costs = step_costs(path, cost_batches, args.cost_context, cost_repeats)
        data["costs"] = {"shape": describe_shape(shape), "context": args.cost_context, "seconds": costs,
                         "ratios": report_costs(costs, describe_shape(shape))}
    data["load_end"] = os.getloadavg()[0]
    print(f"load average {data['load_end']:.1f} at the end")
    write_json(args.json_path, data)
    return 0
