"""Tensor parallelism: a decode step's time at TP=1 and TP=2, split into compute and communication.

Each row is a batch of greedy decodes on a random-weight model shaped like a real one (by default
TinyLlama's: hidden 2048, 22 layers, 32 heads, 4 KV heads). TP=1 and TP=2 each run twice: by their
default executor (on the CPU the native C step; at TP=2 on every rank, native_tp, with the all-reduces
between its layers' halves) and op by op (enforce_eager: eager, and at TP=2 eager_tp); TP=2's two engines
live together and take turns, a step each, so that the load of a shared machine moves both alike. Rank 0
times its collectives (kvserve.parallel.group.TensorParallel.comm_seconds): that time includes waiting
for the slower rank, so it is an upper bound of the pure communication. Two ranks sharing a few CPU
cores are not faster than one; docs/performance.md projects what the all-reduce count costs on GPUs.

Then the ways rank 0's step messages can reach a worker, each carrying the same bytes (the last decode
step's message of each batch size, as TP=2 sent it) to one spawned process, in turns: the engine's
shared-memory buffer (parallel.channel.ShmChannel), a pipe (the other messages' way), torchrun's TCPStore (its
ranks' way) and a torch.distributed broadcast over gloo (its length, then its bytes). Each message leaves
after a pause of a step's sampling and scheduling, and its time is from rank 0's send to the worker holding
the loaded message (one clock: both processes are on this machine).
"""
from __future__ import annotations

import argparse
import datetime
import multiprocessing
import statistics
import struct
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from kvserve.arg_utils import write_json
from kvserve.bench.common import (add_model_args, describe_shape, make_checkpoint, model_shape, print_table,
                                  random_prompts)
from kvserve.llm import LLM
from kvserve.parallel.channel import ShmChannel, StoreConnection, loads
from kvserve.parallel.group import pin_cpu_threads
from kvserve.sampling import SamplingParams

NAME = "tp"
# TinyLlama-1.1B's shape
SHAPE = {"hidden_size": 2048, "intermediate_size": 5632, "num_layers": 22, "num_heads": 32, "num_kv_heads": 4,
         "vocab_size": 32000}
# (name, ranks, enforce_eager) of the engines measured together
RUNS = ((("tp1", 1, False),), (("tp1_eager", 1, True),), (("tp2", 2, False), ("tp2_eager", 2, True)))
CHANNELS = ("shm", "pipe", "store", "broadcast")
STEP_GAP = 1e-3          # seconds between two messages: rank 0 sampling and scheduling the next step


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-sizes", default="1,64", help="comma-separated decode batch sizes")
    p.add_argument("--steps", type=int, default=None, help="decode steps timed per batch (default 8; quick: 5)")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--channel-repeats", type=int, default=None,
                   help="step messages timed per channel and batch size (default 100; quick: 20)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    add_model_args(p, SHAPE)


def measure(llms: dict[str, LLM], prompts: list[list[int]], steps: int, sent: list[bytes] | None = None) -> dict:
    """Per engine (by name), the median decode step of the batch (after its prefill and one warm-up step), the
    executors that ran the steps timed, and rank 0's collectives per step (none at TP=1). The engines take turns,
    a step each, so that the machine's load moves them alike. With `sent` (a TP run's messages), the last one."""
    params = SamplingParams(max_tokens=steps + 2, temperature=0, ignore_eos=True)
    for llm in llms.values():
        for i, prompt in enumerate(prompts):
            llm.engine.add_request(f"tp{i}", {"prompt_token_ids": prompt}, params)
        llm.engine.step()                          # the prompts
        llm.engine.step()                          # warm-up
    before = {name: dict(llm.engine.runner.steps) for name, llm in llms.items()}
    times, comm, reduces = ({name: [] for name in llms} for _ in range(3))
    for _ in range(steps):
        for name, llm in llms.items():
            tp = llm.engine.model.tp
            c0, n0 = (tp.comm_seconds, tp.num_all_reduces) if tp else (0.0, 0)
            start = time.perf_counter()
            llm.engine.step()
            times[name].append(time.perf_counter() - start)
            comm[name].append(tp.comm_seconds - c0 if tp else 0.0)
            reduces[name].append(tp.num_all_reduces - n0 if tp else 0)
    out = {}
    for name, llm in llms.items():
        engine = llm.engine
        ran = sorted(e for e, n in engine.runner.steps.items() if n > before[name].get(e, 0))
        while engine.has_unfinished_requests():
            engine.step()
        step, comm_s = statistics.median(times[name]), statistics.median(comm[name])
        out[name] = {"executors": ran, "step_ms": step * 1e3, "comm_ms": comm_s * 1e3,
                     "compute_ms": (step - comm_s) * 1e3, "all_reduces_per_step": reduces[name][0],
                     "comm_share": comm_s / step}
    if sent:
        out[next(iter(llms))]["message"] = sent[-1]      # (taken out before the JSON is written)
    return out


def _recording(channel: ShmChannel, sent: list[bytes]) -> None:
    """Keep a copy of each message the engine's channel sends in `sent`."""
    send = channel.send

    def record(data: bytes, *args) -> None:
        sent.append(data)
        send(data, *args)

    channel.send = record


class _Broadcast:
    """A message as a torch.distributed broadcast from rank 0: its length, then its bytes."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.opts = dist.BroadcastOptions()
        self.opts.rootRank = 0

    def send(self, data: bytes) -> None:
        self.group.broadcast([torch.tensor([len(data)])], self.opts).wait()
        self.group.broadcast([torch.frombuffer(bytearray(data), dtype=torch.uint8)], self.opts).wait()

    def recv(self) -> bytes:
        length = torch.empty(1, dtype=torch.int64)
        self.group.broadcast([length], self.opts).wait()
        data = torch.empty(int(length), dtype=torch.uint8)
        self.group.broadcast([data], self.opts).wait()
        return data.numpy().tobytes()


def _channels(rank: int, port: int, shm: ShmChannel, conn) -> tuple[dict, dist.Store]:
    """Each channel's send (rank 0) or recv (rank 1) of a pair whose store rank 0 serves at `port`."""
    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timeout, wait_for_workers=False)
    group = dist.ProcessGroupGloo(store, rank, 2, timeout)
    broadcast, by_store = _Broadcast(group), StoreConnection(dist.PrefixStore("bench", store), 1, rank)
    if rank == 0:
        return {"shm": lambda data: shm.send(data, [conn], lambda: None), "pipe": conn.send_bytes,
                "store": by_store.send_bytes, "broadcast": broadcast.send}, store
    return {"shm": lambda: shm.recv(0, conn), "pipe": conn.recv_bytes, "store": by_store.recv_bytes,
            "broadcast": broadcast.recv}, store


def _channel_reader(port: int, conn, rounds: list[tuple[str, int]]) -> None:
    """The bench's rank 1: each round's message from its channel, loaded; then, over the pipe, the seconds from
    each send (the message's first 8 bytes) to the load's end, and the load's own."""
    pin_cpu_threads(1, 2)
    recv, _store = _channels(1, port, ShmChannel(1, conn.recv()), conn)
    delays, load_s = [], []
    for channel, _ in rounds:
        data = recv[channel]()
        start = time.perf_counter()
        loads(data[8:], torch.device("cpu"))
        end = time.perf_counter()           # one end: the load is part of the delay (one clock for both ranks)
        delays.append(end - struct.unpack_from("d", data)[0])
        load_s.append(end - start)
        conn.send(None)
    conn.send((delays, load_s))


def measure_channels(messages: dict[int, bytes], repeats: int) -> dict:
    """Per channel and batch size, the median of `repeats` messages: rank 0's time in its send, the time to the
    worker holding the loaded message, and the load's (torch.load, the same on every channel); the channels take
    turns."""
    rounds = [(c, b) for _ in range(repeats) for b in messages for c in CHANNELS]
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    port = store.port
    del store                         # (a free port for the pair's store)
    proc = ctx.Process(target=_channel_reader, args=(port, theirs, rounds), daemon=True)
    proc.start()
    threads = torch.get_num_threads()
    pin_cpu_threads(0, 2)
    shm = ShmChannel(1)
    try:
        ours.send(shm.name)
        send, _store = _channels(0, port, shm, ours)
        sends = []
        for channel, batch in rounds:
            time.sleep(STEP_GAP)
            start = time.perf_counter()
            send[channel](struct.pack("d", start) + messages[batch])
            sends.append(time.perf_counter() - start)
            ours.recv()
        delays, loads = ours.recv()
    finally:
        shm.close(unlink=True)
        proc.join(10)
        if proc.is_alive():
            proc.kill()
        torch.set_num_threads(threads)
    out: dict = {c: {} for c in CHANNELS}
    for c in CHANNELS:
        for b, data in messages.items():
            mine = [i for i, r in enumerate(rounds) if r == (c, b)]
            out[c][str(b)] = {"bytes": len(data), "send_ms": statistics.median(sends[i] for i in mine) * 1e3,
                              "delivered_ms": statistics.median(delays[i] for i in mine) * 1e3,
                              "load_ms": statistics.median(loads[i] for i in mine) * 1e3}
    return out


def run(args: argparse.Namespace) -> int:
    steps = args.steps or (5 if args.quick else 8)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    shape = model_shape(args)
    if args.quick:
        shape["num_layers"] = min(shape["num_layers"], 4)
    print(f"tp: decode steps at batch {', '.join(map(str, batches))}, {args.dtype}, {describe_shape(shape)}")
    res: dict = {"model": shape, "dtype": args.dtype, "steps": steps, "runs": {}}
    with tempfile.TemporaryDirectory(prefix="kvserve-bench-") as tmp:
        path = make_checkpoint(Path(tmp), shape, args.prompt_len + steps + 8)
        # TP=1's runs one after the other (an engine of two ranks takes this process's torch threads down to its
        # share while it lives); TP=2's two engines together, taking turns
        for group in RUNS:
            llms: dict[str, LLM] = {}
            sent: list[bytes] = []
            try:
                for name, size, eager in group:
                    # one decode step a call (num_scheduler_steps=1): a step's time is one token's
                    llms[name] = LLM(str(path), dtype=args.dtype, device=args.device, tensor_parallel_size=size,
                                     enforce_eager=eager, max_num_seqs=max(batches), enable_prefix_caching=False,
                                     num_scheduler_steps=1, skip_tokenizer_init=True,
                                     num_kv_blocks=max(batches) * -(-(args.prompt_len + steps + 8) // 16))
                if "tp2" in llms:                   # its step messages, for the channels to carry
                    _recording(llms["tp2"].engine.workers.channel, sent)
                for b in batches:
                    prompts = random_prompts(b, args.prompt_len, shape["vocab_size"], b)
                    for name, r in measure(llms, prompts, steps, sent).items():
                        res["runs"].setdefault(name, {})[str(b)] = r
            finally:
                for llm in llms.values():
                    llm.shutdown()
    messages = {b: res["runs"]["tp2"][str(b)].pop("message") for b in batches}
    res["channels"] = measure_channels(messages, args.channel_repeats or (20 if args.quick else 100))
    rows = [[name, ",".join(r["executors"]), str(b), f"{r['step_ms']:.1f}", f"{r['compute_ms']:.1f}",
             f"{r['comm_ms']:.1f}", f"{r['comm_share']:.0%}", str(r["all_reduces_per_step"])]
            for name, by_batch in res["runs"].items() for b, r in ((int(k), v) for k, v in by_batch.items())]
    print_table(["run", "executor", "batch", "step ms", "compute ms", "collectives ms", "share", "all-reduces/step"],
                rows)
    print("\nrank 0's step message to a worker (medians):")
    rows = [[c, b, f"{r['bytes'] / 1024:.1f}", f"{r['send_ms']:.3f}", f"{r['delivered_ms']:.3f}",
             f"{r['load_ms']:.3f}"] for c, by_batch in res["channels"].items() for b, r in by_batch.items()]
    print_table(["channel", "batch", "KiB", "send ms", "delivered ms", "of which load ms"], rows)
    write_json(args.json_path, res)
    return 0
