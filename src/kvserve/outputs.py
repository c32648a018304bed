"""What generate() returns (vLLM's shapes)."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.sampling import Logprob


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None       # "stop", "length", "abort" or None while running
    logprobs: list[dict[int, Logprob]] | None = None
    stop_reason: int | str | None = None   # the stop string or token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None   # None for the first prompt token
