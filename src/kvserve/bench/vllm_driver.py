"""Runs vLLM's CPU build for `bench throughput`: a script, run by path under the interpreter of an environment
that has vllm (never imported by kvserve, and importing nothing of it: that environment has no kvserve).

    python vllm_driver.py OUT.json < JOB.json

JOB: {"model": a Hugging Face checkpoint dir, "prompts": [[token id, ...], ...] (the batch), "prompt1": [...] (the
batch-1 prompt), "tokens", "batch1_tokens", "repeats", "max_model_len", "enforce_eager"}. OUT gets, for the batch
and for prompt1 alone, each repeat's prefill seconds (a generate of one token each), generate seconds (`tokens`
each) and decode tok/s of that run, and the greedy tokens of the last run; the peak RSS of the driver and of its
engine's processes; and vLLM's version. Threads, their cores and the KV cache's size come from vLLM's own
environment variables (VLLM_CPU_OMP_THREADS_BIND, VLLM_CPU_KVCACHE_SPACE), set by whoever starts the driver.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def _peak_rss(pid: int) -> int:
    """VmHWM (bytes) of process `pid`; 0 where it has gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    return next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmHWM:")), 0)


def _descendants(pid: int) -> list[int]:
    """Every live process below `pid` (vLLM's engine core runs in one of its own)."""
    children = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return [p for c in children for p in (c, *_descendants(c))]


def _timed(llm, prompts: list[list[int]], tokens: int) -> float:
    """Seconds of one greedy generate of `tokens` new tokens per prompt (EOS held off)."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - start


def _decode(engine, prompts: list[list[int]], tokens: int, run: int) -> tuple[float, float, list[list[int]]]:
    """One greedy run of `tokens` new tokens per prompt, stepping vLLM's engine: the run's seconds, its decode
    tok/s (from when every prompt has its first token to the last, the tokens made meanwhile: as kvserve's
    bench.common.decode_rate times its own engine), and the tokens."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, detokenize=False,
                            output_kind=RequestOutputKind.DELTA)
    made: dict[str, list[int]] = {f"run{run}-{i}": [] for i in range(len(prompts))}
    start = time.perf_counter()
    for request_id, prompt in zip(made, prompts):
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)

    def step() -> None:
        for out in engine.step():
            made[out.request_id] += out.outputs[0].token_ids

    while not all(made.values()):
        step()
    first, decode_start = sum(map(len, made.values())), time.perf_counter()
    while engine.has_unfinished_requests():
        step()
    end = time.perf_counter()
    return end - start, (sum(map(len, made.values())) - first) / (end - decode_start), list(made.values())


def _runs(llm, prompts: list[list[int]], tokens: int, repeats: int) -> dict:
    """A warm-up of each kind, then `repeats` prefill runs (a generate of one token each) alternating with full
    ones (_decode)."""
    _timed(llm, prompts, 1)
    _decode(llm.llm_engine, prompts, min(4, tokens), -1)
    runs: dict[str, list] = {"prefill_s": [], "generate_s": [], "decode_tok_s": []}
    for i in range(repeats):
        runs["prefill_s"].append(_timed(llm, prompts, 1))
        seconds, rate, outputs = _decode(llm.llm_engine, prompts, tokens, i)
        runs["generate_s"].append(seconds)
        runs["decode_tok_s"].append(rate)
    return {**runs, "token_ids": outputs}


def run(job: dict) -> dict:
    import vllm

    # every run computes its prompts: the runs repeat the same prompts, which the prefix cache would serve
    llm = vllm.LLM(model=job["model"], skip_tokenizer_init=True, dtype="bfloat16", seed=0,
                   max_model_len=job["max_model_len"], max_num_seqs=len(job["prompts"]),
                   enable_prefix_caching=False, enforce_eager=job["enforce_eager"])
    batch = _runs(llm, job["prompts"], job["tokens"], job["repeats"])
    batch1 = _runs(llm, [job["prompt1"]], job["batch1_tokens"], job["repeats"])
    me = os.getpid()
    return {"vllm_version": vllm.__version__, "batch": batch, "batch1": batch1,
            "peak_rss": {"driver": _peak_rss(me), "engine": sum(_peak_rss(p) for p in _descendants(me))}}


if __name__ == "__main__":      # vLLM starts its engine process by spawn, which imports this file again
    Path(sys.argv[1]).write_text(json.dumps(run(json.load(sys.stdin))))
