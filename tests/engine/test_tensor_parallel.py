"""Tensor parallelism on the CPU: two gloo ranks give what one rank gives, and their processes never outlive
the LLM."""
from __future__ import annotations

import json
import os
import signal

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig, ModelConfig
from kvserve.parallel.sharding import check_tensor_parallel
from kvserve.parallel.worker import WorkerArgs
from kvserve.parallel.workers import Workers
from kvserve.kv import KVSpec
from kvserve.model.layers import gemm_packs
from kvserve.model.loader import load_model
from kvserve.parallel.group import TensorParallel
from kvserve.parallel.watchdog import STEP_TIMEOUT_FACTOR, STEP_TIMEOUT_FLOOR, StepBound
from kvserve.planner import num_blocks
from timings import measured

WINDOW = 8                  # the sliding window of the hybrid checkpoints (tiny_models.HYBRID)
SYSTEM = torch.randint(3, 384, (40,), generator=torch.Generator().manual_seed(7)).tolist()
PROMPTS = [[5, 17, 33, 2, 99, 100, 7], list(range(8, 30)), [5, 17, 33, 2, 99, 100, 7, 61, 62]]


def _run(path, tp: int, params: SamplingParams, batches=(PROMPTS,), **kw):
    """Greedy outputs of each batch of prompts in turn, the logits of every scored prompt token, and the stats of
    an LLM of `tp` ranks (shut down)."""
    llm = LLM(str(path), tensor_parallel_size=tp, dtype="float32", seed=0, **kw)
    logits = []
    llm.engine.outputs.prompt_logits_hook = lambda seqs, step_logits, spans: logits.append(step_logits.clone())
    try:
        outs = [out for prompts in batches for out in llm.generate(prompts, params, use_tqdm=False)]
        return outs, torch.cat(logits) if logits else torch.empty(0), llm.stats()
    finally:
        llm.shutdown()


def _assert_same(one, two, tol: float = 1e-4):
    """The same tokens, prompt logits within 1e-4 and sampled tokens' logprobs within tol."""
    (outs1, logits1, _), (outs2, logits2, _) = one, two
    assert [[c.token_ids for c in o.outputs] for o in outs1] == [[c.token_ids for c in o.outputs] for o in outs2]
    torch.testing.assert_close(logits2, logits1, atol=1e-4, rtol=0)
    for o1, o2 in zip(outs1, outs2):
        for c1, c2 in zip(o1.outputs, o2.outputs):
            for lp1, lp2 in zip(c1.logprobs, c2.logprobs):
                assert lp1.keys() == lp2.keys()
                assert all(abs(lp1[t].logprob - lp2[t].logprob) < tol for t in lp1)


@pytest.mark.parametrize("arch,overrides", [
    ("llama", {}),                                            # GQA: 4 heads, 2 KV heads, one each
    ("qwen2", {"tie_word_embeddings": True}),                 # q/k/v biases, lm_head tied to the embedding
    ("llama", {"num_key_value_heads": 1}),                    # one KV head, replicated on both ranks
], ids=["llama-gqa", "qwen2-bias-tied", "one-kv-head"])
def test_two_ranks_give_one_ranks_tokens_and_logits(checkpoint, arch, overrides):
    path = checkpoint(arch, **overrides)
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=3, prompt_logprobs=1)
    one, two = _run(path, 1, params), _run(path, 2, params)
    _assert_same(one, two)
    # the decodes by the C step on every rank, with the all-reduces between its layers; the prompts op by op
    assert two[2]["steps"]["native_tp"] > 0 and two[2]["steps"]["eager_tp"] > 0
    assert two[2]["tensor_parallel_size"] == 2
    assert two[2]["gemm"]["weight_format"] == "gemm"      # csrc/gemm.c's panels, which the C step reads
    # each rank's pool holds its KV heads: half the bytes of one rank's, unless its one KV head is replicated
    replicated = overrides.get("num_key_value_heads") == 1
    assert two[2]["kv_cache_bytes"] * (1 if replicated else 2) == one[2]["kv_cache_bytes"]


@pytest.mark.skipif(not gemm_packs(torch.float32), reason="quantized weights run on csrc/gemm.c, which does not here")
@pytest.mark.parametrize("arch,overrides,quantization,enforce_eager", [
    ("llama", {}, "int8", False),
    ("llama", {}, "int4", True),
    ("qwen2", {"tie_word_embeddings": True}, "int8", True),      # q/k/v biases, the table read from lm_head's rows
    ("qwen2", {"tie_word_embeddings": True}, "int4", False),
], ids=["llama-int8-native_tp", "llama-int4-eager_tp", "qwen2-int8-eager_tp", "qwen2-int4-native_tp"])
def test_quantized_weights_on_two_ranks_give_one_ranks_tokens(checkpoint, arch, overrides, quantization, enforce_eager):
    """Each rank quantizes its shard to the numbers one rank holds (int8: a row-parallel layer's scales are its whole
    rows'; int4: no group straddles two ranks), so two ranks give one rank's tokens and logits, by the C step on
    every rank (native_tp) or op by op (eager_tp). Each pair of the four cases' settings is covered once."""
    path = checkpoint(arch, **overrides)
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=3, prompt_logprobs=1)
    kw = dict(quantization=quantization, enforce_eager=enforce_eager)
    one, two = _run(path, 1, params, **kw), _run(path, 2, params, **kw)
    _assert_same(one, two)
    steps = two[2]["steps"]
    assert steps["eager_tp"] > 0 and (steps.get("native_tp", 0) == 0) == enforce_eager
    assert two[2]["gemm"]["weight_format"] == "gemm"


def test_each_rank_holds_its_part_of_every_weight(checkpoint):
    """The parallel layers cut their shards from the checkpoint (Phi-3's: q/k/v and gate/up fused in one tensor
    each; one KV head, replicated on both ranks; an odd vocabulary, the last rank's rows padded with zeros): joined,
    the two ranks' shards are one rank's weights."""
    path = checkpoint("phi3", num_key_value_heads=1, vocab_size=385)
    cfg = ModelConfig.from_path(path)
    whole, *ranks = (load_model(path, cfg, torch.float32, torch.device("cpu"), 64, tp=tp)
                     for tp in (None, TensorParallel(0, 2, None), TensorParallel(1, 2, None)))
    q = cfg.q_size
    for layer, *shards in zip(whole.model.layers, *(r.model.layers for r in ranks)):
        qkv = [s.self_attn.qkv_proj.weight for s in shards]
        assert torch.equal(torch.cat([w[:q // 2] for w in qkv]), layer.self_attn.qkv_proj.weight[:q])
        for w in qkv:       # the one KV head, k then v, on each rank
            assert torch.equal(w[q // 2:], layer.self_attn.qkv_proj.weight[q:])
        gate_up = [s.mlp.gate_up_proj.weight.chunk(2) for s in shards]
        assert torch.equal(torch.cat([g for g, _ in gate_up] + [u for _, u in gate_up]), layer.mlp.gate_up_proj.weight)
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            parts = [s.get_submodule(name).weight for s in shards]
            assert torch.equal(torch.cat(parts, dim=1), layer.get_submodule(name).weight)
    vocab = cfg.vocab_size
    for name in ("model.embed_tokens", "lm_head"):
        rows = torch.cat([r.get_submodule(name).weight for r in ranks])
        assert torch.equal(rows[:vocab], whole.get_submodule(name).weight) and not rows[vocab:].any()


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8", "int4"])
def test_quantized_pages_prefix_caching_forks_and_preemption(tiny_llama, kv_cache_dtype):
    """Quantized pages (scales sharded with their heads), a prompt reusing a cached prefix, n=3 samples forked
    from one prompt (copy-on-write block copies), and a pool so small that sequences are preempted: as one
    rank. A rank's partial sums round differently, and a number that then quantizes to its neighbour moves a
    logit by more than 1e-4: the sampled tokens' logprobs are compared within 1e-3."""
    batches = [[list(range(8, 60))], [list(range(8, 60)) + [3, 4, 5], list(range(8, 44)) + [9]]]
    params = SamplingParams(max_tokens=24, temperature=0, n=3, logprobs=2)    # (prompt_logprobs: no prefix reuse)
    kw = dict(kv_cache_dtype=kv_cache_dtype, num_kv_blocks=14, block_size=8, max_num_seqs=4)
    one, two = _run(tiny_llama, 1, params, batches, **kw), _run(tiny_llama, 2, params, batches, **kw)
    _assert_same(one, two, tol=1e-3)
    stats = two[2]
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert stats["steps"]["native_tp"] > 0        # the C step on every rank writes and reads the quantized pages


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["kv-heads-split", "kv-head-replicated"])
def test_eviction_policies_choose_as_one_rank(checkpoint, kv_heads):
    """h2o and snapkv score tokens by every KV head's attention mass (gathered to rank 0, a replicated head's
    shares combined), and their compactions and sink's rotations are made on every rank: as one rank."""
    path = checkpoint("llama", num_key_value_heads=kv_heads)
    prompts = [list(range(8, 40)), list(range(40, 70)), list(range(70, 96))]
    policies = ["h2o:budget=16,recent=4", "snapkv:budget=12,window=4", "sink:sinks=4,window=12"]
    params = [SamplingParams(max_tokens=20, temperature=0, logprobs=2, eviction=e) for e in policies]
    kw = dict(block_size=4, num_kv_blocks=96, max_model_len=64)
    one, two = _run(path, 1, params, (prompts,), **kw), _run(path, 2, params, (prompts,), **kw)
    _assert_same(one, two)
    assert two[2]["num_evicted_tokens"] == one[2]["num_evicted_tokens"] > 0


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["native_tp", "eager_tp"])
@pytest.mark.parametrize("model", ["gemma3", "gemma2", "mistral"])
def test_hybrid_cache_two_ranks_give_one_ranks_tokens_and_logits(request, model, enforce_eager):
    """The hybrid cache (a block table per layer group, kv/groups.py) on two ranks: each worker's pool keeps the
    groups' pages as rank 0's, and each step carries every group's slots and block tables (read by the C step on every
    rank where native_tp decodes, op by op otherwise). Prompts and generations well past the window (8), in chunks
    that cut across windows and blocks, batched with shorter ones, one of them under `sink` (its rotations made on
    every rank, its evictions in the full-attention group), one under `snapkv` (scored by the full-attention layers'
    mass, gathered from every rank; compacted on every rank): as one rank."""
    path = request.getfixturevalue(model)
    prompts = [SYSTEM[:n] for n in (40, 17, 33)]
    params = [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, logprobs=2, prompt_logprobs=1,
                             eviction=e) for e in (None, "sink:sinks=2,window=9", "snapkv:budget=18,window=9")]
    kw = dict(block_size=4, num_kv_blocks=96, long_prefill_token_threshold=12, enforce_eager=enforce_eager)
    one, two = _run(path, 1, params, (prompts,), **kw), _run(path, 2, params, (prompts,), **kw)
    _assert_same(one, two)
    stats = two[2]
    assert stats["kv_groups"] and any(g["sliding_window"] == WINDOW for g in stats["kv_groups"])
    assert all(len(c.token_ids) == 30 for o in two[0] for c in o.outputs)
    assert stats["num_evicted_tokens"] == one[2]["num_evicted_tokens"] > 0
    steps = stats["steps"]
    assert steps["eager_tp"] > 0 and (steps.get("native_tp", 0) == 0) == enforce_eager


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_hybrid_cache_prefix_caching_forks_and_preemption(request, kv_cache_dtype):
    """The hybrid cache on two ranks, with a prompt reusing a cached prefix (each group's blocks of it), n=3
    samples forked from one prompt (copy-on-write block copies of every group) and a pool so small that sequences
    are preempted (prompts in chunks of 8, a window's, so that a sequence fits it), in full-precision or quantized
    pages (logprobs within 1e-3, as test_quantized_pages_prefix_caching_forks_and_preemption's): as one rank."""
    batches = [[SYSTEM[:36]], [SYSTEM[:36] + [3, 4, 5], SYSTEM[:28] + [9]]]
    params = SamplingParams(max_tokens=24, temperature=0, n=3, logprobs=2, ignore_eos=True)
    kw = dict(num_kv_blocks=34, block_size=4, max_num_seqs=4, long_prefill_token_threshold=8,
              kv_cache_dtype=kv_cache_dtype)
    path = request.getfixturevalue("gemma3")
    one, two = _run(path, 1, params, batches, **kw), _run(path, 2, params, batches, **kw)
    _assert_same(one, two, tol=1e-3 if kv_cache_dtype == "int8" else 1e-4)
    stats = two[2]
    assert stats["kv_groups"] and stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert stats["steps"]["native_tp"] > 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:       # a zombie is dead too
        return f.read().split(")")[-1].split()[0] != "Z"


def test_a_dead_worker_fails_the_step_and_shutdown_leaves_no_process(tiny_llama):
    """A killed worker fails the next step at once, naming it. Rank 0's collectives wait past the step's bound
    (step_timeout): a rank that hangs is caught by the bound (test_a_hung_worker_...), not by their timeout."""
    llm = LLM(str(tiny_llama), tensor_parallel_size=2, dtype="float32", kv_cache_memory="1MiB", step_timeout=300)
    pids = llm.engine.workers.pids
    try:
        # kv_cache_memory is per rank: kvserve plan's arithmetic gives the same pool
        assert llm.stats()["kv_blocks_total"] == num_blocks(str(tiny_llama), "1MiB", 16, "float32", "auto", 2) \
            == 2 * num_blocks(str(tiny_llama), "1MiB", 16, "float32", "auto", 1)
        assert len(pids) == 1 and _alive(pids[0])
        assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
        assert llm.engine.workers.tp.group.options._timeout.total_seconds() > 300     # gloo's own, rank 0's
        os.kill(pids[0], signal.SIGKILL)
        with pytest.raises(RuntimeError, match="worker rank 1 .* died"):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
    finally:
        llm.shutdown()
    assert not _alive(pids[0])

    llm = LLM(str(tiny_llama), tensor_parallel_size=2, dtype="float32")
    pids = llm.engine.workers.pids
    llm.shutdown()
    assert pids and not any(_alive(p) for p in pids)


def test_a_worker_that_fails_to_start_says_why(tmp_path, tiny_llama):
    """A worker whose shard cannot load reports its error to rank 0, which raises it (no wait for a timeout)."""
    cfg = ModelConfig.from_path(tiny_llama)
    args = WorkerArgs(tmp_path / "missing", cfg, torch.float32, "cpu", 64, "auto", False, "plain")
    workers = Workers(2, args, torch.device("cpu"))
    try:
        with pytest.raises(RuntimeError, match="worker rank 1 failed:(.|\n)*FileNotFoundError"):
            workers.init_cache(KVSpec.from_model(cfg, torch.float32), 4)
    finally:
        workers.close()
    assert not _alive(workers.pids[0])


def test_shapes_that_do_not_split_are_refused(checkpoint, tiny_llama):
    cfg = ModelConfig.from_path(tiny_llama)          # 4 heads, 2 KV heads, intermediate 128
    with pytest.raises(ValueError, match="tensor_parallel_size 3 must divide num_attention_heads"):
        check_tensor_parallel(cfg, 3)
    with pytest.raises(ValueError, match="num_attention_heads"):
        LLM(str(tiny_llama), tensor_parallel_size=3)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        check_tensor_parallel(ModelConfig.from_dict({**_raw(tiny_llama), "num_attention_heads": 12,
                                                     "num_key_value_heads": 3}), 4)
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        EngineConfig(tensor_parallel_size=0)
    # int4's groups of 32 inputs: down_proj's 96 split in 48 per rank would put a group across both ranks
    odd = ModelConfig.from_dict({**_raw(tiny_llama), "intermediate_size": 96})
    with pytest.raises(ValueError, match="quantization 'int4' with tensor_parallel_size 2: .* down_proj's 96 inputs"):
        check_tensor_parallel(odd, 2, "int4")
    check_tensor_parallel(odd, 2, "int8")
    check_tensor_parallel(odd, 1, "int4")
    check_tensor_parallel(cfg, 2, "int4")           # 64 o_proj inputs, 128 down_proj inputs: 32 and 64 a rank
    with pytest.raises(ValueError, match="down_proj's 96 inputs"):     # before any worker starts
        LLM(str(checkpoint("llama", intermediate_size=96)), tensor_parallel_size=2, quantization="int4")


def _raw(path) -> dict:
    return json.loads((path / "config.json").read_text())


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def test_a_steps_bound_is_step_timeout_or_grows_with_the_steps_measured():
    """The default bound: the floor before any step is measured and while steps are quick; then 20 times the
    slowest step, or the slowest time per token times the step's tokens (a prefill larger than any before)."""
    bound = StepBound()
    assert bound.seconds(1) == bound.seconds(100_000) == STEP_TIMEOUT_FLOOR
    bound.observe(0.2, 4)
    assert bound.seconds(4) == STEP_TIMEOUT_FLOOR
    bound.observe(30.0, 1000)                  # 0.05 s a token, the first step's (4 tokens) the slowest
    assert bound.seconds(4) == STEP_TIMEOUT_FACTOR * 30.0
    assert bound.seconds(8192) == STEP_TIMEOUT_FACTOR * 0.05 * 8192
    given = StepBound(step_timeout=3.0)
    given.observe(30.0, 1000)
    assert given.seconds(8192) == 3.0
    with pytest.raises(ValueError, match="step_timeout must be a positive number of seconds"):
        EngineConfig(step_timeout=0)


def test_the_server_with_two_ranks_serves_and_restarts_its_engine_after_a_dead_or_hung_worker(tiny_llama):
    """Rank 0 serves HTTP from the engine process: completions and streams; a killed worker fails its request
    with a 500 naming it, the engine process stops and a new one (with new workers) is started. A worker stopped by
    SIGSTOP neither dies nor answers: the step waiting for it runs past its bound (step_timeout), the workers are
    killed (none is left stopped), the stream in flight ends with an error event naming the bound, /health says 503
    until a new engine is ready, and that one serves. Nothing is left after shutdown."""
    import httpx

    from kvserve.server.app import build_app
    from servers import ENGINE_ARGS, MODEL, ServerThread, wait_for

    app = build_app(EngineConfig(model=str(tiny_llama), tensor_parallel_size=2, step_timeout=3, **ENGINE_ARGS), MODEL)
    server = app.state.async_engine
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}
    with ServerThread(app) as base:
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        with httpx.stream("POST", f"{base}/v1/completions", json={**body, "stream": True}, timeout=60) as s:
            events = [line for line in s.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and len(events) >= 3
        engine, workers = server._core, _children(server._core.pid)
        assert len(workers) == 1
        os.kill(workers[0], signal.SIGKILL)
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
        assert r.status_code == 500 and "worker rank 1" in r.json()["error"]["message"]
        wait_for(lambda: not engine.is_alive() and httpx.get(f"{base}/health").status_code == 200,
                 "a new engine is started")
        assert httpx.post(f"{base}/v1/completions", json=body, timeout=60).status_code == 200

        engine, (worker,) = server._core, _children(server._core.pid)
        os.kill(worker, signal.SIGSTOP)
        with httpx.stream("POST", f"{base}/v1/completions", json={**body, "stream": True}, timeout=60) as s:
            events = [line for line in s.iter_lines() if line.startswith("data: ")]
            health = httpx.get(f"{base}/health")
        assert events[-1] == "data: [DONE]" and len(events) == 2
        error = json.loads(events[0].removeprefix("data: "))["error"]["message"]
        assert "did not end within 3 s (step_timeout)" in error
        assert health.status_code == 503 and "step_timeout" in health.json()["error"]["message"]
        wait_for(lambda: not engine.is_alive() and httpx.get(f"{base}/health").status_code == 200,
                 "a new engine is started")
        assert not _alive(worker)
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        engine, workers = server._core, _children(server._core.pid)
        assert len(workers) == 1
    assert not any(_alive(p) for p in [engine.pid, *workers])


def test_bench_tp_counts_each_steps_collectives(tmp_path):
    """`kvserve bench tp`: two all-reduces per layer and one for the embedding in each TP=2 decode step, none
    at TP=1, and rank 0's time in them reported."""
    from kvserve.cli import main

    out = tmp_path / "tp.json"
    assert main(["bench", "tp", "--quick", "--hidden-size", "64", "--intermediate-size", "128", "--num-layers", "2",
                 "--num-heads", "4", "--num-kv-heads", "2", "--vocab-size", "384", "--batch-sizes", "1,2",
                 "--steps", "1", "--dtype", "float32", "--channel-repeats", "2", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    runs = res["runs"]
    for run, executor in (("tp2", "native_tp"), ("tp2_eager", "eager_tp")):
        assert all(r["executors"] == [executor] for r in runs[run].values())
        assert {r["all_reduces_per_step"] for r in runs[run].values()} == {2 * 2 + 1}
        assert all(measured(r["comm_ms"]) for r in runs[run].values())
    assert all(r["all_reduces_per_step"] == 0 and r["comm_ms"] == 0 for r in runs["tp1"].values())
    # the step message of each batch through every channel, the same bytes each way
    channels = res["channels"]
    assert set(channels) == {"shm", "pipe", "store", "broadcast"}
    for batch in ("1", "2"):
        assert len({c[batch]["bytes"] for c in channels.values()}) == 1
        assert all(c[batch]["delivered_ms"] >= c[batch]["load_ms"] and measured(c[batch]["load_ms"])
                   for c in channels.values())


def test_shm_channel_carries_steps_and_sends_larger_ones_and_exit_through_the_pipe():
    """ShmChannel: each message once, in order, from the buffer; one larger than the buffer from the pipe (the
    header says so); a message in the pipe wakes a reader that waits."""
    import multiprocessing

    from kvserve.parallel.channel import ShmChannel

    ours, theirs = multiprocessing.Pipe()
    writer = ShmChannel(1, capacity=64)
    reader = ShmChannel(1, writer.name)
    try:
        for data in (b"step one", b"x" * 65, b"step three"):
            writer.send(data, [ours], lambda: None)
            assert reader.recv(0, theirs) == data
            assert not theirs.poll(0)                  # nothing left over in the pipe
        ours.send_bytes(b"exit")
        assert reader.recv(0, theirs) == b"exit"
    finally:
        reader.close()
        writer.close(unlink=True)


def test_torchrun_launches_the_ranks(tiny_llama, capsys):
    """`torchrun --nproc-per-node 2 -m kvserve generate ... --tensor-parallel-size 2`: env:// rendezvous, rank 0
    runs the command and rank 1 the worker loop; the same text as one rank, and both processes exit."""
    import subprocess
    import sys
    from pathlib import Path

    from kvserve.cli import main
    from servers import free_port

    command = ["generate", "def fib", "--model", str(tiny_llama), "--dtype", "float32", "--max-tokens", "6"]
    assert main(command) == 0
    expected = capsys.readouterr().out.strip()
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(free_port()), "-m", "kvserve", *command, "--tensor-parallel-size", "2"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == expected
