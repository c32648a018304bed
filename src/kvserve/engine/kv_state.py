"""What the KV cache holds at a step boundary: the state behind the server's live view of the block pool.

`snapshot` runs in the engine's process between two steps and only copies (the pool's reference
counts, the prefix index's blocks, the block tables): no work per block, so that watching the pool
costs the engine next to nothing. `render` turns a snapshot into the JSON the server answers, in the
server's process. `block_detail` describes one block: its owners and the tokens it holds.

A block is in one of these states (one character each in `render`'s "blocks"):
  "."  free: no owner, no prefix in it
  "c"  cached: no owner, a full block of a prefix the next request may reuse (it counts as free)
  "u"  in use: one owner
  "s"  shared: more than one owner (a common prefix, or the samples of an n > 1 request)
In a quantized cache the "u" and "s" blocks are quantized.
"""
from __future__ import annotations

import hmac
import time
from array import array
from dataclasses import asdict, dataclass

import numpy as np

from kvserve.engine.engine import LLMEngine
from kvserve.engine.sequence import Sequence
from kvserve.kv import KVCache
from kvserve.kv.eviction import Sink

STATES = {"free": ".", "cached": "c", "used": "u", "shared": "s"}


@dataclass
class SequenceState:
    """One running or waiting sequence and the physical block of each of its logical blocks."""

    request_id: str
    seq_id: int
    status: str                     # "running" or "waiting"
    num_prompt_tokens: int
    num_tokens: int
    num_computed_tokens: int
    num_cached_tokens: int          # prompt tokens found in the prefix cache
    num_evicted_tokens: int
    block_table: list[int]          # logical block i is physical block block_table[i]
    pinned: list[int]               # blocks it owns outside its table (the originals of a sink's blocks)
    # a hybrid cache's tables of the layer groups after the first (block_table is the first's); else none
    group_tables: list[list[int]]


@dataclass
class KVSnapshot:
    """The pool and the sequences as of one step boundary, with the engine's stats of that moment."""

    time: float                     # time.time() when it was taken
    stats: dict                     # LLMEngine.stats() at the same boundary
    ref_counts: bytes | array       # per block: its owners (bytes while every count fits one)
    hashed: list[int]               # the blocks in the prefix index (cached ones, and owned ones)
    sequences: list[SequenceState]


# the second KV tier's counters that the state reports (LLMEngine.stats() keys, less "kv_offload_")
TIER_COUNTERS = ("blocks", "bytes", "capacity_bytes", "hit_tokens", "miss_tokens")


def snapshot(engine: LLMEngine) -> KVSnapshot:
    """Copy the KV cache's state from `engine` (an LLMEngine between two steps); changes nothing."""
    kv, scheduler = engine.kv, engine.scheduler
    pool = getattr(kv, "pool", None)            # none where the engine keeps no cache
    ref_counts, hashed = (_counts(pool.ref_counts), pool.indexed_blocks()) if pool is not None else (b"", [])
    sequences = [_sequence(s, "running", kv) for s in scheduler.running]
    # with those waiting for their blocks from the second tier: they hold the pool's blocks those go to
    waiting = [*scheduler.waiting, *(load.seq for load in scheduler.loading.values())]
    sequences += [_sequence(s, "waiting", kv) for s in waiting]
    return KVSnapshot(time.time(), engine.stats(), ref_counts, hashed, sequences)


def _counts(ref_counts: list[int]) -> bytes | array:
    """The reference counts, one byte each while every one fits (nearly always): the smallest copy to
    take between two steps and to send through the pipe."""
    try:
        return bytes(ref_counts)
    except ValueError:
        return array("q", ref_counts)


def _sequence(seq: Sequence, status: str, kv: KVCache) -> SequenceState:
    tables = [list(t) for t in kv.group_tables(seq.seq_id)] if kv.holds(seq.seq_id) else [[]]
    return SequenceState(seq.request_id, seq.seq_id, status, seq.num_prompt_tokens, seq.num_tokens,
                         seq.num_computed_tokens, seq.num_cached_tokens, seq.num_evicted_tokens,
                         tables[0], list(kv.pinned.get(seq.seq_id, ())), tables[1:])


def block_states(snap: KVSnapshot) -> np.ndarray:
    """Each block's state, as the byte of its character in STATES."""
    refs = np.frombuffer(snap.ref_counts, dtype=np.uint8 if isinstance(snap.ref_counts, bytes) else np.int64)
    states = np.full(len(refs), ord(STATES["used"]), dtype=np.uint8)
    states[refs > 1] = ord(STATES["shared"])
    states[refs == 0] = ord(STATES["free"])
    hashed = np.asarray(snap.hashed, dtype=np.int64)
    states[hashed[refs[hashed] == 0]] = ord(STATES["cached"])
    return states


def _tier_state(stats: dict) -> dict | None:
    """The second KV tier (kv_offload) as `stats` (LLMEngine.stats()) counts it: what it holds against
    its capacity, and the prompt tokens it served and missed; None for an engine without one."""
    if stats.get("kv_offload") is None:
        return None
    return {"kind": stats["kv_offload"].split(":", 1)[0],
            **{name: stats[f"kv_offload_{name}"] for name in TIER_COUNTERS}}


def render(snap: KVSnapshot) -> dict:
    """The snapshot as the JSON of GET /v1/kv/state: every block's state, the count of each, the
    sequences with their block tables, the engine's stats of the same step and, where the engine has a
    second KV tier, that tier's counters from those stats ("kv_offload"; absent without one)."""
    states = block_states(snap)
    counts = np.bincount(states, minlength=256)
    stats = snap.stats
    tier = _tier_state(stats)
    return {
        "object": "kv_state",
        "time": snap.time,
        "cache_mode": stats["cache_mode"],
        "kv_cache_dtype": stats["kv_cache_dtype"],
        "block_size": stats["kv_block_size"],
        "num_blocks": stats["kv_blocks_total"],
        "blocks": states.tobytes().decode("ascii"),
        "counts": {name: int(counts[ord(c)]) for name, c in STATES.items()},
        "running": [asdict(s) for s in snap.sequences if s.status == "running"],
        "waiting": [asdict(s) for s in snap.sequences if s.status == "waiting"],
        "stats": stats,
        **({"kv_offload": tier} if tier is not None else {}),
    }


def block_detail(engine: LLMEngine, block_id: int, show_content: bool = False, cache_salt: str | None = None) -> dict:
    """One block of `engine`'s pool (ValueError naming block_id if there is no such block): its state,
    owners (sequence, layer group, logical index), reference count and prefix hash: its structure, which
    is all it says by default.

    Its token ids come too only if `show_content` (the operator's --kv-dashboard-content) and the
    caller's `cache_salt` is the block's own (None for both: an unsalted caller sees unsalted blocks
    only): a salt keeps tenants apart in the prefix cache, and this view must not undo that. "content"
    says which: "shown", "off" (show_content is off), "other_salt", or "none" (a free block, or one whose
    tokens are not known: a sequence that compacted its cache (h2o, snapkv) keeps no record of which
    tokens stayed)."""
    kv = engine.kv
    pool = getattr(kv, "pool", None)
    if pool is None or not 0 <= block_id < pool.num_blocks:
        raise ValueError(f"block_id: there is no block {block_id}; the pool has "
                         f"{pool.num_blocks if pool is not None else 0} blocks")
    key = pool.keys[block_id]
    owners, owner_seqs, token_ids = [], [], list(key.token_ids) if key is not None else None
    scheduler = engine.scheduler
    seqs = [*scheduler.running, *scheduler.waiting, *(load.seq for load in scheduler.loading.values())]
    for seq in (s for s in seqs if kv.holds(s.seq_id)):
        tables = [(g, False, t) for g, t in enumerate(kv.group_tables(seq.seq_id))]
        for group, pinned, table in tables + [(g, True, t) for g, t in enumerate(kv.group_pinned(seq.seq_id))]:
            for index in (i for i, b in enumerate(table) if b == block_id):
                owners.append({"request_id": seq.request_id, "seq_id": seq.seq_id, "group": group, "index": index,
                               "pinned": pinned})
                owner_seqs.append(seq)
                if token_ids is None:
                    token_ids = _tokens_at(seq, index, pinned, kv.block_size)
    refs = pool.ref_counts[block_id]
    state = "shared" if refs > 1 else "used" if refs else "cached" if key is not None else "free"
    salts = {key.cache_salt} if key is not None else {s.cache_salt for s in owner_seqs}
    content = _content_access(token_ids, salts, show_content, cache_salt)
    return {"object": "kv_block", "block_id": block_id, "state": state, "ref_count": refs,
            "prefix_hash": key.hash.hex() if key is not None else None,
            "parent_hash": key.parent_hash.hex() if key is not None and key.parent_hash else None,
            "owners": owners, "content": content, "token_ids": token_ids if content == "shown" else None}


def sparse_reads(engine: LLMEngine, seq_id: int) -> dict:
    """Which blocks of a sequence the last step with sparse decodes read (sparse attention, kv/sparse.py): per layer,
    one character per entry of its block table, the number of its KV heads that read it ("0" to "9", "+" past
    nine; all "0" in a layer it did not decode through: a sliding window's). ValueError naming seq_id for a sequence
    that was not in that step."""
    reads = engine.runner.sparse.blocks_read(seq_id)
    if reads is None:
        raise ValueError(f"seq_id: sequence {seq_id} was not in the last step under sparse attention")
    seq = next((s for s in engine.scheduler.running if s.seq_id == seq_id), None)
    blocks = -(-seq.num_computed_tokens // engine.kv.block_size) if seq is not None else len(reads[0])
    return {"object": "kv_sparse_reads", "seq_id": seq_id, "kv_heads": engine.model.shard_config.num_kv_heads,
            "layers": ["".join(str(n) if n < 10 else "+" for n in layer[:blocks]) for layer in reads]}


def _content_access(token_ids: list[int] | None, salts: set[str | None], show_content: bool,
                    cache_salt: str | None) -> str:
    """Whether a caller presenting `cache_salt` may see tokens held under `salts` (see block_detail)."""
    if token_ids is None:
        return "none"
    if not show_content:
        return "off"
    return "shown" if len(salts) == 1 and _same_salt(cache_salt, next(iter(salts))) else "other_salt"


def _same_salt(given: str | None, salt: str | None) -> bool:
    """A salt is a tenant's secret: compared in constant time, as the API key is."""
    if given is None or salt is None:
        return given is salt
    return hmac.compare_digest(given.encode(), salt.encode())


def _tokens_at(seq: Sequence, index: int, pinned: bool, block_size: int) -> list[int] | None:
    """The tokens that logical block `index` of a sequence holds (of its pinned blocks, if `pinned`):
    the computed ones of positions index * block_size on, shifted past what a sink dropped once the
    block is past the sink blocks; None after a compaction, which keeps tokens by score."""
    start = index * block_size
    if seq.num_evicted_tokens and not pinned:
        if not isinstance(seq.eviction, Sink):
            return None
        if index >= seq.eviction.sink_blocks(block_size):
            start += seq.num_evicted_tokens      # a sink drops whole blocks: the window's follow its sinks
    return seq.token_ids[start:min(start + block_size, seq.num_computed_tokens)]
