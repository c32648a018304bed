"""SamplingParams and the batched sampler: greedy, temperature, top-k, top-p, min-p, per-request seeds."""
from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from kvserve.kernels import COMPUTE_DTYPES, DTYPE_KINDS, fallback, function
from kvserve.kv.eviction import parse_eviction
from kvserve.kv.sparse import parse_sparse_attention

_EPS = 1e-5
MAX_SEED = 2**63 - 1
MAX_LOGIT_BIAS = 100.0


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop (vLLM's names and defaults).

    Every field is checked when the params are made: a wrong type (a bool is not a number), a NaN or
    infinite float, or a value out of range raises ValueError naming the field."""

    max_tokens: int | None = 16
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                      # 0 or -1: off (stored as 0)
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # token id -> a number in [-100, 100] added to its logit before sampling (OpenAI's and vLLM's logit_bias);
    # the engine checks the ids against the vocabulary
    logit_bias: dict[int, float] | None = None
    # the KV eviction policy of this request ("sink:sinks=4,window=1020", ..., "none"): overrides
    # the engine's default (kvserve.kv.eviction)
    eviction: str | dict | None = None
    # this request's sparse decode attention ("quest:budget=2048,...", or "none"): overrides the engine's default
    # (kvserve.kv.sparse)
    sparse_attention: str | dict | None = None

    def __post_init__(self):
        self.n = _integer("n", self.n, 1)
        if self.max_tokens is not None:
            self.max_tokens = _integer("max_tokens", self.max_tokens, 1)
        self.temperature = _real("temperature", self.temperature, 0.0)
        self.top_p = _real("top_p", self.top_p, 0.0, 1.0, low_open=True)
        # -1 is vLLM's other spelling of "off"
        self.top_k = max(0, _integer("top_k", self.top_k, -1, what="0 or -1 (off), or a positive integer"))
        self.min_p = _real("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            self.seed = _integer("seed", self.seed, 0, MAX_SEED - self.n,
                                 what=f"in [0, {MAX_SEED - self.n}] (sample i draws from seed + i)")
        self.stop = _stop_strings(self.stop)
        self.stop_token_ids = _stop_token_ids(self.stop_token_ids)
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                setattr(self, name, _integer(name, getattr(self, name), 0))
        if self.logit_bias is not None:
            self.logit_bias = _logit_bias(self.logit_bias)
        if self.eviction is not None:
            try:
                parse_eviction(self.eviction)
            except ValueError as e:         # its message names the policy's option, not this field
                raise ValueError(f"eviction: {e}") from None
        if self.sparse_attention is not None:
            try:
                parse_sparse_attention(self.sparse_attention)
            except ValueError as e:
                raise ValueError(f"sparse_attention: {e}") from None

    @property
    def greedy(self) -> bool:
        return self.temperature < _EPS


def _integer(name: str, value, low: int, high: int | None = None, what: str = "") -> int:
    """value as an int in [low, high], else ValueError naming the field (bools and floats are not ints)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    value = int(value)
    if value < low or (high is not None and value > high):
        what = what or (f"at least {low}" if high is None else f"in [{low}, {high}]")
        raise ValueError(f"{name} must be {what}, got {value}")
    return value


def _real(name: str, value, low: float, high: float | None = None, low_open: bool = False) -> float:
    """value as a finite float in [low, high] (or (low, high]), else ValueError naming the field."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    try:
        value = float(value)
    except OverflowError:       # an int past the floats
        value = math.inf if value > 0 else -math.inf
    if (not math.isfinite(value) or value < low or (low_open and value == low)
            or (high is not None and value > high)):
        bounds = f"{'(' if low_open else '['}{low}, {'inf)' if high is None else f'{high}]'}"
        raise ValueError(f"{name} must be a finite number in {bounds}, got {value}")
    return value


def _stop_strings(stop) -> list[str]:
    """A string or a list of non-empty strings, as a list."""
    stops = [stop] if isinstance(stop, str) else stop
    if stops is None:
        return []
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) for s in stops):
        raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
    if not all(stops):
        raise ValueError("stop strings must be non-empty")
    return list(stops)


def _stop_token_ids(ids) -> list[int]:
    """None or a list of non-negative int token ids, as a list."""
    if ids is None:
        return []
    if not isinstance(ids, (list, tuple)):
        raise ValueError(f"stop_token_ids must be a list of token ids, got {type(ids).__name__} {ids!r}")
    return [_integer(f"stop_token_ids[{i}]", t, 0) for i, t in enumerate(ids)]


def _logit_bias(bias) -> dict[int, float]:
    """{token id: bias in [-100, 100]} with int ids and float biases."""
    if not isinstance(bias, Mapping):
        raise ValueError(f"logit_bias must be a dict of token id -> bias, got {type(bias).__name__} {bias!r}")
    return {_integer("logit_bias token id", t, 0): _real(f"logit_bias[{t!r}]", b, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
            for t, b in bias.items()}


@dataclass
class Logprob:
    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass
class SampleResult:
    token_ids: list[int]
    # per sequence: {token_id: (logprob, rank)} for the sampled token and the top-k, or None
    logprobs: list[dict[int, tuple[float, int]] | None] = field(default_factory=list)


ARGMAX_TILE = 128


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1) of [rows, n] (the first maximum; NaN counts as the largest).

    On the CPU, float32 and bfloat16 rows go through csrc/sampling.c, in one pass over the logits as the
    lm_head wrote them (no widened copy of bfloat16 rows, no second pass). Elsewhere: the tiles' maxima,
    then the best tile (torch's argmax does not vectorize on the CPU, its amax does)."""
    rows, n = x.shape
    if x.device.type == "cpu" and x.dtype in COMPUTE_DTYPES and rows and n:
        fn = function("argmax_rows")
        if fn is not None and x.stride(-1) == 1:
            out = torch.empty(rows, dtype=torch.int64)
            fn(x.data_ptr(), rows, n, x.stride(0), DTYPE_KINDS[x.dtype], out.data_ptr(), torch.get_num_threads())
            return out
        fallback("argmax_rows", "the kernels are not built" if fn is None else "a row's numbers are not adjacent")
    x = x.float()
    # one or two rows: torch's single op, which costs less than the tiles' several ops when there is
    # little to reduce
    if rows <= 2 or n < 8 * ARGMAX_TILE:
        return x.argmax(-1)
    full = n - n % ARGMAX_TILE
    best = x[:, :full].reshape(rows, full // ARGMAX_TILE, ARGMAX_TILE).amax(-1)
    if full < n:
        best = torch.cat((best, x[:, full:].amax(-1, keepdim=True)), 1)
    start = best.argmax(-1) * ARGMAX_TILE
    # a last, partial tile reads its final column again in place of the missing ones: a repeat
    # never comes first
    cols = (start[:, None] + torch.arange(ARGMAX_TILE, device=x.device)).clamp_(max=n - 1)
    return start + x.gather(1, cols).argmax(-1)


class Sampler:
    """Samples one token per row of logits [B, V], with each row's own parameters and generator."""

    def __init__(self, generator: torch.Generator | None = None):
        self.generator = generator

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> SampleResult:
        """One token per row, drawn from the row's logits plus its logit_bias; the logprobs (of rows that ask)
        are the model's own, before the bias and the temperature (vLLM's default, raw_logprobs)."""
        raw = logits
        if any(p.logit_bias for p in params):
            logits = _add_logit_bias(logits, params)
        tokens = argmax(logits)
        sampled = not all(p.greedy for p in params)
        if sampled:
            logits = logits.float()     # keeps every bf16/fp16 value and its order
            greedy = torch.tensor([p.greedy for p in params], device=logits.device)
            tokens = torch.where(greedy, tokens, self._sample(logits, params, generators))
        token_list = tokens.tolist()
        return SampleResult(token_list, self._logprobs(raw, token_list, params))

    def _sample(self, logits, params, generators) -> torch.Tensor:
        dev = logits.device
        temp = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=dev)
        logits = logits / temp[:, None]
        if any(p.top_k for p in params) or any(p.top_p < 1 for p in params):
            logits = _top_k_top_p(logits, [p.top_k for p in params], [p.top_p for p in params])
        probs = logits.softmax(-1)
        if any(p.min_p for p in params):
            min_p = torch.tensor([p.min_p for p in params], device=dev)
            probs = probs.masked_fill(probs < min_p[:, None] * probs.max(-1, keepdim=True).values, 0)
        # argmax(p / E) with E ~ Exp(1) samples from p; each seeded row draws from its own generator
        # so that its tokens do not depend on what else is in the batch.
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, g in enumerate(generators):
            if g is not None:
                noise[i].exponential_(generator=g)
        return argmax(probs / noise)

    @staticmethod
    def _logprobs(logits, tokens: list[int], params) -> list[dict[int, tuple[float, int]] | None]:
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        out: list[dict[int, tuple[float, int]] | None] = [None] * len(params)
        if rows:
            entries = token_logprobs(logits[rows], [tokens[i] for i in rows], [params[i].logprobs for i in rows])
            for i, entry in zip(rows, entries):
                out[i] = entry
        return out


def _add_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """A float32 copy of logits with each row's logit_bias added (the rows without one as they were)."""
    rows, cols, values = [], [], []
    for i, p in enumerate(params):
        for token, bias in (p.logit_bias or {}).items():
            rows.append(i)
            cols.append(token)
            values.append(bias)
    dev = logits.device
    biased = logits.to(torch.float32, copy=True)
    biased[torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)] += torch.tensor(values, device=dev)
    return biased


def token_logprobs(logits: torch.Tensor, tokens: list[int], ks: list[int]) -> list[dict[int, tuple[float, int]]]:
    """Per row: {token: (logprob, rank)} for the given token, then for the row's top k tokens."""
    logp = logits.float().log_softmax(-1)
    rows = torch.arange(len(tokens), device=logits.device)
    chosen = logp[rows, torch.tensor(tokens, device=logits.device)]
    ranks = ((logp > chosen[:, None]).sum(-1) + 1).tolist()
    ks = [min(k, logp.shape[-1]) for k in ks]
    top_vals, top_ids = logp.topk(max(ks), dim=-1)
    chosen, top_vals, top_ids = chosen.tolist(), top_vals.tolist(), top_ids.tolist()
    out = []
    for i, (token, k) in enumerate(zip(tokens, ks)):
        entry = {token: (chosen[i], ranks[i])}
        for r in range(k):
            entry.setdefault(top_ids[i][r], (top_vals[i][r], r + 1))
        out.append(entry)
    return out


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Mask (to -inf) the tokens outside each row's top-k and top-p nucleus."""
    sorted_logits, idx = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    k = torch.tensor([min(t, vocab) if t else vocab for t in top_k], device=logits.device)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    drop = ranks >= k[:, None]
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
    mass_before = probs.cumsum(-1) - probs
    p = torch.tensor(top_p, device=logits.device)[:, None]
    drop |= (mass_before >= p) & (p < 1)
    drop[:, 0] = False
    return logits.scatter(-1, idx, sorted_logits.masked_fill(drop, float("-inf")))
