"""The second KV tier: what every tier shares.

Full prefix blocks that leave the pool are kept in a second tier (on disk, in host memory on CUDA, or in a
Redis server that several engines share) and come back instead of being recomputed (kv/tiers/offloading.py
binds a tier to the pool). Blocks are keyed
by the prefix cache's chained block hash (kv/blocks.py), and checked against the whole key (parent hash,
tokens, salt) on every read, so that a hash collision never serves a block. What makes blocks of two
engines interchangeable is the `TierCompat` key: model identity, dtype, page codec, block size, layout and
rank layout (under tensor parallelism each rank keeps its own heads' pages in a tier of its own).
"""
from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlsplit

import torch

from kvserve.kv.blocks import BlockKey
from kvserve.kv.events import EventSink

DEFAULT_KV_OFFLOAD_SIZE = 16 * 2**30
# bytes of each weights file hashed into the model's identity, at evenly spaced places
IDENTITY_SAMPLES, IDENTITY_SAMPLE_BYTES = 16, 4096


@dataclass(frozen=True)
class OffloadSpec:
    """A parsed `kv_offload`: 'cpu' (host memory, CUDA engines), 'disk:PATH' or 'redis://HOST:PORT[/DB]'."""

    kind: str
    path: Path | None = None
    url: str | None = None


def parse_kv_offload(value: str | None) -> OffloadSpec | None:
    """The tier that `kv_offload` names; ValueError naming the field for anything else."""
    if value is None:
        return None
    if value == "cpu":
        return OffloadSpec("cpu")
    if isinstance(value, str) and value.startswith("disk:") and value[len("disk:"):].strip():
        return OffloadSpec("disk", Path(value[len("disk:"):].strip()).expanduser())
    if isinstance(value, str) and value.startswith("redis://"):
        _check_redis_url(value)
        return OffloadSpec("redis", url=value)
    raise ValueError(f"kv_offload must be 'cpu', 'disk:PATH' or 'redis://HOST:PORT[/DB]', got {value!r}")


def _check_redis_url(url: str) -> None:
    """ValueError naming kv_offload unless `url` is redis://HOST:PORT with an optional database number."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    db = parts.path.strip("/")
    if not parts.hostname or port is None or (db and not db.isdigit()) or parts.query or parts.fragment:
        raise ValueError(f"kv_offload: a Redis tier is redis://HOST:PORT[/DB] (DB a number), got {url!r}")


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
    # the rank layout: the blocks hold the KV heads of rank tp_rank of tp_size (each rank keeps a tier of its own);
    # an engine of another layout never reads them
    tp_size: int = 1

    @property
    def digest(self) -> str:
        fields = asdict(self)
        # left out at their defaults, so that the blocks of engines without them keep their keys
        if not self.layer_groups:
            del fields["layer_groups"]
        if self.tp_size == 1:
            del fields["tp_size"]
        return hashlib.blake2b(json.dumps(fields, sort_keys=True).encode(), digest_size=12).hexdigest()

def _salt_digest(salt: str | None) -> str | None:
    """A salt is a tenant's secret: what a tier stores carries its digest, which is all a key check needs."""
    return None if salt is None else hashlib.blake2b(salt.encode(), digest_size=16).hexdigest()


def key_header(key: BlockKey) -> dict:
    """What a tier stores of a block's key beside its bytes, to check on every read."""
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
    errors: int = 0             # reads or writes that failed, corrupt blocks found included


class Tier:
    """The interface of a second tier: blocks in by key (put), out by key (get), least recently used
    dropped first when full. `has` looks at what the tier knows of itself; `contains` may also ask what
    it shares (another engine's files). What it holds, as it knows it, goes to `events` (KV events of its
    `medium`): each block it stores and each it drops."""

    capacity: int
    block_bytes: int
    counters: TierCounters
    medium: str
    events: EventSink | None = None
    # a block handed to put must be in host memory (a disk tier's writer reads it as bytes)
    wants_host_memory: bool = True
    persistent: bool = False     # outlives the engine: worth the pool's cached blocks when it closes
    # shared with other engines: a full block is saved as soon as a step computes it, not when the pool evicts it
    write_through: bool = False

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

    def get_prefix(self, keys: list[BlockKey]) -> list[torch.Tensor]:
        """The bytes of the leading blocks of `keys` that the tier serves, checked: up to the first it cannot
        (gone, corrupt, another key's)."""
        out = []
        for key in keys:
            data = self.get(key)
            if data is None:
                break
            out.append(data)
        return out

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

    def _stored(self, key: BlockKey) -> None:
        if self.events is not None:
            self.events.stored(key)

    def _removed(self, block_hash: bytes) -> None:
        if self.events is not None:
            self.events.removed(block_hash)

def synchronize(device: torch.device) -> None:
    """Wait for the device's copies (a CUDA pool's), so that a timing counts them."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
