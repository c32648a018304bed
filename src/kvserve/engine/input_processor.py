"""InputProcessor: a request in, a Sequence the scheduler can run out, or a ValueError naming what is wrong
(vLLM v1's input processor): tokenizing, the sampling options the engine checks, the eviction policy and sparse
attention, whether the request can ever fit the KV cache, and its structured outputs' grammar, compiled."""
from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from kvserve.config import ModelConfig, SchedulerConfig
from kvserve.engine.sequence import Sequence
from kvserve.kv import KVCache
from kvserve.kv.eviction import EvictionPolicy, parse_eviction
from kvserve.kv.sparse import SparseAttention, request_sparse_attention
from kvserve.sampling import SamplingParams, seeded_generator
from kvserve.structured.manager import StructuredOutputManager
from kvserve.text import valid_unicode


class InputProcessor:
    """`eviction` and `sparse` are the engine's defaults (policy, sparse attention); `sliding_layers` each layer whose
    window binds, and its window; `seq_ids` the engine's counter of sequence ids; `structured` compiles structured
    outputs; `speculator` the engine's speculative decoding (which refuses the policies it cannot keep exact)."""

    def __init__(self, tokenizer, model_config: ModelConfig, max_model_len: int, kv: KVCache,
                 scheduler_config: SchedulerConfig, eviction: EvictionPolicy | None, sliding_layers: dict[int, int],
                 device: torch.device, seq_ids: Iterator[int], structured: StructuredOutputManager,
                 sparse: SparseAttention | None, speculator):
        self.tokenizer, self.vocab_size, self.max_model_len = tokenizer, model_config.vocab_size, max_model_len
        self.kv, self.scheduler_config, self.speculator = kv, scheduler_config, speculator
        self.eviction, self.sparse, self.device, self.seq_ids = eviction, sparse, device, seq_ids
        self.structured = structured
        self.widest_window = max(sliding_layers.values(), default=None)

    def process(self, request_id: str, prompt: str | list[int] | dict, params: SamplingParams,
                cache_salt: str | None = None) -> Sequence:
        """The request's sequence (its n samples start as one, forked once the prompt is computed); ValueError for
        a request the engine cannot run, before anything changes."""
        text, ids = self._tokenize(prompt, params.truncate_prompt_tokens)
        self._check_params(params)
        if isinstance(prompt, dict) and cache_salt is None:
            cache_salt = prompt.get("cache_salt")
        policy = self.eviction if params.eviction is None else parse_eviction(params.eviction)
        if policy is not None and self.kv.recomputes:
            raise ValueError("eviction needs a paged KV cache (cache_mode 'paged')")
        if policy is not None and self.widest_window is not None:
            policy.check_covers(self.widest_window)
        sparse = request_sparse_attention(self.sparse, params.sparse_attention)
        self.speculator.check_request(policy)
        max_tokens = params.max_tokens or self.max_model_len - len(ids)
        self._check_fits(len(ids), max_tokens, params.n, policy)
        grammar = self.structured.grammar(params)       # compiled now (or found compiled): its errors are the caller's
        return Sequence(next(self.seq_ids), request_id, text, ids, params, max_tokens, time.monotonic(),
                        seeded_generator(params, 0, self.device), cache_salt=cache_salt, eviction=policy,
                        grammar=grammar, sparse=sparse)

    def _check_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: token ids in the vocabulary, text options with a tokenizer (which
        tokenizes bad_words)."""
        for name in ("logit_bias", "allowed_token_ids"):
            if (ids := getattr(params, name)) and (bad := sorted(t for t in ids if t >= self.vocab_size)):
                raise ValueError(f"{name} token ids out of the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        if (params.stop or params.bad_words) and self.tokenizer is None:
            raise ValueError(f"{'stop strings' if params.stop else 'bad_words'} need a tokenizer (this engine has "
                             f"skip_tokenizer_init): use stop_token_ids, logit_bias or allowed_token_ids")
        if params.bad_words:
            params.update_from_tokenizer(self.tokenizer)

    def _tokenize(self, prompt, truncate: int | None = None) -> tuple[str | None, list[int]]:
        """The prompt's text (None for token ids, or once truncated) and token ids; its last `truncate` tokens only
        (-1: max_model_len of them), vLLM's truncate_prompt_tokens."""
        text, ids = _prompt_parts(prompt)
        if ids is None:
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer (this engine has skip_tokenizer_init): pass "
                                 "prompt_token_ids")
            ids = self.tokenizer.encode(_prompt_text(text))
        if not ids:
            raise ValueError("the prompt is empty")
        if truncate is not None:
            keep = self.max_model_len if truncate == -1 else truncate
            if keep > self.max_model_len:
                raise ValueError(f"truncate_prompt_tokens ({truncate}) exceeds max_model_len ({self.max_model_len})")
            if len(ids) > keep:
                text, ids = None, ids[-keep:]
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        return text, ids

    def _check_fits(self, prompt_len: int, max_tokens: int, n: int, policy: EvictionPolicy | None = None) -> None:
        """The request, at its longest, fits max_model_len (or its policy's bounded cache does) and the whole KV pool
        (policies and the cache answer what they hold); its n samples fit max_num_seqs."""
        total = prompt_len + max_tokens
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        cfg, bs = self.scheduler_config, self.kv.block_size
        chunk = cfg.long_prefill_token_threshold or cfg.max_num_batched_tokens
        held, pinned = total, 0
        if policy is not None and policy.bounds_context:
            prompt_chunk = min(prompt_len, chunk)
            held, pinned = policy.max_tokens_held(total, prompt_chunk, bs), policy.pinned_blocks(bs)
            if held > self.max_model_len:
                raise ValueError(f"{policy.spec()} with prompt chunks of {prompt_chunk} tokens holds up to {held} "
                                 f"tokens, more than max_model_len ({self.max_model_len}); use a smaller window or "
                                 f"long_prefill_token_threshold")
        elif total > self.max_model_len:
            raise ValueError(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = {total} "
                             f"exceeds max_model_len ({self.max_model_len})")
        blocks, pool = self.kv.max_blocks_held(held, chunk, pinned), self.kv.num_usable_blocks
        if blocks > pool:
            hint = ("; a smaller long_prefill_token_threshold lowers what the sliding-window layer groups hold while "
                    "a prompt chunk is written" if self.kv.max_blocks_held(held, 1, pinned) < blocks else "")
            raise ValueError(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) needs "
                             f"{blocks} KV blocks of {bs} tokens; the whole pool has {pool}{hint}")
        if n > cfg.max_num_seqs:
            raise ValueError(f"n ({n}) exceeds max_num_seqs ({cfg.max_num_seqs})")


def _prompt_parts(prompt) -> tuple[str | None, list[int] | None]:
    """A prompt's text and token ids as given (either may be None): a string, token ids, or a dict of them."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return prompt["prompt"], None
        raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, (list, tuple)):
        return None, list(prompt)
    raise ValueError(f"a prompt is a string, a list of token ids or a dict, got {type(prompt).__name__}")


def _prompt_text(text) -> str:
    """A text prompt, checked: a string (vLLM refuses an empty one, whatever a tokenizer would add to it), valid
    Unicode; else ValueError."""
    if not isinstance(text, str):
        raise ValueError(f"a text prompt must be a string, got {type(text).__name__}")
    if not text:
        raise ValueError("the prompt is empty")
    try:
        return valid_unicode(text)
    except ValueError as e:
        raise ValueError(f"the prompt is {e}") from None
