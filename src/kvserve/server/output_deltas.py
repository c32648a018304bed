"""What crosses the engine core's pipe: each step's outputs as what changed since the step before.

A RequestOutput is cumulative, so sending it whole every step costs O(length) per token, O(length²)
per request. A delta is a RequestOutput whose completions hold only the new token ids, logprobs
and text; the prompt rides on a request's first delta, its prompt logprobs on the first delta that
has them (the first with a token: the whole prompt is computed by then), so that a stream can echo
them at its start. Text grows at its end until a completion finishes, when a stop string may cut
it: a finishing delta carries the whole text.
"""
from __future__ import annotations

from dataclasses import replace

from kvserve.outputs import CompletionOutput, RequestOutput


class DeltaEncoder:
    """The core's side: remembers, per request and completion, the tokens and characters sent."""

    def __init__(self):
        self._sent: dict[str, dict[int, tuple[int, int]]] = {}
        self._prompt_logprobs_sent: set[str] = set()

    def encode(self, out: RequestOutput) -> RequestOutput:
        first = out.request_id not in self._sent
        sent = self._sent.setdefault(out.request_id, {})
        completions = []
        for c in out.outputs:
            tokens, chars = sent.get(c.index, (0, 0))
            completions.append(CompletionOutput(
                c.index, c.text if c.finished else c.text[chars:], c.token_ids[tokens:], c.finish_reason,
                None if c.logprobs is None else c.logprobs[tokens:], c.stop_reason))
            sent[c.index] = (len(c.token_ids), len(c.text))
        prompt_logprobs = None
        if out.prompt_logprobs is not None and out.request_id not in self._prompt_logprobs_sent:
            prompt_logprobs = out.prompt_logprobs
            self._prompt_logprobs_sent.add(out.request_id)
        if out.finished:
            self.forget(out.request_id)
        return replace(out, prompt=out.prompt if first else None,
                       prompt_token_ids=out.prompt_token_ids if first else [], outputs=completions,
                       prompt_logprobs=prompt_logprobs)

    def forget(self, request_id: str) -> None:
        self._sent.pop(request_id, None)
        self._prompt_logprobs_sent.discard(request_id)


def apply_delta(state: RequestOutput | None, delta: RequestOutput) -> RequestOutput:
    """The API's side: the request's cumulative output (state, updated in place) after `delta`,
    which it takes over."""
    if state is None:
        return delta
    by_index = {c.index: c for c in state.outputs}
    for d in delta.outputs:
        c = by_index.get(d.index)
        if c is None:                 # a sample forked from the prompt: its first delta
            state.outputs.append(d)
            state.outputs.sort(key=lambda c: c.index)
            continue
        c.token_ids += d.token_ids
        if d.logprobs is not None:
            c.logprobs = c.logprobs if c.logprobs is not None else []
            c.logprobs += d.logprobs
        c.text = d.text if d.finished else c.text + d.text
        c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason
    state.finished, state.num_cached_tokens, state.metrics = delta.finished, delta.num_cached_tokens, delta.metrics
    if delta.prompt_logprobs is not None:
        state.prompt_logprobs = delta.prompt_logprobs
    return state
