"""OutputProcessor: sampled tokens in, RequestOutputs out (vLLM v1's output processor): each token appended to its
sequence, stops (stop tokens, stop strings, lengths), incremental detokenization, logprobs, the fork of a request's
n samples once its prompt is computed, and the requests' records until they are reported finished."""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import torch

from kvserve.engine.detokenizer import Detokenizer
from kvserve.engine.scheduler import Scheduler, SchedulerOutput
from kvserve.engine.sequence import Sequence
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.sampling import Logprob, seeded_generator, token_logprobs


class OutputProcessor:
    """`requests`: each request's sequences (its n samples) until it is reported finished; `final_only`: the requests
    reported only then (vLLM's FINAL_ONLY output kind, for offline batches), a set the executors read too."""

    def __init__(self, tokenizer, eos_token_ids: set[int], max_model_len: int, scheduler: Scheduler,
                 final_only: set[str], device: torch.device, seq_ids: Iterator[int]):
        self.tokenizer, self.detokenize = tokenizer, Detokenizer(tokenizer)
        self.eos_token_ids, self.max_model_len = eos_token_ids, max_model_len
        self.scheduler, self.final_only, self.device, self.seq_ids = scheduler, final_only, device, seq_ids
        self.requests: dict[str, list[Sequence]] = {}
        # called with (seqs, logits, spans) of each step's scored prompt tokens: for evaluations that need whole
        # distributions (KL divergence), not just the logprobs a request returns
        self.prompt_logits_hook: Callable[[list[Sequence], torch.Tensor, list], None] | None = None

    def add(self, seq: Sequence, final_only: bool) -> None:
        """Record a new request (its first sequence)."""
        self.requests[seq.request_id] = [seq]
        if final_only:
            self.final_only.add(seq.request_id)

    def pop(self, request_id: str) -> list[Sequence]:
        """Forget a request (aborted): its sequences."""
        self.final_only.discard(request_id)
        return self.requests.pop(request_id, [])

    # ---- a step's tokens --------------------------------------------------------------------

    def fork_samples(self, seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        """Fork requests with n > 1 whose prompt is now computed: the n samples share its blocks. The children join
        `seqs`, with a copy of their parent's logits row to draw their first token."""
        rows = []
        for i, seq in enumerate(list(seqs)):
            if seq.params.n > 1 and seq.num_output_tokens == 0 and len(self.requests[seq.request_id]) == 1:
                for child in self._fork(seq):
                    seqs.append(child)
                    rows.append(i)
        return torch.cat((logits, logits[rows])) if rows else logits

    def _fork(self, parent: Sequence) -> list[Sequence]:
        group = self.requests[parent.request_id]
        for index in range(1, parent.params.n):
            child = parent.fork(next(self.seq_ids), seeded_generator(parent.params, index, self.device))
            self.scheduler.fork(parent, child)
            group.append(child)
        return group[1:]

    def score_prompts(self, seqs: list[Sequence], logits: torch.Tensor, spans) -> None:
        """Append the logprobs of prompt tokens computed this step (prompt_logprobs)."""
        if self.prompt_logits_hook is not None:
            self.prompt_logits_hook(seqs, logits, spans)
        targets, ks = [], []
        for row, first, num in spans:
            targets += seqs[row].token_ids[first:first + num]
            ks += [seqs[row].params.prompt_logprobs] * num
        entries = iter(token_logprobs(logits, targets, ks))
        for row, _, num in spans:
            seqs[row].prompt_logprobs += [self._logprob_dict(next(entries)) for _ in range(num)]

    def _logprob_dict(self, entry: dict[int, tuple[float, int]]) -> dict[int, Logprob]:
        """Logprobs by token id, with each token's text (None without a tokenizer)."""
        tok = self.tokenizer
        return {t: Logprob(lp, rank, None if tok is None else tok.decode([t])) for t, (lp, rank) in entry.items()}

    def append(self, seq: Sequence, token: int, logprobs) -> None:
        """A sampled token (with its logprobs, if asked for): the sequence stops at a stop token, a stop string its
        text completes, max_tokens or max_model_len (not under a policy whose cache holds a bounded window). Its
        grammar takes the token; a token the grammar refuses (drawn where the request's other options forbade every
        token the grammar allows) is dropped, and the sequence aborted."""
        if not seq.grammar.accept(token):
            return self._finish(seq, "abort")
        seq.token_ids.append(token)
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
        if logprobs is not None:
            seq.logprobs.append(self._logprob_dict(logprobs))
        p = seq.params
        if (not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_set:
            if p.include_stop_str_in_output and not self._text_deferred(seq):
                self.detokenize(seq)
            return self._finish(seq, "stop", token)
        if not self._text_deferred(seq):
            delta = self.detokenize(seq)
            # before min_tokens no stop string ends the text (vLLM's)
            if p.stop and delta and seq.num_output_tokens > p.min_tokens and self._stop_string(seq, len(delta)):
                return None
        bounded = seq.eviction is not None and seq.eviction.bounds_context
        if seq.num_output_tokens >= seq.max_tokens or (seq.num_tokens >= self.max_model_len and not bounded):
            self._finish(seq, "length")

    def append_tokens(self, seq: Sequence, tokens: list[int], logprobs: list) -> None:
        """A verification's tokens of one sequence (its accepted drafts, then the token after them): taken as plain
        decoding would take them, each computed token advancing the sequence (Scheduler.advance) before the next is
        appended, up to the one that ends it; the rest are dropped with its blocks."""
        for i, (token, lp) in enumerate(zip(tokens, logprobs)):
            if seq.is_finished:
                return
            if i:
                self.scheduler.advance(seq)
            self.append(seq, token, lp)

    def append_steps(self, sched: SchedulerOutput, tokens: list[list[int]]) -> list[RequestOutput]:
        """The tokens [steps][sequences] of several greedy decode steps run at once: each sequence takes them as
        one step at a time would, up to the one that ends it (a stop token or string); the rest are dropped with
        its blocks. The outputs of the requests that gained tokens."""
        for i, row in enumerate(tokens):
            for seq, token in zip(sched.seqs, row):
                if not seq.is_finished:
                    if i:
                        self.scheduler.advance(seq)
                    self.append(seq, token, None)
        return self.reports(sched.seqs)

    def _stop_string(self, seq: Sequence, delta_len: int) -> bool:
        """Cut the text at the first stop string that the new text completes: before it, or after it with
        include_stop_str_in_output."""
        text, p = seq.output_text, seq.params
        new = len(text) - delta_len
        hits = [(i, s) for s in p.stop if (i := text.find(s, max(0, new - len(s) + 1))) >= 0]
        if not hits:
            return False
        i, s = min(hits)
        seq.output_text = text[:i + len(s) if p.include_stop_str_in_output else i]
        self._finish(seq, "stop", s)
        return True

    def _finish(self, seq: Sequence, reason: str, stop_reason=None) -> None:
        seq.stop_reason = stop_reason
        self.scheduler.finish(seq, reason)

    def _text_deferred(self, seq: Sequence) -> bool:
        """A request reported only when finished, with no stop strings to look for, needs its text only then
        (output), where a DecodeStream catches it up at once."""
        return self.detokenize.deferrable and not seq.params.stop and seq.request_id in self.final_only

    # ---- what is reported -------------------------------------------------------------------

    def reports(self, seqs: list[Sequence]) -> list[RequestOutput]:
        """The outputs of the requests that gained tokens: final-only ones once finished."""
        touched = dict.fromkeys(s.request_id for s in seqs)
        return [self.output(rid) for rid in touched
                if rid not in self.final_only or _finished(self.requests[rid])]

    def output(self, request_id: str) -> RequestOutput:
        """The request's state; a finished request is forgotten once reported."""
        group = self.requests[request_id]
        seq = group[0]
        for s in group:
            # text deferred: every token but one that stopped the sequence (unless its text is kept)
            end = len(s.token_ids) - (isinstance(s.stop_reason, int) and not s.params.include_stop_str_in_output)
            if self._text_deferred(s) and s.read_offset < end:
                self.detokenize(s, end)
        completions = [CompletionOutput(i, s.output_text, s.output_token_ids, s.finish_reason, s.logprobs,
                                        s.stop_reason) for i, s in enumerate(group)]
        finished = _finished(group)
        if finished:
            del self.requests[request_id]
            self.final_only.discard(request_id)
        metrics = {"arrival_time": seq.arrival_time}
        if seq.first_token_time is not None:
            metrics["first_token_time"] = seq.first_token_time
        if drafts := sum(s.num_draft_tokens for s in group):    # speculative decoding: its drafts, and those accepted
            metrics["spec_decode_num_draft_tokens"] = drafts
            metrics["spec_decode_num_accepted_tokens"] = sum(s.num_accepted_tokens for s in group)
        return RequestOutput(request_id, seq.prompt, seq.prompt_token_ids, completions, finished,
                             seq.num_cached_tokens, metrics, seq.prompt_logprobs)


def _finished(group: list[Sequence]) -> bool:
    return all(s.is_finished for s in group) and group[0].params.n == len(group)
