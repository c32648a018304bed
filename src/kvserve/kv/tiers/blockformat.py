"""A block as a tier stores it outside the process (a disk tier's file, a Redis tier's value): a magic string,
a JSON header (the compat key's digest, the block's key, its size), the block's bytes (every layer's pages,
quantized ones with their scales: KVStorage.read_blocks) and a CRC-32 of all that. A reader checks the header
against the key it asked for and the checksum before it serves a byte.
"""
from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from kvserve.kv.blocks import BlockKey
from kvserve.kv.tiers.base import key_header

MAGIC = b"KVSBLK01"
# a CRC-32: it finds torn or altered bytes (the key in the header is checked apart), at about twice the speed
# of a cryptographic hash on the path of every load
DIGEST_BYTES = 4
_PREFIX = len(MAGIC) + 4        # the magic string and the header's length


class CorruptBlock(ValueError):
    """A stored block that cannot be served: truncated, altered, or of another layout."""


@dataclass(frozen=True)
class BlockFormat:
    """The stored form of one engine's blocks: its compat key's digest and its blocks' size in bytes."""

    compat_digest: str
    block_bytes: int

    def header(self, key: BlockKey) -> bytes:
        return json.dumps({"compat": self.compat_digest, **key_header(key), "bytes": self.block_bytes}).encode()

    def size(self, key: BlockKey) -> int:
        """Bytes the block of `key` takes stored."""
        return _PREFIX + len(self.header(key)) + self.block_bytes + DIGEST_BYTES

    def encode(self, key: BlockKey, data: torch.Tensor) -> list:
        """The parts of the stored block (host-memory bytes `data`), checksum last, to write in order."""
        header = self.header(key)
        parts = [MAGIC, struct.pack("<I", len(header)), header, data.numpy().data]
        return [*parts, checksum(parts)]

    def check_header(self, raw: bytes | memoryview, size: int, block_hash: bytes) -> tuple[dict, int]:
        """The header of a stored block of `size` bytes beginning with `raw`, and where its block's bytes start;
        CorruptBlock unless it is one of these blocks, `block_hash`'s, whole."""
        if len(raw) < _PREFIX or bytes(raw[:len(MAGIC)]) != MAGIC:
            raise CorruptBlock("not a KV block")
        (length,) = struct.unpack("<I", raw[len(MAGIC):_PREFIX])
        start = _PREFIX + length
        if len(raw) < start:
            raise CorruptBlock("truncated header")
        try:
            header = json.loads(bytes(raw[_PREFIX:start]))
        except ValueError as e:
            raise CorruptBlock(f"unreadable header: {e}") from None
        if header.get("compat") != self.compat_digest or header.get("bytes") != self.block_bytes:
            raise CorruptBlock("a block of another model, dtype or layout")
        if header.get("hash") != block_hash.hex():
            raise CorruptBlock("its name is not its block's hash")
        if size != start + self.block_bytes + DIGEST_BYTES:
            raise CorruptBlock(f"{size} bytes, expected {start + self.block_bytes + DIGEST_BYTES}")
        return header, start

    @staticmethod
    def check_sum(raw: bytes | bytearray) -> None:
        """CorruptBlock unless the stored block's last bytes are the checksum of the rest."""
        if checksum([memoryview(raw)[:len(raw) - DIGEST_BYTES]]) != bytes(raw[-DIGEST_BYTES:]):
            raise CorruptBlock("checksum mismatch")

    def is_key(self, header: dict, key: BlockKey) -> bool:
        """Whether a checked header is exactly `key`'s (not another prefix's under a colliding hash)."""
        return header == {"compat": self.compat_digest, **key_header(key), "bytes": self.block_bytes}

    def decode(self, raw: bytes | bytearray, key: BlockKey) -> torch.Tensor | None:
        """The block's bytes in a whole stored block `raw` of `key`, checked; None if it is another key's block
        under a colliding hash; CorruptBlock if it cannot be served."""
        header, start = self.check_header(raw, len(raw), key.hash)
        self.check_sum(raw)
        if not self.is_key(header, key):
            return None
        return torch.frombuffer(raw, dtype=torch.uint8, offset=start, count=self.block_bytes)


def checksum(parts: Iterable) -> bytes:
    crc = 0
    for part in parts:
        crc = zlib.crc32(part, crc)
    return struct.pack("<I", crc)
