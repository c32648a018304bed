"""Rank 0's handle on the other ranks of a tensor-parallel engine: N - 1 worker processes (parallel/worker.py), each
running its shard of the model on its shard of the KV pool, steered by rank 0 (the engine's process).

Rank 0 owns the scheduler, the block manager and sampling. For each step it sends every worker what the step's
forward needs (its inputs and the copy-on-write block copies); then all ranks run the forward together, their
collectives meeting (parallel/group.py). What changes a worker's pool or tier outside the forward (an evictor's
compaction, a tier's save or load: ForwardedStorage, parallel/connector.py) is queued and made by every worker
before its next step, in the order rank 0 made it. The steps go through one shared-memory buffer that every worker
reads (parallel/channel.py); everything else, and a step too large for the buffer, through a pipe each. Under
torchrun the launcher's ranks are the workers (parallel/torchrun.py).

A worker that fails says why over its pipe, then exits; a worker that dies closes its connections, which fails
rank 0's next collective at once; a worker that hangs is caught by the step's bound (parallel/watchdog.py), which
kills the workers. In each case rank 0 raises a WorkerFailure naming why (never a hang), and the engine cannot step
again: a server starts a new one. Workers exit when told to, when rank 0's pipe closes, and with the engine's
process (daemons).
"""
from __future__ import annotations

import functools
import logging
import multiprocessing
import time
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import TypeVar

import torch
import torch.distributed as dist

from kvserve.kv import KVSpec, KVStorage
from kvserve.kv.groups import LayerGroup
from kvserve.parallel.channel import POLL, ShmChannel, StoreConnection, dumps, loads
from kvserve.parallel.group import COLLECTIVE_TIMEOUT, TensorParallel, init_group
from kvserve.parallel.torchrun import TorchrunRank, torchrun_env, torchrun_store
from kvserve.parallel.watchdog import StepBound, StepWatchdog
from kvserve.parallel.worker import OpsMessage, StepMessage, WorkerArgs, worker_main

log = logging.getLogger(__name__)
START_TIMEOUT = 600.0        # seconds a worker may take to load its shard
CALL_TIMEOUT = 600.0         # seconds a worker may take to answer a call (a tier's reads or last writes: disk I/O)
T = TypeVar("T")


class WorkerFailure(RuntimeError):
    """A worker died, failed or hung, or a step's collective failed: the engine cannot step again (a server starts a
    new one)."""


class ForwardedStorage:
    """Rank 0's KV storage as its evictor sees it: each change (a compaction's rewrite, a sink's rotation) is
    made here and queued for the workers, which make it to their heads' pages before their next step."""

    def __init__(self, storage: KVStorage, workers: Workers):
        self.storage, self.workers = storage, workers

    @property
    def device(self) -> torch.device:
        return self.storage.device

    def rewrite(self, old_table: list[int], keep: torch.Tensor, new_table: list[int]) -> None:
        """KVStorage.rewrite, here and on every worker."""
        self.workers.queue("storage", "rewrite", (list(old_table), keep.cpu(), list(new_table)))
        self.storage.rewrite(old_table, keep, new_table)

    def rotate_keys(self, src: list[int], dst: list[int], rotate) -> None:
        """KVStorage.rotate_keys, here and on every worker (`rotate` is sent: a picklable callable)."""
        self.workers.queue("storage", "rotate_keys", (list(src), list(dst), rotate))
        self.storage.rotate_keys(src, dst, rotate)


class Workers:
    """Rank 0's handle on the worker processes: start them, run steps with them, see that they live, stop them."""

    def __init__(self, size: int, args: WorkerArgs, device: torch.device, step_timeout: float | None = None):
        """Start ranks 1..size-1 (spawned, or torchrun's: torchrun_env) and join the group with them (`tp`, rank
        0's). The workers then load their shards while rank 0 loads its own: init_cache before the first step.
        step_timeout: the bound of a step in seconds (None: derived from the steps measured, StepBound)."""
        self.size, self.device = size, device
        launched = torchrun_env()
        # the steps: through shared memory to the workers this process spawns where the CPU keeps stores in order
        # (ShmChannel), else the pipes; torchrun's ranks may be on other machines, which it cannot reach: their
        # steps go through the store as the rest does
        self.channel: ShmChannel | None = None
        if launched is not None:
            store = torchrun_store(*launched[1:], size)
            store.set("args", dumps(args))
            self.procs = [TorchrunRank(rank) for rank in range(1, size)]
            self.conns = [StoreConnection(store, rank, 0) for rank in range(1, size)]
        else:
            store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, timeout=COLLECTIVE_TIMEOUT,
                                  wait_for_workers=False)
            if ShmChannel.ordered():
                self.channel = ShmChannel(size - 1)
            self.procs, self.conns = self._spawn(size, args, store.port, self.channel and self.channel.name)
        self.bound = StepBound(step_timeout)
        self.watchdog = StepWatchdog(functools.partial(_kill, self.procs))
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.conns, self.channel, self.watchdog)
        self._ops: list[tuple[str, str, tuple]] = []          # (target, method, args): queue
        self._at_close: list[Callable[[], None]] = []
        self.failed: WorkerFailure | None = None             # why a step failed: the ranks are out of step since
        try:
            self._expect("started", START_TIMEOUT)    # before rank 0 waits in the group for them
            self.tp: TensorParallel = init_group(0, size, "", 0, device, store)
        except BaseException:
            self.close()
            raise
        self._store = store

    @staticmethod
    def _spawn(size: int, args: WorkerArgs, port: int, channel: str | None) -> tuple[list, list[Connection]]:
        ctx = multiprocessing.get_context("spawn")
        procs, conns = [], []
        for rank in range(1, size):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(rank, size, ("127.0.0.1", port), args, theirs, channel),
                               name=f"kvserve-tp-rank{rank}", daemon=True)
            proc.start()
            theirs.close()
            procs.append(proc)
            conns.append(ours)
        return procs, conns

    def init_cache(self, spec: KVSpec, num_blocks: int | None, layer_groups: list[LayerGroup] | None = None) -> None:
        """Have every worker build its KV pool: `spec` is the shard's (its KV heads; every layer's, as KVStorage
        takes it), num_blocks rank 0's (None: no cache), layer_groups those of rank 0's cache (None: one group of
        every layer), each layer reading the pages of its place in its group as on rank 0. Returns once all are
        ready to run steps (whose batches carry each group's slots and block tables), having made the changes queued
        so far (a tier to open: parallel/connector.py)."""
        ops, self._ops = self._ops, []
        for conn in self.conns:
            conn.send_bytes(dumps(("cache", spec, num_blocks, layer_groups, ops)))
        self._expect("ready", START_TIMEOUT)

    def _expect(self, what: str, timeout: float) -> list:
        """Wait for every worker's `what`; what each said with it, in rank order. WorkerFailure at once if one fails or
        dies first."""
        deadline = time.monotonic() + timeout
        details = []
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), 1):
            while not conn.poll(POLL):
                self._check(rank, proc)
                if time.monotonic() > deadline:
                    raise WorkerFailure(f"tensor parallel worker rank {rank} did not get {what} in {timeout:.0f} s")
            reply, detail = self._recv(rank, proc, conn)
            if reply != what:
                raise WorkerFailure(f"tensor parallel worker rank {rank}: expected {what!r}, got {reply!r}")
            details.append(detail)
        return details

    def _recv(self, rank: int, proc, conn: Connection) -> tuple[str, object]:
        try:
            kind, detail = loads(conn.recv_bytes(), torch.device("cpu"))
        except (EOFError, OSError):
            proc.join(1.0)
            raise WorkerFailure(f"tensor parallel worker rank {rank} (pid {proc.pid}) died "
                               f"(exit code {proc.exitcode})") from None
        if kind == "error":
            raise WorkerFailure(f"tensor parallel worker rank {rank} failed:\n{detail}")
        return kind, detail

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

    def queue(self, target: str, method: str, args: tuple) -> None:
        """A change for the workers to make before their next step, after those queued before it: `method` of their
        `target`, "storage" (their KVStorage: ForwardedStorage) or "connector" (their tier: parallel/connector.py)."""
        self._ops.append((target, method, args))

    def send_ops(self) -> None:
        """Send the changes queued so far now, rather than with the next step (one that waits for them)."""
        if self._ops:
            self._send(OpsMessage(self._flush_ops()))

    def call(self, target: str, method: str, args: tuple) -> list:
        """Run `method` of every worker's `target` (after the changes queued so far), and return what each returned, in
        rank order. WorkerFailure if a worker dies, fails, or does not answer within a step's bound."""
        self.queue(target, method, args)
        self._send(OpsMessage(self._flush_ops(), reply=True))
        return self._expect("result", CALL_TIMEOUT)

    def at_close(self, release: Callable[[], None]) -> None:
        """Have close call `release` first, while the workers live (a tier's last writes are theirs too)."""
        self._at_close.append(release)

    def _flush_ops(self) -> list[tuple[str, str, tuple]]:
        ops, self._ops = self._ops, []
        return ops

    def run_step(self, block_copies: list[tuple[int, int]], inputs, native: bool, run: Callable[[], T]) -> T:
        """Send a step to every worker (they run it as soon as it arrives: by the C decode step where `native`, else
        op by op), then run rank 0's part of it, `run`, and return what it returns. The step must end within its
        bound (StepBound: step_timeout, else derived from the steps measured): past it the ranks are taken to hang
        and killed. A step that fails after it was sent leaves the ranks out of step: it raises a WorkerFailure
        saying why (a worker that hung, died or failed, else rank 0's error)."""
        num_tokens = len(inputs.input_ids)
        bound = self.bound.seconds(num_tokens)
        self.tp.wait_at_least(bound + COLLECTIVE_TIMEOUT.total_seconds())   # the bound, not a collective, says hung
        start = time.monotonic()
        self.watchdog.arm(bound)
        try:
            self._send_step(block_copies, inputs, native)
            out = run()
        except Exception as e:          # any: the workers began the step, so the ranks are out of step
            self.failed = cause = self._failure(e)
            if cause is e:
                raise
            raise cause from e
        finally:
            self.watchdog.disarm()
        if self.watchdog.hung_after is not None:       # its bound passed as the step ended: the workers are killed
            self.failed = self._failure(None)
            raise self.failed
        self.bound.observe(time.monotonic() - start, num_tokens)
        return out

    def _send_step(self, block_copies: list[tuple[int, int]], inputs, native: bool) -> None:
        self._send(StepMessage(block_copies, inputs, self._flush_ops(), native))

    def _send(self, msg: StepMessage | OpsMessage) -> None:
        if self.failed is not None:      # a worker may still wait in that step's collectives: it takes nothing more
            raise WorkerFailure(f"the tensor parallel ranks are out of step since a step failed: {self.failed}")
        self.check_alive()
        data = dumps(msg)
        if self.channel is not None:
            self.channel.send(data, self.conns, self.check_alive)
            return
        for conn in self.conns:
            conn.send_bytes(data)

    def _failure(self, error: BaseException | None) -> WorkerFailure:
        """Why a step failed (`error`, rank 0's; None where it did not fail but ran past its bound): the bound passed
        (the workers killed), else a worker that died or failed (given a moment to exit: a collective fails when a
        rank dies), else rank 0's error itself."""
        hung_after = self.watchdog.hung_after
        if hung_after is not None:
            killed = [pid for pid in self.pids if pid is not None]       # (not torchrun's: torchrun stops them)
            return WorkerFailure(f"a tensor parallel step did not end within {hung_after:.0f} s (step_timeout): a "
                                 f"rank hung" + (f"; the workers (pids {killed}) were killed" if killed else ""))
        if isinstance(error, WorkerFailure):
            return error
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            try:
                self.check_alive()
            except WorkerFailure as e:
                return e
            time.sleep(POLL)
        return WorkerFailure(f"a tensor parallel step failed on rank 0, leaving the ranks out of step: "
                             f"{type(error).__name__}: {error}")

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def close(self) -> None:
        """Stop the workers: asked first, then terminated, then killed; no process is left. What at_close was given
        runs first."""
        while self._at_close:
            self._at_close.pop()()
        self._finalizer()


def _kill(procs: list) -> None:
    """The watchdog's act on a hung step: kill every worker (SIGKILL ends a stopped process too), which closes
    their connections and so fails rank 0's waits at once. torchrun's ranks are not this process's to kill: rank 0's
    collectives then fail by their timeout (Workers.run_step)."""
    log.error("a tensor parallel step ran past its bound: killing the workers (pids %s)", [p.pid for p in procs])
    for proc in procs:
        proc.kill()


def _stop(procs: list, conns: list[Connection], channel: ShmChannel | None, watchdog: StepWatchdog) -> None:
    watchdog.close()
    for conn in conns:
        try:
            conn.send_bytes(dumps(("exit",)))
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
    if channel is not None:
        channel.close(unlink=True)
