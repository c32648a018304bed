"""The other ranks of a tensor-parallel engine: N - 1 spawned worker processes, each running its shard of
the model on its shard of the KV pool, steered by rank 0 (the engine's process) through one pipe each.

Rank 0 owns the scheduler, the block manager and sampling. For each step it sends every worker what the
step's forward needs (its inputs, the copy-on-write block copies, and for a quantized pool the blocks
being filled); then all ranks run the forward together, their collectives meeting (kvserve.distributed).
A message is torch.save'd, so that a worker on another CUDA device loads the tensors onto its own.

A worker that fails says why over its pipe, then exits; a worker that dies closes its connections, which
fails rank 0's next collective at once: either way rank 0 raises a WorkerFailure naming the rank (never a
hang). Workers exit when told to, when rank 0's pipe closes, and with the engine's process (daemons).
"""
from __future__ import annotations

import io
import logging
import multiprocessing
import os
import time
import traceback
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import torch
import torch.distributed as dist

from kvserve.config import ModelConfig
from kvserve.distributed import COLLECTIVE_TIMEOUT, TensorParallel, init_group, pin_cpu_threads
from kvserve.kv import KVSpec, KVStorage, NoKVStorage

log = logging.getLogger(__name__)
START_TIMEOUT = 600.0        # seconds a worker may take to load its shard
_POLL = 0.05


class WorkerFailure(RuntimeError):
    """A worker died or failed: the engine cannot step again (a server starts a new one)."""


@dataclass
class WorkerArgs:
    """What a worker builds its shard from: the same model, dtype and attention backend as rank 0."""

    model_path: Path
    model_config: ModelConfig
    dtype: torch.dtype
    device: str
    max_model_len: int
    attention_backend: str
    cpu_allocator_tuning: bool


@dataclass
class StepMessage:
    """One step, as a worker runs it."""

    block_copies: list[tuple[int, int]]
    inputs: object                                   # executor.StepInputs
    residuals: dict[int, tuple[int, list[int]]] | None   # quantized pool: block -> (its list's id on rank 0, blocks)


def _dumps(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(data: bytes, device: torch.device):
    return torch.load(io.BytesIO(data), map_location=device, weights_only=False)


class Workers:
    """Rank 0's handle on the worker processes: start them, send them steps, see that they live, stop them."""

    def __init__(self, size: int, args: WorkerArgs, device: torch.device):
        """Spawn ranks 1..size-1 and join the group with them (`tp`, rank 0's). The workers then load their
        shards while rank 0 loads its own: wait_ready before the first step."""
        self.size, self.device = size, device
        host = "127.0.0.1"
        store = dist.TCPStore(host, 0, size, is_master=True, timeout=COLLECTIVE_TIMEOUT, wait_for_workers=False)
        ctx = multiprocessing.get_context("spawn")
        self.procs, self.conns = [], []
        for rank in range(1, size):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(rank, size, host, store.port, args, theirs),
                               name=f"kvserve-tp-rank{rank}", daemon=True)
            proc.start()
            theirs.close()
            self.procs.append(proc)
            self.conns.append(ours)
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.conns)
        try:
            self._expect("started", START_TIMEOUT)    # before rank 0 waits in the group for them
            self.tp: TensorParallel = init_group(0, size, host, store.port, device, store)
        except BaseException:
            self.close()
            raise
        self._store = store
        self.residuals: dict[int, list[int]] | None = None

    def init_cache(self, spec: KVSpec, num_blocks: int | None, residuals: dict[int, list[int]] | None) -> None:
        """Have every worker build its KV pool: `spec` is the shard's (its KV heads), num_blocks rank 0's (None:
        no cache); `residuals`, the cache manager's blocks being filled, go with each step to a quantized pool.
        Returns once all are ready to run steps."""
        self.residuals = residuals if spec.quantized_layers else None
        for conn in self.conns:
            conn.send_bytes(_dumps(("cache", spec, num_blocks)))
        self._expect("ready", START_TIMEOUT)

    def _expect(self, what: str, timeout: float) -> None:
        """Wait for every worker's `what`; WorkerFailure at once if one fails or dies first."""
        deadline = time.monotonic() + timeout
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), 1):
            while not conn.poll(_POLL):
                self._check(rank, proc)
                if time.monotonic() > deadline:
                    raise WorkerFailure(f"tensor parallel worker rank {rank} did not get {what} in {timeout:.0f} s")
            reply = self._recv(rank, proc, conn)
            if reply != what:
                raise WorkerFailure(f"tensor parallel worker rank {rank}: expected {what!r}, got {reply!r}")

    def _recv(self, rank: int, proc, conn: Connection):
        try:
            kind, detail = _loads(conn.recv_bytes(), torch.device("cpu"))
        except (EOFError, OSError):
            proc.join(1.0)
            raise WorkerFailure(f"tensor parallel worker rank {rank} (pid {proc.pid}) died "
                               f"(exit code {proc.exitcode})") from None
        if kind == "error":
            raise WorkerFailure(f"tensor parallel worker rank {rank} failed:\n{detail}")
        return kind

    def _check(self, rank: int, proc) -> None:
        if not proc.is_alive():
            conn = self.conns[rank - 1]
            if conn.poll(0):
                self._recv(rank, proc, conn)          # its own account of why
            raise WorkerFailure(f"tensor parallel worker rank {rank} (pid {proc.pid}) died "
                               f"(exit code {proc.exitcode})")

    def check_alive(self) -> None:
        """WorkerFailure naming the first worker that is dead or has reported a failure."""
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), 1):
            self._check(rank, proc)
            if conn.poll(0):
                self._recv(rank, proc, conn)

    def send_step(self, block_copies: list[tuple[int, int]], inputs) -> None:
        """Send a step to every worker (after check_alive): they run it as soon as it arrives."""
        self.check_alive()
        residuals = None
        if self.residuals is not None:
            # the lists' identities on rank 0 too: the pool re-zeroes a block's pages when its list is new
            residuals = {b: (id(blocks), blocks) for b, blocks in self.residuals.items()}
        data = _dumps(StepMessage(block_copies, inputs, residuals))
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), 1):
            try:
                conn.send_bytes(data)
            except OSError:
                self._check(rank, proc)
                raise

    def failure(self, error: BaseException) -> WorkerFailure | None:
        """Why a step failed on rank 0 if a worker is to blame (a collective fails when a rank dies), after
        giving a dying worker a moment to exit; None if every worker lives."""
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            try:
                self.check_alive()
            except WorkerFailure as e:
                return e
            time.sleep(_POLL)
        return None

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def close(self) -> None:
        """Stop the workers: asked first, then terminated, then killed; no process is left."""
        self._finalizer()


def _stop(procs: list, conns: list[Connection]) -> None:
    for conn in conns:
        try:
            conn.send_bytes(_dumps(("exit",)))
        except OSError:
            pass
    for proc in procs:
        proc.join(5.0)
        if proc.is_alive():
            proc.terminate()
            proc.join(2.0)
        if proc.is_alive():
            proc.kill()
            proc.join()
    for conn in conns:
        conn.close()


# ---- the worker process ---------------------------------------------------------------------------


def worker_main(rank: int, size: int, host: str, port: int, args: WorkerArgs, conn: Connection) -> None:
    """A worker's process: join the group, load the shard, build the pool when told, then run steps until told
    to stop or rank 0 goes away. A failure is reported over the pipe before the process exits."""
    try:
        _serve(rank, size, host, port, args, conn)
    except (EOFError, KeyboardInterrupt):
        pass                                       # rank 0 is gone
    except BaseException:  # noqa: BLE001  (told to rank 0, which raises it)
        try:
            conn.send_bytes(_dumps(("error", traceback.format_exc())))
        except OSError:
            pass
        os._exit(1)


def _serve(rank: int, size: int, host: str, port: int, args: WorkerArgs, conn: Connection) -> None:
    from kvserve.attention import get_backend
    from kvserve.engine.cpu_memory import reuse_freed_memory
    from kvserve.kernels import library
    from kvserve.model.loader import load_model

    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    else:
        pin_cpu_threads(rank, size)
        if args.cpu_allocator_tuning:
            reuse_freed_memory()
        library()
    conn.send_bytes(_dumps(("started", None)))
    tp = init_group(rank, size, host, port, device)
    model = load_model(args.model_path, args.model_config, args.dtype, device, args.max_model_len, tp=tp)
    backend = get_backend(args.attention_backend, device)
    kind, spec, num_blocks = _loads(conn.recv_bytes(), device)
    residuals: dict[int, list[int]] = {}
    storage = NoKVStorage(spec.num_layers) if num_blocks is None else KVStorage(spec, num_blocks, device, residuals)
    conn.send_bytes(_dumps(("ready", None)))
    lists: dict[int, list[int]] = {}               # rank 0's residual lists by their id there -> ours
    while True:
        msg = _loads(conn.recv_bytes(), device)
        if not isinstance(msg, StepMessage):
            return                                 # ("exit",)
        if msg.residuals is not None:
            lists = _sync_residuals(residuals, msg.residuals, lists)
        _run_step(model, backend, storage, msg)


def _sync_residuals(residuals: dict[int, list[int]], sent: dict[int, tuple[int, list[int]]],
                    lists: dict[int, list[int]]) -> dict[int, list[int]]:
    """Make `residuals` (the pool's view of the blocks being filled) rank 0's: the same blocks, and a list
    object that is new where rank 0's is new (the pool compares them by identity)."""
    mine = {}
    for block, (ident, blocks) in sent.items():
        old = lists.get(ident)
        mine[ident] = old if old == blocks else list(blocks)
    residuals.clear()
    residuals.update({block: mine[ident] for block, (ident, _) in sent.items()})
    return mine


@torch.inference_mode()
def _run_step(model, backend, storage: KVStorage | NoKVStorage, msg: StepMessage) -> None:
    """Rank 0's step on this rank's shard: the same block copies and writes, the same forward (its collectives
    meet rank 0's), and this rank's vocabulary shard of the logits gathered to rank 0."""
    inputs = msg.inputs
    storage.copy_blocks(msg.block_copies)
    if isinstance(storage, KVStorage) and storage.quantized:
        inputs.batch.kv_write = storage.plan_writes(*inputs.kv_writes)
    model.ensure_rope(int(inputs.positions.max()) + 1)
    hidden = model(inputs.input_ids, inputs.positions, inputs.batch, backend, storage)
    model.compute_logits(hidden[torch.cat((inputs.logits_indices, inputs.prompt_indices))])
