"""The second KV tier under tensor parallelism, as vLLM's KV connectors work there: every rank keeps a tier of its
own, of its own KV heads' pages (under the disk tier's root, a directory keyed by the rank layout: TierCompat's
tp_size and tp_rank, so that an engine of another layout never reads it), and makes its own reads and writes;
rank 0 decides.

Rank 0's ForwardedConnector answers the scheduler from rank 0's tier (what it holds, whether to swap) and has
each worker's WorkerConnector make every save, load and swap on that worker's pages and tier, queued in step order
(Workers.queue): a block the pool evicts is saved by every rank before any rank's next step writes its pages. Every
rank reads a load on a thread of its own; it ends with the leading blocks every rank read (the fewest any read),
so that a block missing or corrupt on any rank has all ranks compute the same tokens again.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable
from concurrent.futures import Future
from itertools import count

import torch

from kvserve.kv.blocks import BlockKey
from kvserve.kv.interface import BlockToLoad
from kvserve.kv.storage import KVStorage
from kvserve.kv.tiers import KVConnector, OffloadingConnector, TierConfig
from kvserve.parallel.workers import WorkerFailure, Workers

log = logging.getLogger(__name__)


class ForwardedConnector(KVConnector):
    """Rank 0's connector under tensor parallelism: `local`, rank 0's own over its tier and pages, answers the
    scheduler; each change it makes is made by every worker too, on a tier of its own built from `tiers`."""

    def __init__(self, local: OffloadingConnector, workers: Workers, tiers: TierConfig):
        self.local, self.workers = local, workers
        self._load_ids: dict[Future, int] = {}      # rank 0's reads -> their load's number on every rank
        self._next_id = count()
        self._closed = False
        workers.queue("connector", "open", (tiers,))      # as they build their pools (Workers.init_cache)
        workers.at_close(self.close)                     # their share of the pool's blocks is written by them

    def save(self, evicted: list[tuple[int, BlockKey]]) -> None:
        """OffloadingConnector.save on every rank (the pool's on_evict): on the workers before their next step."""
        self.workers.queue("connector", "save", (evicted,))
        self.local.save(evicted)

    def commit(self) -> None:
        """A write-through tier's blocks of the step that ran, saved on every rank (OffloadingConnector.commit)."""
        committed = self.local.committed()
        if committed:
            self.save(committed)

    def holds(self, key: BlockKey) -> bool:
        return self.local.holds(key)

    def start_load(self, blocks: list[BlockToLoad]) -> Future:
        """Start the read on every rank: rank 0's now, the workers' with the next message they get."""
        future = self.local.start_load(blocks)
        self._load_ids[future] = load_id = next(self._next_id)
        self.workers.queue("connector", "start_load", (load_id, blocks))
        return future

    def finish_load(self, future: Future, blocks: list[BlockToLoad]) -> int:
        """Write the leading blocks that every rank read into their pool blocks, on every rank: how many. Waits for
        the workers' reads (begun with rank 0's)."""
        load_id = self._load_ids.pop(future)
        data = self.local.read_result(future)
        if data:
            data = data[:min(self.workers.call("connector", "loaded", (load_id,)))]
        block_ids = [b.block for b in blocks[:len(data)]]
        self.local.load(block_ids, data)
        self.workers.queue("connector", "finish_load", (load_id, block_ids))
        return len(data)

    def cancel_load(self, future: Future) -> None:
        self.local.cancel_load(future)
        self.workers.queue("connector", "finish_load", (self._load_ids.pop(future), []))

    def wait_for_load(self, futures: Iterable[Future]) -> None:
        """Send the workers the reads queued for them (no step will before this returns), then wait for rank 0's."""
        self.workers.send_ops()
        self.local.wait_for_load(futures)

    def should_swap(self, keys: list[BlockKey]) -> bool:
        return self.local.should_swap(keys)

    def swap_out(self, blocks: list[tuple[int, BlockKey]]) -> None:
        """OffloadingConnector.swap_out on every rank: on the workers before their next step."""
        self.workers.queue("connector", "swap_out", (blocks,))
        self.local.swap_out(blocks)

    def count_admission(self, swap_in: bool, num_loaded: int, hit_tokens: int, miss_tokens: int) -> None:
        self.local.count_admission(swap_in, num_loaded, hit_tokens, miss_tokens)

    def count_recompute(self) -> None:
        self.local.count_recompute()

    def stats(self) -> dict:
        """Rank 0's tier's counters (every rank's tier holds, writes and reads the same blocks, but where one fails)."""
        return self.local.stats()

    def close(self) -> None:
        """Every rank writes its share of the pool's cached blocks to its tier and stops it, the workers first (where
        they are gone, rank 0 alone). Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.workers.call("connector", "close", (self.local.blocks_to_keep(),))
        except WorkerFailure as e:
            log.warning("kv_offload: the workers' tiers were not closed (%s): they keep what they had written", e)
        self.local.close()


class WorkerConnector:
    """A worker's side of the tier: its own tier (built by `open`) over its own pages, with no pool of its own. Each
    method makes a change rank 0's ForwardedConnector made, on the blocks it names."""

    def __init__(self, rank: int, storage: KVStorage, device: torch.device):
        self.rank, self.storage, self.device = rank, storage, device
        self.offload: OffloadingConnector | None = None
        self.loads: dict[int, Future] = {}      # by rank 0's number

    def open(self, tiers: TierConfig) -> None:
        self.offload = OffloadingConnector(tiers.build(self.rank), None, self.storage.read_blocks,
                                           self.storage.write_blocks, self.device)

    def save(self, evicted: list[tuple[int, BlockKey]]) -> None:
        self.offload.save(evicted)

    def swap_out(self, blocks: list[tuple[int, BlockKey]]) -> None:
        self.offload.swap_out(blocks)

    def start_load(self, load_id: int, blocks: list[BlockToLoad]) -> None:
        self.loads[load_id] = self.offload.start_load(blocks)

    def loaded(self, load_id: int) -> int:
        """How many leading blocks of the load this rank read, once its read is done."""
        future = self.loads[load_id]
        return 0 if future.cancelled() else len(future.result())

    def finish_load(self, load_id: int, block_ids: list[int]) -> None:
        """Write the first len(block_ids) blocks read into `block_ids` (none: the load is dropped)."""
        future = self.loads.pop(load_id)
        if not block_ids:
            self.offload.cancel_load(future)
            return
        self.offload.load(block_ids, self.offload.read_result(future)[:len(block_ids)])

    def close(self, keep: list[tuple[int, BlockKey]]) -> None:
        """Write rank 0's blocks_to_keep from this rank's pages, and stop the tier."""
        self.offload.close_keeping(keep)
