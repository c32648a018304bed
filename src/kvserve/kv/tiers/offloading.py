"""OffloadingConnector: a second tier bound to an engine's pool and pages, as the scheduler's KVConnector.

A block the pool drops from its prefix cache to reuse it is copied out at once (its pages are about to be
overwritten) and handed to the tier. A write-through tier (one that other engines share) also gets each full
block once the step that computes it has run (`commit`), so that another engine finds it at once. A new
request's prefix lookup consults the pool, then the tier: the blocks the tier holds right after the pool's
hits are read and checked by a background reader while the other sequences go on stepping, loaded into fresh
pool blocks reserved for them before the request's first step, and from then on are ordinary cached blocks of
the pool. A preempted sequence's full blocks may go to
the tier instead of being recomputed, as the measured costs (or preemption_mode) say.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import numpy as np
import torch

from kvserve.kv.blocks import BlockKey, BlockPool
from kvserve.kv.interface import BlockToLoad
from kvserve.kv.tiers.base import Tier, synchronize
from kvserve.kv.tiers.connector import KVConnector


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


class OffloadingConnector(KVConnector):
    """Binds a tier to an engine's pool and pages: blocks the pool evicts go to the tier (`save`, the
    pool's on_evict hook), blocks a prefix lookup finds there come back into fresh pool blocks (`read`
    on the reader thread, started by `start_load`, then written by `finish_load` once it is done). A tensor-parallel
    worker binds its own tier to its own pages with no pool (`pool` None): rank 0 names the blocks
    (parallel/connector.py)."""

    def __init__(self, tier: Tier, pool: BlockPool | None, read_blocks: Callable[[list[int]], torch.Tensor],
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
        # blocks indexed since the last step ran, whose pages it wrote: a write-through tier's to save
        self._computed: list[tuple[int, BlockKey]] = []
        if tier.write_through and pool is not None:     # (a tensor-parallel worker's: rank 0 says what to save)
            pool.on_cache = lambda block, key: self._computed.append((block, key))

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

    def commit(self) -> None:
        """The step ran: a write-through tier gets the blocks indexed before it (committed)."""
        if self._computed:
            self.save(self.committed())

    def committed(self) -> list[tuple[int, BlockKey]]:
        """The (block, key)s indexed since the last step, whose pages it has now written, that the pool still
        holds under the same key (one evicted meanwhile went to the tier by `save` already): what a write-through
        tier saves now."""
        computed, self._computed = self._computed, []
        return [(b, key) for b, key in computed if self.pool.keys[b] == key]

    def holds(self, key: BlockKey) -> bool:
        """Whether the tier holds the block of `key` (by hash; read() checks the rest)."""
        return self.tier.contains(key.hash)

    def read(self, keys: list[BlockKey]) -> list[torch.Tensor]:
        """The bytes of the leading blocks of `keys` that the tier serves, checked: up to the first it
        cannot (gone, corrupt, another key's). The blocks after that one are computed, and the tier takes the
        pool's copies of those it lacks when the pool evicts them: the rest are checked after this read (get
        removes a bad one), so that every bad one is replaced then, not one a request."""
        out = self.tier.get_prefix(keys)
        if len(out) + 1 < len(keys):
            self._check_later(keys[len(out) + 1:])
        return out

    def _check_later(self, keys: list[BlockKey]) -> None:
        """Read (and so check) the blocks of `keys` on the reader thread once it is free; none once closed."""
        try:
            self._reader.submit(lambda: [self.tier.get(key) for key in keys])
        except RuntimeError:        # the reader has stopped (close)
            pass

    def start_load(self, blocks: list[BlockToLoad]) -> Future:
        """Start `read` of the blocks' keys on the reader thread and return at once: its future gives the
        blocks read (finish_load). Once the tier is closed the read is done before it returns."""
        keys = [b.key for b in blocks]
        if self._closed:
            future = Future()
            future.set_running_or_notify_cancel()
            future.set_result(self.read(keys))
        else:
            future = self._reader.submit(self.read, keys)
        self._reads[future] = len(keys)
        return future

    def finish_load(self, future: Future, blocks: list[BlockToLoad]) -> int:
        """Write the blocks a done read (start_load) got into their pool blocks: none if it was cancelled (the
        engine closed), so that their tokens are computed instead. (A file that cannot be read or fails its
        checks ends the blocks read there, in `read`.)"""
        data = self.read_result(future)
        self.load([b.block for b in blocks[:len(data)]], data)
        return len(data)

    def read_result(self, future: Future) -> list[torch.Tensor]:
        """The blocks' bytes a done read (start_load) got: none if it was cancelled."""
        self._reads.pop(future, None)
        return [] if future.cancelled() else future.result()

    def cancel_load(self, future: Future) -> None:
        future.cancel()
        self._reads.pop(future, None)

    def wait_for_load(self, futures: Iterable[Future]) -> None:
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

    def count_admission(self, swap_in: bool, num_loaded: int, hit_tokens: int, miss_tokens: int) -> None:
        if swap_in:
            self.counters.swap_ins += 1
            self.counters.swap_in_blocks += num_loaded
        else:
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
            synchronize(self.device)
            copied = time.perf_counter() - start
            stored, read = self.tier.probe(data)
            start = time.perf_counter()
            self.write_blocks(ids, data)
            synchronize(self.device)
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

    def close(self) -> None:
        """Stop the reader (reads not started are cancelled: their sequences compute those tokens; the one
        under way finishes), write the blocks still in the pool's prefix cache to the tier (so that a
        restart finds them too), wait for the writer, stop it. Idempotent."""
        if self._closed:
            return
        self.pool.on_evict = self.pool.on_cache = None
        self.close_keeping(self.blocks_to_keep())

    def blocks_to_keep(self) -> list[tuple[int, BlockKey]]:
        """The (block, key)s of the pool's prefix cache, where the tier outlives the engine: what close writes."""
        if not self.tier.persistent:
            return []
        return [(b, key) for b, key in enumerate(self.pool.keys) if key is not None]

    def close_keeping(self, keep: list[tuple[int, BlockKey]]) -> None:
        """close, writing the (block, key)s of `keep` (a tensor-parallel worker is given rank 0's
        blocks_to_keep). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._reader.shutdown(wait=True, cancel_futures=True)
        try:
            step = max(1, self.tier.room())      # a batch of pages at a time in host memory
            for i in range(0, len(keep), step):
                self.save(keep[i:i + step], wait=True)
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
