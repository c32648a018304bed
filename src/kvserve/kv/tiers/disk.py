"""DiskTier: the second KV tier as files, one a block, kept across restarts and shared by engines.

A block the pool drops from its prefix cache is copied out at once and handed to the tier: a background
writer stores it as one file, off the step's critical path (its queue is bounded: when it is full the block
is skipped, a step never waits). The disk tier keeps each compat key's blocks in a directory of its own, so
engines of different models may share one root.

One file a block, in the stored form of kv/tiers/blockformat.py (header, bytes, checksum). Files are written
under a temporary name and renamed, so that a reader (this engine or another sharing the directory) never
sees a partial block. At start-up the index is rebuilt from the files' headers, least
recently used first (by modification time, which a read refreshes); a corrupt, truncated or incompatible
file is removed when found and never served, and when a read stops at one, the files of the blocks after it
are checked too (in the background: OffloadingConnector.read), so that the pool's copies of all the bad ones
are written again when it evicts them.

The directories are made 0700 and the files 0600: the blocks hold the prompts' token ids. The checksum finds
accidents (torn writes, flipped bits), not forgery: whoever can write the directory can change what a prompt's
cached blocks make the model say, so it must not be shared with anyone not trusted as the server is.
"""
from __future__ import annotations

import json
import logging
import os
import struct
import threading
import time
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path

import torch

from kvserve.kv.blocks import BlockKey
from kvserve.kv.events import EventSink
from kvserve.kv.tiers.base import TierCompat
from kvserve.kv.tiers.blockformat import MAGIC, BlockFormat, CorruptBlock
from kvserve.kv.tiers.queued import QueuedTier

log = logging.getLogger(__name__)

SUFFIX = ".kvblock"
# blocks waiting for the disk writer, in bytes: past it an evicted block is skipped, not queued
WRITE_QUEUE_BYTES = 256 * 2**20
# a temporary file this old is a writer's that died before its rename (a live one renames in moments)
STALE_TEMP_SECONDS = 3600


class DiskTier(QueuedTier):
    """Blocks as files in `root`/<compat digest>/, at most `capacity` bytes of them, least recently used
    removed first; written by a background thread from a bounded queue."""

    persistent = True
    medium = "DISK"

    def __init__(self, root: Path, capacity: int, compat: TierCompat, block_bytes: int,
                 queue_bytes: int | None = None, events: EventSink | None = None):
        super().__init__(capacity, block_bytes, queue_bytes or WRITE_QUEUE_BYTES, events, "kvserve-kv-offload")
        self.root, self.compat = Path(root), compat
        self.format = BlockFormat(compat.digest, block_bytes)
        self.dir = self.root / compat.digest
        self._prepare()
        if self.file_bytes(BlockKey(b"", None, (0,) * compat.block_size, None)) > capacity:
            raise ValueError(f"kv_offload_size of {capacity} bytes holds no KV block file (a block is "
                             f"{block_bytes} bytes, and its header)")
        self._scan()
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
                    header, _ = self._check_header(head, st.st_size, block_hash)
                entries.append((st.st_mtime, block_hash, st.st_size, header))
            except (CorruptBlock, ValueError) as e:
                log.warning("kv_offload: removing %s: %s", path, e)
                self.counters.errors += 1
                _remove(path)
            except OSError:
                continue       # gone meanwhile (another engine evicted it)
        for _, block_hash, size, header in sorted(entries, key=lambda e: e[:3]):
            self._index[block_hash] = size
            self._used += size
            self._stored(BlockKey(block_hash, header["parent"] and bytes.fromhex(header["parent"]),
                                  tuple(header["tokens"]), None))
        with self._lock:
            self._make_room(0)
        if self._index:
            log.info("kv_offload: %d blocks (%.1f MiB) found in %s", len(self._index), self._used / 2**20, self.dir)

    # ---- the file format -----------------------------------------------------------------------

    def file_bytes(self, key: BlockKey) -> int:
        return self.format.size(key)

    def _check_header(self, raw: bytes | memoryview, size: int, block_hash: bytes) -> tuple[dict, int]:
        """The header of a file of `size` bytes beginning with `raw`, and where its block's bytes start;
        CorruptBlock unless it is this tier's block `block_hash`, whole."""
        return self.format.check_header(raw, size, block_hash)

    def _path(self, block_hash: bytes) -> Path:
        return self.dir / (block_hash.hex() + SUFFIX)

    # ---- reads ---------------------------------------------------------------------------------

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
            if got != size:
                raise CorruptBlock(f"{got} bytes read of {size}")
            self.format.check_sum(raw)
        except CorruptBlock as e:
            log.warning("kv_offload: removing %s: %s", path, e)
            self.counters.errors += 1
            self._forget(key.hash)
            _remove(path)
            return None
        if not self.format.is_key(header, key):
            return None        # a colliding hash: another prefix's block
        with self._lock:
            # another engine's file: ours to account for now, unless our writer evicted it (and removed the
            # file, holding the lock) while we read it
            if key.hash not in self._index and path.exists():
                self._index[key.hash] = size
                self._used += size
                self._stored(key)
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

    # ---- writes --------------------------------------------------------------------------------

    def _store(self, blocks: list[tuple[BlockKey, torch.Tensor]]) -> None:
        for key, data in blocks:
            self._store_file(key, data)

    def _store_file(self, key: BlockKey, data: torch.Tensor) -> None:
        parts = self.format.encode(key, data)
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
            self._write_atomic(path, parts)
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
                self._stored(key)
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
            self._removed(block_hash)
            _remove(self._path(block_hash))


def _remove(path: Path) -> None:
    """Remove a file if it can be: one that stays (a read-only directory) is still never served."""
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass
