"""StructuredOutputManager: the requests' grammars and each step's token masks (vLLM v1's structured output
manager). A step's masks depend only on tokens sampled before it and on the drafts it verifies, so they are
computed in a thread of their own while the model runs, and the sampler (or the rejection sampler, for the rows of
a verification) adds them to the logits."""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from kvserve.engine.sequence import Sequence
from kvserve.sampling import SamplingParams, TokenMask
from kvserve.structured.backend import GuidanceCompiler
from kvserve.structured.grammar import NO_GRAMMAR, Grammar

# a byte of a bitmask (bit i: token 8k + i allowed) -> the 8 tokens' biases: 0 allowed, -inf not
_BYTE_BIAS = np.where(np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little"),
                      0.0, -np.inf).astype(np.float32)


@dataclass
class MaskJob:
    """The masks of a step's constrained sequences, under way: each one's rows start at `index[seq_id]`, the row
    after its last token, then (speculative decoding) one after each of its drafts."""

    future: Future | None = None          # -> torch.Tensor [rows, vocab]: 0 or -inf
    index: dict[int, int] = field(default_factory=dict)
    bias: torch.Tensor | None = None      # the future's result, once waited for


class StructuredOutputManager:
    """Compiles each request's constraint when the engine takes it (cached by constraint; the grammar engine is
    set up at the first request that asks, reading the vocabulary takes a while) and computes the masks of each
    step's constrained sequences off the critical path. `stats` counts the masks computed while the model ran
    and those computed after it (samples forked in the step), and the seconds spent filling them and waiting
    for them."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: set[int]):
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, eos_token_ids
        self.words = (vocab_size + 31) // 32          # int32 words of a bitmask row
        self._compiler: GuidanceCompiler | None = None
        self._thread: ThreadPoolExecutor | None = None
        self.num_overlapped = self.num_inline = 0
        self.fill_seconds = self.wait_seconds = 0.0

    def grammar(self, params: SamplingParams) -> Grammar:
        """The grammar a new request's sequence starts with (NO_GRAMMAR without structured outputs); ValueError
        naming structured_outputs for a constraint that does not compile, or an engine without a tokenizer."""
        if params.structured_outputs is None:
            return NO_GRAMMAR
        if self.tokenizer is None:
            raise ValueError("structured_outputs need the tokenizer, and this engine runs without one "
                             "(skip_tokenizer_init)")
        if self._compiler is None:
            self._compiler = GuidanceCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self._compiler.grammar(params.structured_outputs)

    def start_masks(self, seqs: list[Sequence]) -> MaskJob:
        """Start computing the masks of the constrained sequences among a step's `seqs`, in the manager's thread:
        for each, the row after its last token and those after each of its drafts (speculative decoding). Their
        grammars are not advanced until `masks` and `draft_masks` have returned them."""
        constrained = [s for s in seqs if s.grammar.constrains]
        if not constrained:
            return MaskJob()
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="kvserve-grammar")
        index, rows = {}, 0
        for seq in constrained:
            index[seq.seq_id] = rows
            rows += 1 + len(seq.spec_token_ids)
        self.num_overlapped += rows
        jobs = [(s.grammar, list(s.spec_token_ids)) for s in constrained]
        return MaskJob(self._thread.submit(self._bias, jobs, rows), index)

    def masks(self, job: MaskJob, seqs: list[Sequence]) -> TokenMask | None:
        """The masks of the constrained sequences among the step's sampling `seqs`, by row: the job's, and those of
        samples forked in the step (computed now); None where no sequence is constrained."""
        rows = [i for i, s in enumerate(seqs) if s.grammar.constrains]
        if not rows:
            return None
        parts = [self.wait(job)] if job.future is not None else []
        index = dict(job.index)
        late = [seqs[i] for i in rows if seqs[i].seq_id not in index]
        if late:
            self.num_inline += len(late)
            first = len(parts[0]) if parts else 0
            index.update({s.seq_id: first + k for k, s in enumerate(late)})
            parts.append(self._bias([(s.grammar, []) for s in late], len(late)))
        bias = parts[0] if len(parts) == 1 else torch.cat(parts)
        picks = [index[seqs[i].seq_id] for i in rows]
        return TokenMask(rows, bias if picks == list(range(len(bias))) else bias[picks])

    def draft_masks(self, job: MaskJob, seqs: list[Sequence]) -> TokenMask | None:
        """The masks of a verification's rows, where their sequence is constrained: each of `seqs` has in turn the
        row after its last token, then one after each of its drafts (Sequence.spec_token_ids, as `start_masks`
        saw them); None where no sequence is constrained."""
        rows, picks, at = [], [], 0
        for seq in seqs:
            n = 1 + len(seq.spec_token_ids)
            if seq.grammar.constrains:
                rows += range(at, at + n)
                picks += range(job.index[seq.seq_id], job.index[seq.seq_id] + n)
            at += n
        return TokenMask(rows, self.wait(job)[picks]) if rows else None

    def wait(self, job: MaskJob) -> torch.Tensor | None:
        """The job's masks, waited for (once); None for a job of no sequence. Until the job is done its grammars are
        the mask thread's: nothing else may read or advance them (verify, fork samples, sample, propose)."""
        if job.future is not None and job.bias is None:
            start = time.perf_counter()
            job.bias = job.future.result()
            self.wait_seconds += time.perf_counter() - start
        return job.bias

    def _bias(self, jobs: list[tuple[Grammar, list[int]]], rows: int) -> torch.Tensor:
        """[rows, vocab] float32: 0 where a grammar allows the token, -inf where it does not; each grammar's rows
        in turn, the next token's and those after each of its drafts."""
        start = time.perf_counter()
        bitmask = torch.empty(rows, self.words, dtype=torch.int32)
        row = 0
        for grammar, drafts in jobs:
            grammar.fill_bitmask(bitmask, row, drafts)
            row += 1 + len(drafts)
        bits = bitmask.numpy().view(np.uint8)         # little-endian: byte k of a word holds its tokens 8k..8k+7
        bias = np.take(_BYTE_BIAS, bits, axis=0).reshape(rows, -1)[:, :self.vocab_size]
        self.fill_seconds += time.perf_counter() - start
        return torch.from_numpy(bias)

    def stats(self) -> dict:
        compiled = self._compiler.stats() if self._compiler is not None else {
            "grammars_cached": 0, "grammar_cache_hits": 0, "grammar_cache_misses": 0}
        return {**compiled, "grammar_masks_overlapped": self.num_overlapped, "grammar_masks_inline": self.num_inline,
                "grammar_mask_fill_seconds": self.fill_seconds, "grammar_mask_wait_seconds": self.wait_seconds}
