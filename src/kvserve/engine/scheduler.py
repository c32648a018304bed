"""Continuous batching: pack decodes and prefills into one token budget, admit by free blocks, preempt."""
from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

from kvserve.config import SchedulerConfig
from kvserve.engine.sequence import Sequence, SequenceStatus
from kvserve.kv import NO_HIT, BlockKey, BlockToLoad, KVCache
from kvserve.kv.tiers import KVConnector, NoConnector


@dataclass
class SchedulerOutput:
    """The sequences of one step, decodes first, and how many new tokens each computes: of a decode that verifies
    speculative drafts, its one new token and the last num_spec_tokens, its drafts (Sequence.spec_token_ids)."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    num_decodes: int = 0
    num_spec_tokens: list[int] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.seqs

    def add(self, seq: Sequence, n: int, num_spec: int = 0) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(n)
        self.num_spec_tokens.append(num_spec)


@dataclass
class TierLoad:
    """A sequence admitted over blocks of the second tier while they are read (WAITING_FOR_REMOTE_KVS): its
    table (each layer group's) holds the prefix of `keys`, in the pool's hits and in a fresh block for each
    of `blocks`."""

    seq: Sequence
    keys: list[BlockKey]                  # the prefix's blocks
    blocks: list[BlockToLoad]             # those the tier holds, each in a fresh block of the pool
    future: Future                # -> the leading ones read and checked (KVConnector.start_load)
    num_missed: int               # full blocks after the prefix, found in neither the pool nor the tier
    first_query: bool             # the sequence's first prefix lookup: its hits count in num_cached_tokens
    swap_in: bool                 # the resumption of a sequence swapped out


class Scheduler:
    """Holds the waiting queue and the running list, over the engine's KV cache (NoKVCache where the engine
    keeps none); a prefix lookup goes on in the second tier (`connector`) past the pool's hits, and a sequence
    with blocks there waits in `loading` while they are read: the running ones step meanwhile, and it joins
    them once its blocks are in the pool."""

    def __init__(self, config: SchedulerConfig, kv: KVCache, watermark: float = 0.01,
                 enable_prefix_caching: bool = False, connector: KVConnector | None = None):
        self.config = config
        self.kv = kv
        self.prefix_caching = enable_prefix_caching
        # without prefix caching nothing is looked up, in the pool or the tier
        self.connector = connector if enable_prefix_caching and connector is not None else NoConnector()
        self.watermark_blocks = int(watermark * kv.num_blocks)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.loading: dict[int, TierLoad] = {}     # by seq_id, in the order of admission
        self.num_preemptions = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    def schedule(self) -> SchedulerOutput:
        """The next step's sequences and tokens. Sequences whose tier blocks are read join the running
        ones first; when nothing can run while blocks are being read, waits for a read rather than return
        an empty step (the engine has nothing else to do)."""
        while True:
            self._finish_loads()
            out = self._schedule()
            if not out.empty or not self.loading:
                return out
            self.connector.wait_for_load(load.future for load in self.loading.values())

    def _schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        # Decodes before the chunks of long prompts, so that a long prompt never stalls the streams.
        running = sorted(self.running, key=lambda s: s.num_tokens - s.num_computed_tokens > 1)
        preempted = False
        for seq in running:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:    # preempted earlier in this loop
                continue
            n = self._num_new_tokens(seq, seq.num_computed_tokens, budget)
            if not n:
                continue
            num_spec = self._num_drafts(seq, n, budget)
            if not self._reserve(seq, n + num_spec, out, num_spec):
                preempted = True
                continue
            out.add(seq, n + num_spec, num_spec)
            budget -= n + num_spec
        if not preempted:
            self._admit(out, budget)
        is_decode = [self._is_decode(*a) for a in zip(out.seqs, out.num_new_tokens, out.num_spec_tokens)]
        order = sorted(range(len(out.seqs)), key=lambda i: not is_decode[i])
        out.seqs = [out.seqs[i] for i in order]
        out.num_new_tokens = [out.num_new_tokens[i] for i in order]
        out.num_spec_tokens = [out.num_spec_tokens[i] for i in order]
        out.num_decodes = sum(is_decode)
        return out

    @staticmethod
    def _is_decode(seq: Sequence, n: int, num_spec: int = 0) -> bool:
        """One new token after computed ones, and its drafts (never where the cache keeps nothing: nothing stays
        computed)."""
        return n - num_spec == 1 and seq.num_computed_tokens > 0

    def _num_drafts(self, seq: Sequence, n: int, budget: int) -> int:
        """How many of a running sequence's drafts this step verifies after its one new token: as many as the token
        budget and the free blocks take (a draft never preempts anyone), none unless the step is the sequence's
        decode. The drafts not taken are dropped: they are the tail of a guess."""
        k = len(seq.spec_token_ids) if n == 1 == seq.num_tokens - seq.num_computed_tokens else 0
        k = min(k, budget - n)
        while k and self.kv.num_new_blocks(seq.seq_id, seq.num_tokens_in_cache, n + k) > self.kv.num_free_blocks:
            k -= 1
        if k < len(seq.spec_token_ids):
            seq.spec_token_ids = seq.spec_token_ids[:k]
        return k

    def _num_new_tokens(self, seq: Sequence, num_computed: int, budget: int) -> int:
        """The tokens after the first num_computed that the sequence computes this step, within budget: at most
        long_prefill_token_threshold; with a cache that keeps nothing, all of them or none (it waits)."""
        n = seq.num_tokens - num_computed
        if self.kv.recomputes:
            return n if n <= budget else 0
        return min(n, budget, self.config.long_prefill_token_threshold)

    def _reserve(self, seq: Sequence, n: int, out: SchedulerOutput, num_spec: int = 0) -> bool:
        """Blocks for n more tokens of a running sequence, preempting the newest others if needed; the full blocks
        of all but its last num_spec (drafts, not yet verified) indexed."""
        while (needed := self.kv.num_new_blocks(seq.seq_id, seq.num_tokens_in_cache, n)) > self.kv.num_free_blocks:
            victim = next(s for s in reversed(self.running) if s is seq or s not in out.seqs)
            self.preempt(victim, swap=self._should_swap(victim))
            if victim is seq:
                return False
        if needed:       # most decode steps write into the last block, theirs alone: nothing to take
            out.block_copies += self.kv.allocate(seq.seq_id, seq.num_tokens_in_cache, n)
        self._cache_full_blocks(seq, seq.num_computed_tokens + n - num_spec)
        return True

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if self._slots_in_use() + self._slots(seq) > self.config.max_num_seqs:
                break
            n = self._allocate_for_admission(seq, budget, out)
            if not n:
                break
            self.waiting.popleft()
            if seq.status is SequenceStatus.WAITING_FOR_REMOTE_KVS:
                continue        # joins a later step, once its blocks are read (_finish_loads)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.add(seq, n)
            budget -= n

    @staticmethod
    def _slots(seq: Sequence) -> int:
        """Running sequences this one becomes: a prompt not yet sampled forks into its n samples."""
        return seq.params.n if seq.num_output_tokens == 0 else 1

    def _slots_in_use(self) -> int:
        return sum(self._slots(s) for s in self.running) + sum(self._slots(t.seq) for t in self.loading.values())

    def _allocate_for_admission(self, seq: Sequence, budget: int, out: SchedulerOutput) -> int:
        """Share the cached prefix and allocate the first chunk's blocks, if they fit (counting the blocks
        the second tier holds of the prefix as computed): the chunk's tokens, or 0. A sequence with blocks
        in the tier takes fresh blocks for them and waits while they are read (WAITING_FOR_REMOTE_KVS); its
        chunk is scheduled once they are (_finish_loads)."""
        kv, bs = self.kv, self.kv.block_size
        keys = self._prefix_keys(seq)
        hit = kv.lookup(keys, self.connector.holds) if keys else NO_HIT
        num_hit = hit.num_blocks
        n = self._num_new_tokens(seq, num_hit * bs, budget)
        reserve = self.watermark_blocks if self.running or self.loading else 0
        if not n or kv.num_admit_blocks(hit, num_hit * bs + n) + reserve > kv.num_free_blocks:
            return 0
        blocks = kv.share_prefix(seq.seq_id, hit)
        num_pool_hit = num_hit - len({b.index for b in blocks})     # prefix blocks none of whose pages loads
        # counted once: recomputation after preemption is no hit; a cache that keeps nothing is not looked up
        first_query = not seq.prefix_queried and not kv.recomputes
        if first_query:
            seq.prefix_queried = True
            seq.num_cached_tokens = num_hit * bs
            self.prefix_cache_queries += seq.num_prompt_tokens
            self.prefix_cache_hits += num_pool_hit * bs
        swap_in, seq.num_swapped_blocks = bool(seq.num_swapped_blocks), 0
        seq.num_indexed_blocks, seq.num_computed_tokens = num_hit, num_hit * bs
        if blocks:
            seq.status = SequenceStatus.WAITING_FOR_REMOTE_KVS
            future = self.connector.start_load(blocks)
            self.loading[seq.seq_id] = TierLoad(seq, keys[:num_hit], blocks, future, len(keys) - num_hit,
                                                first_query, swap_in)
            return n
        self.connector.count_admission(swap_in, 0, 0, (len(keys) - num_hit) * bs)
        out.block_copies += kv.allocate(seq.seq_id, num_hit * bs, n)
        self._cache_full_blocks(seq, num_hit * bs + n)
        return n

    def _finish_loads(self) -> None:
        """Each sequence whose tier reads are done joins the running ones, in the order they were admitted."""
        for seq_id in [i for i, load in self.loading.items() if load.future.done()]:
            self._finish_load(self.loading.pop(seq_id))

    def _finish_load(self, load: TierLoad) -> None:
        """Write the blocks read into the sequence's fresh blocks and index them (ordinary cached blocks
        from now on). A block that failed its checks (or vanished) ends the blocks read there: the sequence
        starts from the longest prefix it has whole (kv.usable_prefix), the blocks after it return to the
        pool, and their tokens are computed."""
        seq, kv, bs = load.seq, self.kv, self.kv.block_size
        num_loaded = self.connector.finish_load(load.future, load.blocks)
        missing = [(b.group, b.index) for b in load.blocks[num_loaded:]]
        num_hit = kv.usable_prefix(seq.seq_id, len(load.keys), missing)
        kv.truncate(seq.seq_id, num_hit)
        kv.cache_blocks(seq.seq_id, 0, load.keys[:num_hit])     # the pool's hits are indexed already
        seq.num_indexed_blocks, seq.num_computed_tokens = num_hit, num_hit * bs
        if load.first_query:
            seq.num_cached_tokens = num_hit * bs
        num_tier_hit = len({b.index for b in load.blocks[:num_loaded] if b.index < num_hit})
        num_missed = len(load.keys) - num_hit + load.num_missed
        self.connector.count_admission(load.swap_in, num_loaded, num_tier_hit * bs, num_missed * bs)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def _prefix_keys(self, seq: Sequence) -> list[BlockKey]:
        """Keys of the leading full blocks a prefix hit may cover (none without prefix caching)."""
        if not self.prefix_caching:
            return []
        # At least the last token is computed again: its logits are needed to sample. A request that
        # scores its prompt only skips tokens it has already scored (before a preemption).
        limit = seq.num_tokens - 1
        if seq.prompt_logprobs is not None:
            limit = min(limit, len(seq.prompt_logprobs) - 1)
        return seq.full_block_keys(self.kv.block_size, limit)

    def _cache_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Index the blocks this step fills, now: a request admitted later in the same step can share
        them, since every layer writes the step's K/V before any sequence attends."""
        bs = self.kv.block_size
        # once a sequence evicted, its blocks no longer hold the tokens their keys name
        if self.prefix_caching and not seq.num_evicted_tokens and num_tokens // bs > seq.num_indexed_blocks:
            keys = seq.full_block_keys(bs, num_tokens)
            self.kv.cache_blocks(seq.seq_id, seq.num_indexed_blocks, keys[seq.num_indexed_blocks:])
            seq.num_indexed_blocks = len(keys)

    def forget_uncomputed(self, out: SchedulerOutput) -> None:
        """The step failed: drop from the prefix index the blocks it was to fill."""
        if not self.prefix_caching:
            return
        bs = self.kv.block_size
        for seq in out.seqs:
            if seq.num_evicted_tokens:
                continue
            computed = seq.num_computed_tokens // bs
            if seq.num_indexed_blocks > computed and self.kv.holds(seq.seq_id):
                self.kv.uncache_blocks(seq.seq_id, computed, seq.block_keys[computed:seq.num_indexed_blocks])
                seq.num_indexed_blocks = computed

    def commit(self, out: SchedulerOutput) -> None:
        """After the model ran: advance each sequence past the tokens it computed (where the cache keeps them), a
        verification past its one new token only: its drafts' K/V are written, and `advance` takes each accepted
        one in turn (release_rejected lets the others go)."""
        self.connector.commit()
        if self.kv.recomputes:
            return
        for seq, n, num_spec in zip(out.seqs, out.num_new_tokens, out.num_spec_tokens):
            self.kv.release_past_window(seq.seq_id, seq.num_tokens_in_cache + n - num_spec)
            seq.num_computed_tokens += n - num_spec

    def release_rejected(self, seq: Sequence, num_accepted: int) -> None:
        """A verification accepted the first num_accepted of the sequence's drafts: the blocks past them return to the
        pool (at the front of its free queue: they hold no prefix), so that its tables hold what plain decoding of
        the same tokens holds. The accepted drafts' K/V stay; `advance` takes each as its token is appended."""
        self.kv.truncate(seq.seq_id, self.kv.blocks_for(seq.num_tokens_in_cache + num_accepted))

    def reserve_ahead(self, out: SchedulerOutput, steps: int) -> bool:
        """Blocks for `steps` tokens of each of a step's decodes (the first already reserved), if the pool has
        them all free; else nothing changes."""
        kv = self.kv
        if sum(kv.num_new_blocks(s.seq_id, s.num_tokens_in_cache, steps) for s in out.seqs) > kv.num_free_blocks:
            return False
        for seq in out.seqs:
            out.block_copies += kv.allocate(seq.seq_id, seq.num_tokens_in_cache, steps)
        return True

    def advance(self, seq: Sequence) -> None:
        """A decode of several steps at once, or a verification, computed one more token (the last step's, or an
        accepted draft): as commit, and the blocks it filled indexed, as schedule indexes a step's (their K/V are
        written: KVConnector.commit)."""
        self.kv.release_past_window(seq.seq_id, seq.num_tokens_in_cache + 1)
        seq.num_computed_tokens += 1
        self._cache_full_blocks(seq, seq.num_computed_tokens)
        self.connector.commit()

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Run `child`, forked from the running `parent` (Sequence.fork), over the parent's blocks, shared."""
        self.kv.fork(parent.seq_id, child.seq_id)
        self.running.append(child)

    def _should_swap(self, seq: Sequence) -> bool:
        """Whether preempting `seq` swaps its full blocks out to the second tier (KVConnector.should_swap)
        rather than leaving them to be recomputed. Never for a sequence that evicted tokens: its blocks no
        longer hold what their keys name."""
        if seq.num_evicted_tokens:
            return False
        keys = seq.full_block_keys(self.kv.block_size, seq.num_computed_tokens)
        return self.connector.should_swap([key for _, key in self.kv.keyed_blocks(seq.seq_id, keys)])

    def preempt(self, seq: Sequence, swap: bool = False) -> None:
        """Free a running sequence's blocks and requeue it at the front: to be recomputed, or with `swap`,
        after its full blocks are written to the second tier, to read them back when it resumes."""
        if swap:
            keys = seq.full_block_keys(self.kv.block_size, seq.num_computed_tokens)
            self.connector.swap_out(self.kv.keyed_blocks(seq.seq_id, keys))
            seq.num_swapped_blocks = len(keys)
        else:
            self.connector.count_recompute()
        self.running.remove(seq)
        self.kv.free(seq.seq_id)
        seq.reset_cache_state()
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark a sequence finished and return its blocks at once (also used for aborts)."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.WAITING_FOR_REMOTE_KVS:
            self.connector.cancel_load(self.loading.pop(seq.seq_id).future)
        self.kv.free(seq.seq_id)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
