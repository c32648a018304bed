"""The second KV tier: full prefix blocks that leave the pool, kept on disk (or in host memory on CUDA).

A block the pool drops from its prefix cache to reuse it is copied out at once (its pages are about to
be overwritten) and handed to the tier: on disk a background writer stores it as one file, off the
step's critical path (its queue is bounded: when it is full the block is skipped, a step never waits).
A new request's prefix lookup consults the pool, then the tier: the blocks the tier holds right after
the pool's hits are read and checked by a background reader while the other sequences go on stepping,
loaded into fresh pool blocks reserved for them before the request's first step, and from then on are
ordinary cached blocks of the pool.

Blocks are keyed by the prefix cache's chained block hash (kv/blocks.py), and checked against the whole
key (parent hash, tokens, salt) on every read, so that a hash collision never serves a block. What
makes blocks of two engines interchangeable is the `TierCompat` key: model identity, dtype, page codec,
block size, layout and tensor-parallel rank. The disk tier keeps each compat key's blocks in a
directory of its own, so engines of different models may share one root.

On disk, one file a block: a magic string, a JSON header (its compat key and block key), the block's
bytes (every layer's pages, quantized ones with their scales: KVStorage.read_blocks) and a checksum of
all that. Files are written under a temporary name and renamed, so that a reader (this engine or
another sharing the directory) never sees a partial block. At start-up the index is rebuilt from the
files' headers, least recently used first (by modification time, which a read refreshes); a corrupt,
truncated or incompatible file is removed when found and never served, and when a read stops at one, the
files of the blocks after it are checked too (in the background), so that the pool's copies of all the bad
ones are written again when it evicts them.

The directories are made 0700 and the files 0600: the blocks hold the prompts' token ids. The checksum finds
accidents (torn writes, flipped bits), not forgery: whoever can write the directory can change what a prompt's
cached blocks make the model say, so it must not be shared with anyone not trusted as the server is.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from kvserve.kv.blocks import BlockKey, BlockPool

log = logging.getLogger(__name__)

DEFAULT_KV_OFFLOAD_SIZE = 16 * 2**30
MAGIC = b"KVSBLK01"
SUFFIX = ".kvblock"
# a CRC-32 of each file: it finds torn or altered bytes (the key in the header is checked apart), at
# about twice the speed of a cryptographic hash on the path of every load
DIGEST_BYTES = 4
# blocks waiting for the disk writer, in bytes: past it an evicted block is skipped, not queued
WRITE_QUEUE_BYTES = 256 * 2**20
# a temporary file this old is a writer's that died before its rename (a live one renames in moments)
STALE_TEMP_SECONDS = 3600
# bytes of each weights file hashed into the model's identity, at evenly spaced places
IDENTITY_SAMPLES, IDENTITY_SAMPLE_BYTES = 16, 4096


@dataclass(frozen=True)
class OffloadSpec:
    """A parsed `kv_offload`: 'cpu' (host memory, CUDA engines) or 'disk:PATH'."""

    kind: str
    path: Path | None = None


def parse_kv_offload(value: str | None) -> OffloadSpec | None:
    """The tier that `kv_offload` names; ValueError naming the field for anything else."""
    if value is None:
        return None
    if value == "cpu":
        return OffloadSpec("cpu")
    if isinstance(value, str) and value.startswith("disk:") and value[len("disk:"):].strip():
        return OffloadSpec("disk", Path(value[len("disk:"):].strip()).expanduser())
    raise ValueError(f"kv_offload must be 'cpu' or 'disk:PATH', got {value!r}")


def model_identity(path: Path) -> str:
    """A digest of what decides a model's K/V: config.json, and each weights file's name, size, tensor
    table (names, dtypes, shapes, offsets) and bytes sampled at evenly spaced places (fine-tunes of one
    base share the rest)."""
    h = hashlib.blake2b(digest_size=16)
    h.update((path / "config.json").read_bytes())
    for file in sorted(path.glob("*.safetensors")):
        size = file.stat().st_size
        with open(file, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = f.read(min(header_len, size))
            h.update(repr((file.name, size)).encode())
            h.update(header)
            start = 8 + header_len
            span = max(0, size - start - IDENTITY_SAMPLE_BYTES)
            for i in range(IDENTITY_SAMPLES):
                f.seek(start + span * i // max(1, IDENTITY_SAMPLES - 1))
                h.update(f.read(IDENTITY_SAMPLE_BYTES))
    return h.hexdigest()


@dataclass(frozen=True)
class TierCompat:
    """What two engines must share for one's blocks to serve the other."""

    model: str                 # model_identity
    dtype: str
    kv_cache_dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    skip_layers: tuple[int, ...] = ()
    tp_rank: int = 0
    # a hybrid cache's layer groups, (sliding window, layers) each: a block holds one group's layers' pages
    layer_groups: tuple[tuple[int | None, tuple[int, ...]], ...] = ()

    @property
    def digest(self) -> str:
        fields = asdict(self)
        if not self.layer_groups:     # so that the directories of engines without layer groups stay theirs
            del fields["layer_groups"]
        return hashlib.blake2b(json.dumps(fields, sort_keys=True).encode(), digest_size=12).hexdigest()


def _salt_digest(salt: str | None) -> str | None:
    """A salt is a tenant's secret: files carry its digest, which is all a key check needs."""
    return None if salt is None else hashlib.blake2b(salt.encode(), digest_size=16).hexdigest()


def _key_header(key: BlockKey) -> dict:
    return {"hash": key.hash.hex(), "parent": None if key.parent_hash is None else key.parent_hash.hex(),
            "tokens": list(key.token_ids), "salt": _salt_digest(key.cache_salt)}


@dataclass
class TierCounters:
    """What a tier has done since it started (stats: kv_offload_*)."""

    blocks_stored: int = 0      # blocks written to the tier
    bytes_written: int = 0
    bytes_read: int = 0
    skipped: int = 0            # evicted blocks not stored: the writer's queue was full
    evictions: int = 0          # blocks the tier dropped to make room (least recently used first)
    errors: int = 0             # reads or writes that failed, corrupt files found included


class Tier:
    """The interface of a second tier: blocks in by key (put), out by key (get), least recently used
    dropped first when full. `has` looks at what the tier knows of itself; `contains` may also ask what
    it shares (another engine's files)."""

    capacity: int
    block_bytes: int
    counters: TierCounters
    # a block handed to put must be in host memory (a disk tier's writer reads it as bytes)
    wants_host_memory: bool = True
    persistent: bool = False     # outlives the engine: worth the pool's cached blocks when it closes

    def has(self, block_hash: bytes) -> bool:
        raise NotImplementedError

    def contains(self, block_hash: bytes) -> bool:
        return self.has(block_hash)

    def touch(self, block_hash: bytes) -> None:
        """Count a block the tier holds as just used: the last one its eviction takes."""
        raise NotImplementedError

    def room(self) -> int:
        """How many blocks put takes now without waiting (the rest would be skipped)."""
        raise NotImplementedError

    def put(self, key: BlockKey, data: torch.Tensor, wait: bool = False) -> bool:
        raise NotImplementedError

    def get(self, key: BlockKey) -> torch.Tensor | None:
        raise NotImplementedError

    def file_bytes(self, key: BlockKey) -> int:
        """The tier's bytes that the block of `key` takes."""
        return self.block_bytes

    def probe(self, data: torch.Tensor) -> tuple[float, float]:
        """Seconds to store the blocks `data` [n, block_bytes] as the tier stores blocks, and to read them
        back; the tier keeps nothing of them."""
        raise NotImplementedError

    @property
    def used_bytes(self) -> int:
        raise NotImplementedError

    @property
    def num_blocks(self) -> int:
        raise NotImplementedError

    def flush(self) -> None:
        """Return once every block put so far is stored (or failed)."""

    def close(self) -> None:
        """Flush, and stop any thread of the tier."""


class HostTier(Tier):
    """Blocks in one preallocated host-memory slab of `capacity // block_bytes` slots (pinned, for a CUDA
    pool: copies in and out run at full speed), least recently used first out. A lock keeps a slot from
    being reused while the reader thread copies it out."""

    wants_host_memory = False

    def __init__(self, capacity: int, block_bytes: int, pin_memory: bool = False):
        slots = capacity // block_bytes
        if slots < 1:
            raise ValueError(f"kv_offload_size of {capacity} bytes holds no KV block ({block_bytes} bytes)")
        self.capacity, self.block_bytes = capacity, block_bytes
        self.slab = torch.empty(slots, block_bytes, dtype=torch.uint8, pin_memory=pin_memory)
        self._index: OrderedDict[bytes, tuple[int, BlockKey]] = OrderedDict()
        self._free = list(range(slots - 1, -1, -1))
        self.counters = TierCounters()
        self._lock = threading.Lock()

    def has(self, block_hash: bytes) -> bool:
        return block_hash in self._index

    def touch(self, block_hash: bytes) -> None:
        with self._lock:
            if block_hash in self._index:
                self._index.move_to_end(block_hash)

    def room(self) -> int:
        return len(self.slab)

    def put(self, key: BlockKey, data: torch.Tensor, wait: bool = False) -> bool:
        """Copy a block's bytes into a slot (the least recently used one's when none is free)."""
        with self._lock:
            return self._put(key, data)

    def _put(self, key: BlockKey, data: torch.Tensor) -> bool:
        if key.hash in self._index:
            self._index.move_to_end(key.hash)
            return True
        if not self._free:
            _, (slot, _) = self._index.popitem(last=False)
            self._free.append(slot)
            self.counters.evictions += 1
        slot = self._free.pop()
        self.slab[slot].copy_(data)
        self._index[key.hash] = (slot, key)
        self.counters.blocks_stored += 1
        self.counters.bytes_written += self.block_bytes
        return True

    def get(self, key: BlockKey) -> torch.Tensor | None:
        """A copy of the block's bytes if the tier holds exactly `key` (a later put may reuse its slot)."""
        with self._lock:
            entry = self._index.get(key.hash)
            if entry is None or entry[1] != key:
                return None
            self._index.move_to_end(key.hash)
            self.counters.bytes_read += self.block_bytes
            return self.slab[entry[0]].clone()

    def probe(self, data: torch.Tensor) -> tuple[float, float]:
        """Copy `data` into host memory like the slab's, and back where it came from."""
        host = torch.empty(data.shape, dtype=torch.uint8, pin_memory=self.slab.is_pinned())
        start = time.perf_counter()
        host.copy_(data)
        _synchronize(data.device)
        stored = time.perf_counter()
        data.copy_(host)
        _synchronize(data.device)
        return stored - start, time.perf_counter() - stored

    @property
    def used_bytes(self) -> int:
        return len(self._index) * self.block_bytes

    @property
    def num_blocks(self) -> int:
        return len(self._index)


class CorruptBlock(ValueError):
    """A block file that cannot be served: truncated, altered, or of another layout."""


class DiskTier(Tier):
    """Blocks as files in `root`/<compat digest>/, at most `capacity` bytes of them, least recently used
    removed first; written by a background thread from a bounded queue."""

    persistent = True

    def __init__(self, root: Path, capacity: int, compat: TierCompat, block_bytes: int,
                 queue_bytes: int | None = None):
        self.root, self.capacity, self.compat, self.block_bytes = Path(root), capacity, compat, block_bytes
        self.dir = self.root / compat.digest
        self.counters = TierCounters()
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()     # block hash -> file bytes, oldest use first
        self._used = 0
        self._pending: dict[bytes, tuple[BlockKey, torch.Tensor]] = {}   # queued, not yet on disk
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, (queue_bytes or WRITE_QUEUE_BYTES) // block_bytes))
        self._prepare()
        if self.file_bytes(BlockKey(b"", None, (0,) * compat.block_size, None)) > capacity:
            raise ValueError(f"kv_offload_size of {capacity} bytes holds no KV block file (a block is "
                             f"{block_bytes} bytes, and its header)")
        self._scan()
        self._writer = threading.Thread(target=self._write_loop, name="kvserve-kv-offload", daemon=True)
        self._writer.start()

    # ---- start-up ------------------------------------------------------------------------------

    def _prepare(self) -> None:
        """The directory exists and takes files; else a ValueError naming it, now rather than at every write."""
        try:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            self.dir.mkdir(mode=0o700, exist_ok=True)
            probe = self.dir / "probe"
            self._write_atomic(probe, [b"probe"])
            probe.unlink(missing_ok=True)
            about = self.dir / "compat.json"
            if not about.exists():     # for people: which engines' blocks these are
                self._write_atomic(about, [json.dumps(asdict(self.compat), indent=2).encode()])
        except OSError as e:
            raise ValueError(f"kv_offload directory {self.root} is not writable: {e}") from e

    def _scan(self) -> None:
        """Index the files there (least recently used first); remove those that cannot be served, and
        temporary files of writers that died."""
        entries = []
        now = time.time()
        for path in self.dir.iterdir():
            try:
                st = path.stat()
                if path.name.endswith(".tmp"):
                    if now - st.st_mtime > STALE_TEMP_SECONDS:
                        _remove(path)
                    continue
                if not path.name.endswith(SUFFIX):
                    continue
                block_hash = bytes.fromhex(path.name[:-len(SUFFIX)])
                with open(path, "rb") as f:
                    head = f.read(len(MAGIC) + 4)
                    if len(head) == len(MAGIC) + 4:
                        head += f.read(struct.unpack("<I", head[len(MAGIC):])[0])
                    self._check_header(head, st.st_size, block_hash)
                entries.append((st.st_mtime, block_hash, st.st_size))
            except (CorruptBlock, ValueError) as e:
                log.warning("kv_offload: removing %s: %s", path, e)
                self.counters.errors += 1
                _remove(path)
            except OSError:
                continue       # gone meanwhile (another engine evicted it)
        for _, block_hash, size in sorted(entries):
            self._index[block_hash] = size
            self._used += size
        with self._lock:
            self._make_room(0)
        if self._index:
            log.info("kv_offload: %d blocks (%.1f MiB) found in %s", len(self._index), self._used / 2**20, self.dir)

    # ---- the file format -----------------------------------------------------------------------

    def _header(self, key: BlockKey) -> bytes:
        header = json.dumps({"compat": self.compat.digest, **_key_header(key), "bytes": self.block_bytes})
        return header.encode()

    def file_bytes(self, key: BlockKey) -> int:
        return len(MAGIC) + 4 + len(self._header(key)) + self.block_bytes + DIGEST_BYTES

    def _check_header(self, raw: bytes | memoryview, size: int, block_hash: bytes) -> tuple[dict, int]:
        """The header of a file of `size` bytes beginning with `raw`, and where its block's bytes start;
        CorruptBlock unless it is this tier's block `block_hash`, whole."""
        if len(raw) < len(MAGIC) + 4 or bytes(raw[:len(MAGIC)]) != MAGIC:
            raise CorruptBlock("not a KV block file")
        (length,) = struct.unpack("<I", raw[len(MAGIC):len(MAGIC) + 4])
        start = len(MAGIC) + 4 + length
        if len(raw) < start:
            raise CorruptBlock("truncated header")
        try:
            header = json.loads(bytes(raw[len(MAGIC) + 4:start]))
        except ValueError as e:
            raise CorruptBlock(f"unreadable header: {e}") from None
        if header.get("compat") != self.compat.digest or header.get("bytes") != self.block_bytes:
            raise CorruptBlock("a block of another model, dtype or layout")
        if header.get("hash") != block_hash.hex():
            raise CorruptBlock("its name is not its block's hash")
        if size != start + self.block_bytes + DIGEST_BYTES:
            raise CorruptBlock(f"{size} bytes, expected {start + self.block_bytes + DIGEST_BYTES}")
        return header, start

    def _path(self, block_hash: bytes) -> Path:
        return self.dir / (block_hash.hex() + SUFFIX)

    # ---- reads ---------------------------------------------------------------------------------

    def has(self, block_hash: bytes) -> bool:
        with self._lock:
            return block_hash in self._pending or block_hash in self._index

    def touch(self, block_hash: bytes) -> None:
        with self._lock:
            if block_hash in self._index:
                self._index.move_to_end(block_hash)

    def contains(self, block_hash: bytes) -> bool:
        """Also true for a file another engine sharing the directory has written."""
        return self.has(block_hash) or self._path(block_hash).exists()

    def get(self, key: BlockKey) -> torch.Tensor | None:
        """The block's bytes if the tier holds exactly `key`, checked; a file that fails its checks is
        removed. None if it is not there (or another key's, under a colliding hash)."""
        with self._lock:
            pending = self._pending.get(key.hash)
        if pending is not None:
            return pending[1] if pending[0] == key else None
        path = self._path(key.hash)
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                raw = bytearray(size)
                got = f.readinto(raw)
        except OSError:
            self._forget(key.hash)
            return None
        try:
            header, start = self._check_header(memoryview(raw)[:got], size, key.hash)
            if got != size or _checksum([memoryview(raw)[:size - DIGEST_BYTES]]) != bytes(raw[-DIGEST_BYTES:]):
                raise CorruptBlock("checksum mismatch")
        except CorruptBlock as e:
            log.warning("kv_offload: removing %s: %s", path, e)
            self.counters.errors += 1
            self._forget(key.hash)
            _remove(path)
            return None
        if header != {"compat": self.compat.digest, **_key_header(key), "bytes": self.block_bytes}:
            return None        # a colliding hash: another prefix's block
        with self._lock:
            # another engine's file: ours to account for now, unless our writer evicted it (and removed the
            # file, holding the lock) while we read it
            if key.hash not in self._index and path.exists():
                self._index[key.hash] = size
                self._used += size
                self._make_room(0)
            if key.hash in self._index:
                self._index.move_to_end(key.hash)
        try:
            os.utime(path)     # its last use, for the order of eviction after a restart
        except OSError:
            pass
        self.counters.bytes_read += size
        return torch.frombuffer(raw, dtype=torch.uint8, offset=start, count=self.block_bytes)

    def probe(self, data: torch.Tensor) -> tuple[float, float]:
        """Write each row of `data` as a file here (as the writer does: atomically) and read it back (as get
        does); the files are removed."""
        paths = [self.dir / f"probe-{os.getpid()}-{i}" for i in range(len(data))]
        try:
            start = time.perf_counter()
            for path, row in zip(paths, data):
                self._write_atomic(path, [row.numpy().data])
            stored = time.perf_counter()
            for path in paths:
                with open(path, "rb") as f:
                    f.readinto(bytearray(os.fstat(f.fileno()).st_size))
            return stored - start, time.perf_counter() - stored
        finally:
            for path in paths:
                _remove(path)

    def _forget(self, block_hash: bytes) -> None:
        with self._lock:
            size = self._index.pop(block_hash, None)
            if size is not None:
                self._used -= size

    # ---- writes --------------------------------------------------------------------------------

    def room(self) -> int:
        return self._queue.maxsize - self._queue.qsize()

    def put(self, key: BlockKey, data: torch.Tensor, wait: bool = False) -> bool:
        """Queue a block (host-memory bytes, not to be changed after) for the writer; False when the queue
        is full (unless `wait`) and the block is skipped."""
        with self._lock:
            if key.hash in self._pending or key.hash in self._index:
                return True
            self._pending[key.hash] = (key, data)
        try:
            self._queue.put((key, data), block=wait)
        except queue.Full:
            with self._lock:
                del self._pending[key.hash]
            self.counters.skipped += 1
            return False
        return True

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._store(*item)
            finally:
                self._queue.task_done()

    def _store(self, key: BlockKey, data: torch.Tensor) -> None:
        header = self._header(key)
        parts = [MAGIC, struct.pack("<I", len(header)), header, data.numpy().data]
        size = self.file_bytes(key)
        path = self._path(key.hash)
        if size > self.capacity:       # a header longer than most (a salt, long token ids): it cannot fit
            with self._lock:
                del self._pending[key.hash]
            self.counters.skipped += 1
            return
        try:
            with self._lock:
                self._make_room(size)
            self._write_atomic(path, [*parts, _checksum(parts)])
        except OSError as e:
            log.warning("kv_offload: cannot write %s: %s", path, e)
            self.counters.errors += 1
            with self._lock:
                del self._pending[key.hash]
            return
        with self._lock:
            del self._pending[key.hash]
            if key.hash not in self._index:
                self._index[key.hash] = size
                self._used += size
            self._make_room(0)
            self.counters.blocks_stored += 1
            self.counters.bytes_written += size

    def _write_atomic(self, path: Path, parts: Iterable) -> None:
        """Write under a temporary name, then rename: readers see the whole file or none."""
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
                f.writelines(parts)
            os.replace(tmp, path)
        except OSError:
            _remove(tmp)
            raise

    def _make_room(self, size: int) -> None:
        """Remove least recently used files until `size` more bytes fit (called holding the lock)."""
        while self._index and self._used + size > self.capacity:
            block_hash, old = self._index.popitem(last=False)
            self._used -= old
            self.counters.evictions += 1
            _remove(self._path(block_hash))

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def num_blocks(self) -> int:
        return len(self._index)

    def flush(self) -> None:
        self._queue.join()

    def close(self) -> None:
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _checksum(parts: Iterable) -> bytes:
    crc = 0
    for part in parts:
        crc = zlib.crc32(part, crc)
    return struct.pack("<I", crc)


def _remove(path: Path) -> None:
    """Remove a file if it can be: one that stays (a read-only directory) is still never served."""
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass


@dataclass
class OffloadCounters:
    """What the engine has taken from the tier (stats: kv_offload_*)."""

    # tokens of blocks an admission found in the tier past the pool's hits, and of full blocks found in neither
    # (a swapped-out sequence's resumption counts in swap_in_blocks instead)
    hit_tokens: int = 0
    miss_tokens: int = 0
    loads: int = 0            # blocks loaded from the tier into the pool
    swap_outs: int = 0        # preemptions that wrote the sequence's full blocks to the tier
    swap_out_blocks: int = 0
    swap_ins: int = 0         # resumptions of sequences swapped out
    swap_in_blocks: int = 0   # blocks those resumptions loaded from the tier (the rest the pool still held)
    recomputes: int = 0       # preemptions left to recompute the sequence


PREEMPTION_MODES = ("swap", "recompute")


@dataclass(frozen=True)
class SwapCosts:
    """What a preempted sequence's full blocks cost to recompute or to move, measured at start-up: a
    prefill of T tokens takes prefill_s_per_token * T + prefill_s_per_token2 * T**2 seconds (attention
    grows with the square); a block takes write_s_per_block to go from the pool to the tier, and
    read_s_per_block to come back."""

    prefill_s_per_token: float
    prefill_s_per_token2: float
    write_s_per_block: float
    read_s_per_block: float


def swap_is_cheaper(costs: SwapCosts, num_blocks: int, num_stored: int, block_size: int) -> bool:
    """Whether swapping a preempted sequence's `num_blocks` full blocks (writing those of them the tier
    lacks, all but `num_stored`, then reading them all back) takes less time than recomputing their
    tokens from scratch."""
    tokens = num_blocks * block_size
    recompute = costs.prefill_s_per_token * tokens + costs.prefill_s_per_token2 * tokens ** 2
    swap = costs.write_s_per_block * (num_blocks - num_stored) + costs.read_s_per_block * num_blocks
    return swap < recompute


def measure_prefill(prefill: Callable[[int], None], tokens: int, repeats: int = 2) -> tuple[float, float]:
    """(seconds a token, seconds a token squared) of prefills, fitted to the fastest of `repeats` runs of
    `prefill(tokens)` and of `prefill(2 * tokens)` (the fastest: a run on shared cores is slowed, never
    sped up, by what else runs)."""
    def fastest(n: int) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            prefill(n)
            times.append(time.perf_counter() - start)
        return min(times)

    t1, t2 = fastest(tokens), fastest(2 * tokens)
    # t(T) = a T + b T^2 through both points; b < 0 is noise on a prefill too short for attention to show
    b = max(0.0, (t2 - 2 * t1) / (2 * tokens ** 2))
    return max(0.0, t1 / tokens - b * tokens), b


class KVOffloader:
    """Binds a tier to an engine's pool and pages: blocks the pool evicts go to the tier (`save`, the
    pool's on_evict hook), blocks a prefix lookup finds there come back into fresh pool blocks (`read`
    on the reader thread, started by `start_read`, then `load` by the scheduler once it is done)."""

    def __init__(self, tier: Tier, pool: BlockPool, read_blocks: Callable[[list[int]], torch.Tensor],
                 write_blocks: Callable[[list[int], torch.Tensor], None], device: torch.device):
        self.tier, self.pool, self.device = tier, pool, device
        self.read_blocks, self.write_blocks = read_blocks, write_blocks
        self.counters = OffloadCounters()
        # how a preemption is chosen: 'swap' or 'recompute' always, or by these costs (preemption_mode None)
        self.preemption_mode: str | None = "recompute"
        self.swap_costs: SwapCosts | None = None
        self._closed = False
        # one thread reads the tier's files and checks them (file reads and CRCs release the GIL): a step
        # runs meanwhile; its thread starts with the first read
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="kvserve-kv-offload-read")
        self._reads: dict[Future, int] = {}       # reads not yet taken by read_result -> their blocks

    def save(self, evicted: list[tuple[int, BlockKey]], wait: bool = False) -> None:
        """Copy the pages of blocks leaving the pool's prefix cache into the tier: those it lacks, as many
        as it takes now (unless `wait`). Called before anything overwrites them."""
        todo = [(b, k) for b, k in evicted if not self.tier.has(k.hash)]
        if not wait:
            room = self.tier.room()
            self.tier.counters.skipped += max(0, len(todo) - room)
            todo = todo[:room]
        if not todo:
            return
        data = self.read_blocks([b for b, _ in todo])
        if self.tier.wants_host_memory:
            data = data.cpu()
        for (_, key), row in zip(todo, data):
            self.tier.put(key, row, wait)

    def holds(self, key: BlockKey) -> bool:
        """Whether the tier holds the block of `key` (by hash; read() checks the rest)."""
        return self.tier.contains(key.hash)

    def read(self, keys: list[BlockKey]) -> list[torch.Tensor]:
        """The bytes of the leading blocks of `keys` that the tier serves, checked: up to the first it
        cannot (gone, corrupt, another key's). The blocks after that one are computed, and the tier takes the
        pool's copies of those it lacks when the pool evicts them: the files of the rest are checked after this
        read (get removes a bad one), so that every bad one is replaced then, not one a request."""
        out = []
        for i, key in enumerate(keys):
            data = self.tier.get(key)
            if data is None:
                if i + 1 < len(keys):
                    self._check_later(keys[i + 1:])
                break
            out.append(data)
        return out

    def _check_later(self, keys: list[BlockKey]) -> None:
        """Read (and so check) the blocks of `keys` on the reader thread once it is free; none once closed."""
        try:
            self._reader.submit(lambda: [self.tier.get(key) for key in keys])
        except RuntimeError:        # the reader has stopped (close)
            pass

    def start_read(self, keys: list[BlockKey]) -> Future:
        """Start `read(keys)` on the reader thread and return at once: its future gives the blocks read
        (read_result). Once the tier is closed the read is done before it returns."""
        if self._closed:
            future = Future()
            future.set_running_or_notify_cancel()
            future.set_result(self.read(keys))
        else:
            future = self._reader.submit(self.read, keys)
        self._reads[future] = len(keys)
        return future

    def read_result(self, future: Future) -> list[torch.Tensor]:
        """The blocks a done read (start_read) got: none if it was cancelled (the engine closed), so that
        their tokens are computed instead. (A file that cannot be read or fails its checks ends the
        blocks read there, in `read`.)"""
        self._reads.pop(future, None)
        return [] if future.cancelled() else future.result()

    def cancel_read(self, future: Future) -> None:
        """Drop a read nobody waits for any more: it does not start if it has not; its blocks are never
        loaded."""
        future.cancel()
        self._reads.pop(future, None)

    @staticmethod
    def wait_for_read(futures: Iterable[Future]) -> None:
        """Block until one of these reads is done (a step with nothing else to run waits for its blocks)."""
        wait(list(futures), return_when=FIRST_COMPLETED)

    @property
    def loads_in_flight(self) -> int:
        """Blocks being read from the tier for a sequence that waits for them, or queued for the reader."""
        return sum(n for f, n in self._reads.items() if not f.done())

    def load(self, block_ids: list[int], data: list[torch.Tensor]) -> None:
        """Write blocks read from the tier into pool blocks (fresh ones, before any step reads them)."""
        if block_ids:
            # numpy's one plain copy: torch.stack of tensors over a file's bytes (torch.frombuffer) takes a
            # slow path, and copying them one by one starts a parallel region for each, which on busy
            # cores waits for the scheduler every time
            rows = torch.from_numpy(np.stack([block.numpy() for block in data]))
            self.write_blocks(block_ids, rows.to(self.device))
            self.counters.loads += len(block_ids)

    def count(self, hit_tokens: int, miss_tokens: int) -> None:
        self.counters.hit_tokens += hit_tokens
        self.counters.miss_tokens += miss_tokens

    def measure_transfer(self, num_blocks: int = 8, repeats: int = 3) -> tuple[float, float]:
        """Seconds a block takes to go from the pool into the tier, and back, timed on `num_blocks` of the
        pool's blocks (their pages stay as they are); the fastest of `repeats` runs (the first also pays
        for touching pages never used before)."""
        ids = list(range(min(num_blocks, self.pool.num_blocks)))
        out, back = [], []
        for _ in range(repeats):
            start = time.perf_counter()
            data = self.read_blocks(ids)
            if self.tier.wants_host_memory:
                data = data.cpu()
            _synchronize(self.device)
            copied = time.perf_counter() - start
            stored, read = self.tier.probe(data)
            start = time.perf_counter()
            self.write_blocks(ids, data)
            _synchronize(self.device)
            out.append(copied + stored)
            back.append(read + time.perf_counter() - start)
        return min(out) / len(ids), min(back) / len(ids)

    def should_swap(self, keys: list[BlockKey]) -> bool:
        """Whether a preempted sequence whose full blocks hold `keys` goes to the tier rather than being
        recomputed: by preemption_mode, or (None) by the measured costs; never when the blocks would not
        all fit in the tier together, or once the tier is closed."""
        if not keys or self._closed or self.preemption_mode == "recompute":
            return False
        if sum(self.tier.file_bytes(k) for k in keys) > self.tier.capacity:
            return False
        if self.preemption_mode == "swap":
            return True
        stored = sum(self.tier.has(k.hash) for k in keys)
        return swap_is_cheaper(self.swap_costs, len(keys), stored, len(keys[0].token_ids))

    def swap_out(self, blocks: list[tuple[int, BlockKey]]) -> None:
        """Write a preempted sequence's full blocks to the tier, waiting for room rather than skipping any:
        its resumption reads them back (Scheduler._allocate_for_admission) instead of recomputing them."""
        for _, key in blocks:      # those it holds already are the last it evicts now
            self.tier.touch(key.hash)
        self.save(blocks, wait=True)
        self.counters.swap_outs += 1
        self.counters.swap_out_blocks += len(blocks)

    def count_recompute(self) -> None:
        self.counters.recomputes += 1

    def count_swap_in(self, num_loaded: int) -> None:
        self.counters.swap_ins += 1
        self.counters.swap_in_blocks += num_loaded

    def close(self) -> None:
        """Stop the reader (reads not started are cancelled: their sequences compute those tokens; the one
        under way finishes), write the blocks still in the pool's prefix cache to the tier (so that a
        restart finds them too), wait for the writer, stop it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.pool.on_evict = None
        self._reader.shutdown(wait=True, cancel_futures=True)
        try:
            if self.tier.persistent:
                cached = [(b, key) for b, key in enumerate(self.pool.keys) if key is not None]
                step = max(1, self.tier.room())      # a batch of pages at a time in host memory
                for i in range(0, len(cached), step):
                    self.save(cached[i:i + step], wait=True)
                self.tier.flush()
        finally:
            self.tier.close()

    def stats(self) -> dict:
        tier, c = self.tier, self.tier.counters
        return {
            "kv_offload_capacity_bytes": tier.capacity,
            "kv_offload_blocks": tier.num_blocks,
            "kv_offload_bytes": tier.used_bytes,
            "kv_offload_blocks_stored": c.blocks_stored,
            "kv_offload_bytes_written": c.bytes_written,
            "kv_offload_bytes_read": c.bytes_read,
            "kv_offload_hit_tokens": self.counters.hit_tokens,
            "kv_offload_miss_tokens": self.counters.miss_tokens,
            "kv_offload_loads": self.counters.loads,
            "kv_offload_loads_in_flight": self.loads_in_flight,
            "kv_offload_swap_outs": self.counters.swap_outs,
            "kv_offload_swap_out_blocks": self.counters.swap_out_blocks,
            "kv_offload_swap_ins": self.counters.swap_ins,
            "kv_offload_swap_in_blocks": self.counters.swap_in_blocks,
            "kv_offload_recomputes": self.counters.recomputes,
            "kv_offload_skipped": c.skipped,
            "kv_offload_evictions": c.evictions,
            "kv_offload_errors": c.errors,
        }
