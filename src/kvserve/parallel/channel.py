"""How rank 0's messages reach the workers: one shared-memory buffer that every worker on its machine reads the
steps from (ShmChannel), a pipe each for the rest, or, for torchrun's ranks, keys of torchrun's store
(StoreConnection). A message is torch.save'd (dumps), so that a worker on another CUDA device loads its tensors
onto its own (loads). `kvserve bench tp` measures the ways against each other and a torch.distributed broadcast.
"""
from __future__ import annotations

import io
import platform
import struct
import time
from multiprocessing.shared_memory import SharedMemory

import torch
import torch.distributed as dist

from kvserve.parallel.group import COLLECTIVE_TIMEOUT

POLL = 0.05                  # seconds between a waiting reader's looks at its pipe (and a worker's at its process)
STEP_BUFFER_BYTES = 4 << 20  # ShmChannel's buffer: a step's inputs at hundreds of sequences fit
# a reader spins this long for the next step (the gap between two steps, rank 0 sampling and scheduling),
# then sleeps in waits that double up to POLL (an idle engine), watching its pipe
SPIN_SECONDS = 0.005


def dumps(obj) -> bytes:
    """A message as it travels: torch.save's bytes."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def loads(data: bytes, device: torch.device):
    """A message dumps made, its tensors on `device`."""
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
            wait = min(2 * wait, POLL)
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
            time.sleep(min(POLL, timeout))
        return True

    def recv_bytes(self) -> bytes:
        key = self._next()
        data = wait_get(self.store, key)
        self.store.delete_key(key)
        self.received += 1
        return data

    def close(self) -> None:
        pass


def wait_get(store: dist.Store, key: str) -> bytes:
    """The value of `key` once it is set, however long that takes (rank 0 may be loading, or idle)."""
    while True:
        try:
            store.wait([key], COLLECTIVE_TIMEOUT)
            return store.get(key)
        except dist.DistStoreError as e:
            if "timeout" not in str(e).lower():
                raise EOFError(f"the store went away: {e}") from None
