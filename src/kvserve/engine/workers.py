"""The other ranks of a tensor-parallel engine: N - 1 spawned worker processes, each running its shard of
the model on its shard of the KV pool, steered by rank 0 (the engine's process) through one pipe each.

Rank 0 owns the scheduler, the block manager and sampling. For each step it sends every worker what the
step's forward needs (its inputs and the copy-on-write block copies); then all ranks run the forward
together, their collectives meeting (kvserve.distributed). A message is torch.save'd, so that a worker on
another CUDA device loads the tensors onto its own. The steps go through one shared-memory buffer that every
worker reads (ShmChannel: `kvserve bench tp` measures it against the pipes and a torch.distributed broadcast);
everything else, and a step too large for the buffer, through the pipes.

A worker that fails says why over its pipe, then exits; a worker that dies closes its connections, which
fails rank 0's next collective at once: either way rank 0 raises a WorkerFailure naming the rank (never a
hang). Workers exit when told to, when rank 0's pipe closes, and with the engine's process (daemons).

Under torchrun (env:// rendezvous: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) nothing is spawned: the
launcher's ranks 1..N-1 run `kvserve` too and become the workers (torchrun_worker), rank 0 is the
engine, and their messages go through torchrun's TCPStore (StoreConnection) instead of pipes. A dead
rank is then seen by the collective it fails, and torchrun stops the others.
"""
from __future__ import annotations

import io
import logging
import multiprocessing
import os
import platform
import struct
import time
import traceback
import weakref
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path

import torch
import torch.distributed as dist

from kvserve.config import ModelConfig
from kvserve.distributed import COLLECTIVE_TIMEOUT, TensorParallel, init_group, pin_cpu_threads
from kvserve.kv import KVSpec, KVStorage, NoKVStorage
from kvserve.kv.groups import LayerGroup

log = logging.getLogger(__name__)
START_TIMEOUT = 600.0        # seconds a worker may take to load its shard
_POLL = 0.05
STEP_BUFFER_BYTES = 4 << 20  # ShmChannel's buffer: a step's inputs at hundreds of sequences fit
# a reader spins this long for the next step (the gap between two steps, rank 0 sampling and scheduling),
# then sleeps in waits that double up to _POLL (an idle engine), watching its pipe
SPIN_SECONDS = 0.005


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
    weight_format: str                  # rank 0's GEMM choice (model/gemm_choice.py)
    # rank 0's layers' rows from which csrc/gemm.c runs AMX (GemmChoice.amx_from)
    amx_from: dict[str, int] = field(default_factory=dict)
    native: bool = False                # the C decode step runs the steps rank 0 marks native (native_tp)


@dataclass
class StepMessage:
    """One step, as a worker runs it: first the changes rank 0's evictor made to the pool since the last step,
    then the step's block copies and forward."""

    block_copies: list[tuple[int, int]]
    inputs: object                                   # executor.StepInputs (a hybrid cache: every group's tables)
    storage_ops: list[tuple[str, tuple]]             # (KVStorage method, its arguments)
    native: bool = False                             # run by the C decode step (executor native_tp), else eager


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
        self.workers.queue("rewrite", (list(old_table), keep.cpu(), list(new_table)))
        self.storage.rewrite(old_table, keep, new_table)

    def rotate_keys(self, src: list[int], dst: list[int], rotate) -> None:
        """KVStorage.rotate_keys, here and on every worker (`rotate` is sent: a picklable callable)."""
        self.workers.queue("rotate_keys", (list(src), list(dst), rotate))
        self.storage.rotate_keys(src, dst, rotate)


def _dumps(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(data: bytes, device: torch.device):
    return torch.load(io.BytesIO(data), map_location=device, weights_only=False)

class ShmChannel:
    """Rank 0's step messages to the workers on its machine, through one shared-memory buffer they all read (one
    slot, as vLLM's shm_broadcast and nano-vllm's SharedMemory): rank 0 writes a message and then bumps the
    sequence number; each worker spins on the number (then sleeps, backing off), copies the message out and
    acknowledges it. Rank 0 writes the next message once every worker has acknowledged the last (by then they
    have, as its step waited for their collectives). A message larger than the buffer goes through the pipes, the
    header saying so. The number is written after the message and read before it: the CPU keeps a core's stores
    (and loads) in order, as x86-64 does."""

    # header: [sequence number, length (-1: in the pipes)], then each reader's acknowledged number, a cache
    # line each (the readers write theirs while rank 0 reads the others')
    _LINE = 64

    def __init__(self, num_readers: int, name: str | None = None, capacity: int = STEP_BUFFER_BYTES):
        """Rank 0's (name None: a new buffer of `capacity` bytes) or a reader's (the buffer `name`)."""
        self.num_readers = num_readers
        self.data_at = self._LINE * (1 + num_readers)
        self.shm = SharedMemory(name, create=name is None, size=self.data_at + capacity if name is None else 0)
        self.capacity = self.shm.size - self.data_at
        self.seq = self._get(0) if name is not None else 0

    @staticmethod
    def ordered() -> bool:
        """Whether this CPU keeps a core's stores, and its loads, in order (x86-64), as the channel needs: elsewhere
        (ARM's weaker ordering) the steps go through the pipes."""
        return platform.machine().lower() in ("x86_64", "amd64")

    @property
    def name(self) -> str:
        return self.shm.name

    def _get(self, at: int) -> int:
        return struct.unpack_from("q", self.shm.buf, at)[0]

    def _set(self, at: int, value: int) -> None:
        struct.pack_into("q", self.shm.buf, at, value)

    def _acked(self) -> bool:
        return all(self._get(self._LINE * (1 + r)) == self.seq for r in range(self.num_readers))

    def send(self, data: bytes, conns: list, check_alive) -> None:
        """`data` to every reader: through the buffer, or through `conns` (their pipes) where it does not fit.
        Waits until the readers have taken the last message, calling check_alive (which raises for a dead one)."""
        while not self._acked():
            check_alive()
            time.sleep(1e-5)
        if len(data) <= self.capacity:
            self.shm.buf[self.data_at:self.data_at + len(data)] = data
            self._set(8, len(data))
        else:
            self._set(8, -1)
        self.seq += 1
        self._set(0, self.seq)
        if len(data) > self.capacity:
            for conn in conns:
                conn.send_bytes(data)

    def recv(self, reader: int, conn) -> bytes:
        """The next message for reader `reader` (0-based): from the buffer, or from `conn`, its pipe, where rank 0
        sent it there (too large for the buffer, or not a step: exit). EOFError once rank 0 is gone."""
        start, wait = time.perf_counter(), 1e-5
        while self._get(0) == self.seq:
            if time.perf_counter() - start < SPIN_SECONDS:
                continue
            if conn.poll(wait):             # a sleep that wakes for the pipe
                return conn.recv_bytes()
            wait = min(2 * wait, _POLL)
        self.seq += 1
        length = self._get(8)
        data = bytes(self.shm.buf[self.data_at:self.data_at + length]) if length >= 0 else None
        self._set(self._LINE * (1 + reader), self.seq)
        return conn.recv_bytes() if data is None else data

    def close(self, unlink: bool = False) -> None:
        """Detach (and, rank 0, free the buffer)."""
        self.shm.close()
        if unlink:
            self.shm.unlink()


class Workers:
    """Rank 0's handle on the worker processes: start them, send them steps, see that they live, stop them."""

    def __init__(self, size: int, args: WorkerArgs, device: torch.device):
        """Start ranks 1..size-1 (spawned, or torchrun's: torchrun_env) and join the group with them (`tp`, rank
        0's). The workers then load their shards while rank 0 loads its own: init_cache before the first step."""
        self.size, self.device = size, device
        launched = torchrun_env()
        # the steps: through shared memory to the workers this process spawns where the CPU keeps stores in order
        # (ShmChannel), else the pipes; torchrun's ranks may be on other machines, which it cannot reach: their
        # steps go through the store as the rest does
        self.channel: ShmChannel | None = None
        if launched is not None:
            store = _torchrun_store(*launched[1:], size)
            store.set("args", _dumps(args))
            self.procs = [_TorchrunRank(rank) for rank in range(1, size)]
            self.conns = [StoreConnection(store, rank, 0) for rank in range(1, size)]
        else:
            store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, timeout=COLLECTIVE_TIMEOUT,
                                  wait_for_workers=False)
            if ShmChannel.ordered():
                self.channel = ShmChannel(size - 1)
            self.procs, self.conns = self._spawn(size, args, store.port, self.channel and self.channel.name)
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.conns, self.channel)
        try:
            self._expect("started", START_TIMEOUT)    # before rank 0 waits in the group for them
            self.tp: TensorParallel = init_group(0, size, "", 0, device, store)
        except BaseException:
            self.close()
            raise
        self._store = store
        self._storage_ops: list[tuple[str, tuple]] = []

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
        ready to run steps (whose batches carry each group's slots and block tables)."""
        for conn in self.conns:
            conn.send_bytes(_dumps(("cache", spec, num_blocks, layer_groups)))
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

    def queue(self, method: str, args: tuple) -> None:
        """A change to the pool for the workers to make before their next step (ForwardedStorage)."""
        self._storage_ops.append((method, args))

    def send_step(self, block_copies: list[tuple[int, int]], inputs, native: bool = False) -> None:
        """Send a step to every worker (after check_alive): they run it as soon as it arrives, by the C decode step
        where `native`, else op by op."""
        self.check_alive()
        ops, self._storage_ops = self._storage_ops, []
        data = _dumps(StepMessage(block_copies, inputs, ops, native))
        try:
            if self.channel is not None:
                self.channel.send(data, self.conns, self.check_alive)
                return
            for conn in self.conns:
                conn.send_bytes(data)
        except OSError:
            self.check_alive()
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


def _stop(procs: list, conns: list[Connection], channel: ShmChannel | None) -> None:
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
    if channel is not None:
        channel.close(unlink=True)


# ---- the worker process ---------------------------------------------------------------------------


def worker_main(rank: int, size: int, address: tuple[str, int] | dist.Store, args: WorkerArgs, conn,
                channel: str | None = None) -> None:
    """A worker's process: join the group (its store at `address`, or the store itself), load the shard, build
    the pool when told, then run steps (from ShmChannel `channel`, else from `conn`) until told to stop or rank 0
    goes away. A failure is reported to rank 0 before the process exits."""
    try:
        _serve(rank, size, address, args, conn, channel)
    except (EOFError, KeyboardInterrupt):
        pass                                       # rank 0 is gone
    except BaseException:  # noqa: BLE001  (told to rank 0, which raises it)
        try:
            conn.send_bytes(_dumps(("error", traceback.format_exc())))
        except (OSError, RuntimeError):
            pass
        os._exit(1)


def _serve(rank: int, size: int, address: tuple[str, int] | dist.Store, args: WorkerArgs, conn,
           channel: str | None) -> None:
    from kvserve.attention import get_backend
    from kvserve.engine.cpu_memory import reuse_freed_memory
    from kvserve.engine.native_decode import NativeDecode
    from kvserve.kernels import library
    from kvserve.model.gemm_choice import GemmChoice
    from kvserve.model.layers import gemm_kernels
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
    if isinstance(address, dist.Store):
        tp = init_group(rank, size, "", 0, device, address)
    else:
        tp = init_group(rank, size, *address, device)
    model = load_model(args.model_path, args.model_config, args.dtype, device, args.max_model_len, args.weight_format,
                       tp=tp)
    if args.weight_format == "gemm":
        gemm_kernels(args.dtype)        # the OS grants AMX's tile state to each process that asks (as rank 0 did)
    GemmChoice(args.weight_format, "rank 0's", args.amx_from).apply(model)
    backend = get_backend(args.attention_backend, device)
    kind, spec, num_blocks, layer_groups = _loads(conn.recv_bytes(), device)
    storage = NoKVStorage(spec.num_layers) if num_blocks is None else KVStorage(spec, num_blocks, device, layer_groups)
    native = NativeDecode(model, storage) if args.native else None
    steps = ShmChannel(size - 1, channel) if channel is not None else None
    conn.send_bytes(_dumps(("ready", None)))
    while True:
        msg = _loads(conn.recv_bytes() if steps is None else steps.recv(rank - 1, conn), device)
        if not isinstance(msg, StepMessage):
            return                                 # ("exit",)
        for method, op_args in msg.storage_ops:
            getattr(storage, method)(*op_args)
        _run_step(model, backend, storage, native, msg)


# ---- torchrun --------------------------------------------------------------------------------------


def torchrun_env() -> tuple[int, str, int] | None:
    """(rank, MASTER_ADDR, MASTER_PORT) where torchrun (or another env:// launcher) started this process with more
    than one rank, else None."""
    env = os.environ
    if int(env.get("WORLD_SIZE", "1")) < 2 or "RANK" not in env or "MASTER_ADDR" not in env:
        return None
    return int(env["RANK"]), env["MASTER_ADDR"], int(env["MASTER_PORT"])


def _torchrun_store(host: str, port: int, size: int) -> dist.Store:
    """Our keys in torchrun's store: its agent serves it (TORCHELASTIC_USE_AGENT_STORE), else rank 0 does."""
    env = os.environ
    if int(env["WORLD_SIZE"]) != size:
        raise ValueError(f"tensor_parallel_size {size} must equal torchrun's WORLD_SIZE ({env['WORLD_SIZE']}): "
                         f"every launched rank holds a shard")
    host_it = int(env["RANK"]) == 0 and env.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    store = dist.TCPStore(host, port, size, is_master=host_it, timeout=COLLECTIVE_TIMEOUT, wait_for_workers=False)
    return dist.PrefixStore("kvserve", store)


def torchrun_worker() -> None:
    """Rank 1..N-1 under torchrun: wait for rank 0's engine to say what to load, then serve it as a spawned worker
    would."""
    rank, host, port = torchrun_env()
    size = int(os.environ["WORLD_SIZE"])
    store = _torchrun_store(host, port, size)
    conn = StoreConnection(store, rank, rank)
    args = _loads(_wait_get(store, "args"), torch.device("cpu"))
    worker_main(rank, size, store, args, conn)


def _wait_get(store: dist.Store, key: str) -> bytes:
    """The value of `key` once it is set, however long that takes (rank 0 may be loading, or idle)."""
    while True:
        try:
            store.wait([key], COLLECTIVE_TIMEOUT)
            return store.get(key)
        except dist.DistStoreError as e:
            if "timeout" not in str(e).lower():
                raise EOFError(f"the store went away: {e}") from None


class StoreConnection:
    """A pipe between rank 0 and worker `rank` made of store keys (what torchrun's ranks share): the same
    send_bytes, recv_bytes, poll and close as a multiprocessing Connection, seen from rank `me`."""

    def __init__(self, store: dist.Store, rank: int, me: int):
        self.store = store
        self.out, self.into = (f"to{rank}", f"from{rank}") if me == 0 else (f"from{rank}", f"to{rank}")
        self.sent = self.received = 0

    def send_bytes(self, data: bytes) -> None:
        self.store.set(f"{self.out}/{self.sent}", data)
        self.sent += 1

    def _next(self) -> str:
        return f"{self.into}/{self.received}"

    def poll(self, timeout: float = 0.0) -> bool:
        deadline = time.monotonic() + timeout
        while not self.store.check([self._next()]):
            if time.monotonic() >= deadline:
                return False
            time.sleep(min(_POLL, timeout))
        return True

    def recv_bytes(self) -> bytes:
        key = self._next()
        data = _wait_get(self.store, key)
        self.store.delete_key(key)
        self.received += 1
        return data

    def close(self) -> None:
        pass


class _TorchrunRank:
    """A rank torchrun started: not this process's child, so alive as far as it can tell (its death fails the
    next collective instead)."""

    exitcode = None

    def __init__(self, rank: int):
        self.pid = None
        self.rank = rank

    def is_alive(self) -> bool:
        return True

    def join(self, timeout: float | None = None) -> None:
        pass

    terminate = kill = join          # torchrun stops its ranks


@torch.inference_mode()
def _run_step(model, backend, storage: KVStorage | NoKVStorage, native, msg: StepMessage) -> None:
    """Rank 0's step on this rank's shard: the same block copies and writes, the same forward (by `native`, the
    C step, where rank 0 runs it so; its collectives meet rank 0's), and this rank's vocabulary shard of the
    logits and its heads' attention mass gathered to rank 0."""
    inputs = msg.inputs
    storage.copy_blocks(msg.block_copies)
    model.ensure_rope(int(inputs.positions.max()) + 1)
    if msg.native:
        native.run(inputs.input_ids, inputs.positions, inputs.batch)
        return
    batch = inputs.batch
    hidden = model(inputs.input_ids, inputs.positions, batch, backend, storage)
    model.compute_logits(hidden[torch.cat((inputs.logits_indices, inputs.prompt_indices))])
    if batch.mass_requests:
        reduces = {row: reduce for row, _, _, reduce in batch.mass_requests}
        model.tp.gather_mass({row: torch.cat(layers) for row, layers in batch.mass.items()}, reduces, model.config)
