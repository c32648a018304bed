"""Evictor: carries out the sequences' eviction policies after each step, on whole blocks.

sink drops the blocks that left the window. Its sink blocks keep their keys rotated for the
positions they were computed at, so once tokens are dropped they are copied next to the window:
the original blocks stay pinned to the sequence, and a working copy, rotated by the number of
evicted tokens (one exact rotation from the original, never a rotation of a rotation), takes
their place in the table. With RoPE only relative positions matter, so this is StreamingLLM's
"positions within the cache". h2o and snapkv pick tokens and compact them into fresh blocks; a
block that others share (prefix cache, forks) is never written, only let go of. The kept tokens keep their
keys as computed, rotated for their own positions, and the queries theirs: every distance stays true.

Sliding-window layers attend to the last W cache slots. Every policy keeps its most recent tokens (at
least the widest W: the engine refuses less), so those slots stay the last W positions and the layers
compute as without eviction. Where such windows bind, h2o and snapkv score tokens by the attention of the
full-attention layers alone (a sliding layer's says nothing of the tokens before its window) and evict
whole blocks' worth of tokens (`whole_blocks`), with one block table for every layer or one per group alike.

With the hybrid KV cache (kv/groups.py), sink evicts and pins in the full-attention layer groups; a
sliding group's entries it drops are the null block already (they left the group's window first), so
every group's table keeps holding the same cached tokens at the same entries. h2o and snapkv compact the
full-attention groups; a sliding group drops as many leading entries as whole blocks were evicted (the
null block) and keeps its window's blocks as they are.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.engine.sequence import Sequence
from kvserve.kv.blocks import NoFreeBlocksError
from kvserve.kv.eviction import H2O, Sink, SnapKV
from kvserve.kv.interface import KVCache
from kvserve.kv.storage import KVStorage
from kvserve.model.decoder import CausalLM
from kvserve.model.layers import apply_rope_


@dataclass
class KeyRotation:
    """Rotate keys [..., head_dim] in place by one position's RoPE (cos, signed sin [head_dim]), in float32: a
    callable that pickles, so that a tensor-parallel engine sends it to every rank."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __call__(self, keys: torch.Tensor) -> None:
        rotated = keys.float()
        apply_rope_(rotated, self.cos, self.sin)
        keys.copy_(rotated)


class Evictor:
    """`whole_blocks`: h2o and snapkv evict a multiple of the block size (a model with sliding windows that bind:
    its sliding groups' blocks shift by whole table entries)."""

    def __init__(self, kv: KVCache, storage: KVStorage, model: CausalLM, whole_blocks: bool = False):
        self.kv, self.storage, self.model = kv, storage, model
        self.whole_blocks = whole_blocks
        self.num_evicted_tokens = 0

    def after_step(self, seqs: list[Sequence], attention_mass: dict[int, torch.Tensor]) -> None:
        """Once the step's tokens are committed: add their attention mass, then evict what is due."""
        for row, seq in enumerate(seqs):
            policy = seq.eviction
            if policy is None:
                continue
            if row in attention_mass:
                self._add_scores(seq, attention_mass[row])
            try:
                if isinstance(policy, Sink):
                    self._sink(seq, policy)
                elif isinstance(policy, H2O):
                    keep = policy.keep(self._token_scores(seq), self.kv.block_size, self.whole_blocks)
                    if keep is not None:
                        self._compact(seq, keep)
                elif isinstance(policy, SnapKV) and not seq.prompt_compacted \
                        and seq.num_computed_tokens >= seq.num_prompt_tokens:
                    keep = policy.keep(self._token_scores(seq), self.kv.block_size, self.whole_blocks)
                    if keep is not None:
                        self._compact(seq, keep)
                    seq.prompt_compacted, seq.kv_scores = True, None
            except NoFreeBlocksError:
                # the copies need fresh blocks first: the cache stays as it is until a later step
                continue

    @staticmethod
    def _scores(seq: Sequence, width: int) -> torch.Tensor:
        """The sequence's mass [layers * KVH, width]: tokens never scored have 0."""
        return F.pad(seq.kv_scores, (0, width - seq.kv_scores.shape[1]))

    def _token_scores(self, seq: Sequence) -> torch.Tensor:
        """Each cached token's score: its mass summed over layers and KV heads."""
        if seq.kv_scores is None:
            return torch.zeros(seq.num_tokens_in_cache)
        return self._scores(seq, seq.num_tokens_in_cache).sum(0)

    def _add_scores(self, seq: Sequence, mass: torch.Tensor) -> None:
        """Combine a step's mass [layers * KVH, context] into the sequence's, as its policy reduces."""
        if seq.kv_scores is None:
            seq.kv_scores = mass
            return
        scores = self._scores(seq, mass.shape[1]).to(mass.device)
        seq.kv_scores = torch.maximum(scores, mass) if seq.eviction.mass_reduce == "max" else scores + mass

    def _sink(self, seq: Sequence, policy: Sink) -> None:
        bs = self.kv.block_size
        drop = policy.blocks_to_drop(seq.num_tokens_in_cache, bs)
        if not drop:
            return
        sink_blocks = policy.sink_blocks(bs)
        if sink_blocks and not self.kv.pinned.get(seq.seq_id):
            self.kv.replace(seq.seq_id, range(sink_blocks), pin=True)
        elif sink_blocks:
            # a fork shares its parent's working copies, and its evictions may come at other steps (speculative
            # decoding accepts drafts at each sample's own pace): each rotates copies of its own
            self.kv.unshare(seq.seq_id, range(sink_blocks))
        self.kv.drop(seq.seq_id, drop)
        seq.num_evicted_tokens += len(drop) * bs
        self.num_evicted_tokens += len(drop) * bs
        if sink_blocks:
            self._rotate_sinks(seq, sink_blocks)

    def _rotate_sinks(self, seq: Sequence, sink_blocks: int) -> None:
        """The working sink blocks := the originals with keys rotated forward by the evicted count (the
        full-attention layers' RoPE: only they read the sinks)."""
        originals = self.kv.pinned.get(seq.seq_id)
        if not originals:       # a hybrid cache of sliding layer groups alone: no layer reads the sinks
            return
        delta = seq.num_evicted_tokens
        self.model.ensure_rope(delta + 1)
        cos, sin = self.model.rope(torch.tensor([delta], device=self.model.rope.cos.device), torch.float32)
        working = self.kv.leading_blocks(seq.seq_id, sink_blocks)
        self.storage.rotate_keys(originals, working, KeyRotation(cos[0, 0], sin[0, 0]))

    def _compact(self, seq: Sequence, keep: torch.Tensor) -> None:
        """Copy the kept tokens, in order, into fresh blocks (each full-attention group's, in a hybrid cache); the
        old ones are let go of."""
        scores = self._scores(seq, seq.num_tokens_in_cache)[:, keep] if seq.kv_scores is not None else None
        tables = self.kv.rebuild(seq.seq_id, len(keep))
        kept = keep.to(self.storage.device)
        for old, new in tables:
            self.storage.rewrite(old, kept, new)
        self.kv.release([b for old, _ in tables for b in old])
        evicted = seq.num_tokens_in_cache - len(keep)
        seq.num_evicted_tokens += evicted
        self.num_evicted_tokens += evicted
        seq.kv_scores = scores
