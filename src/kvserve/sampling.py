"""SamplingParams and the batched sampler: greedy, temperature, top-k, top-p, min-p, per-request seeds."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvserve.kernels import COMPUTE_DTYPES, DTYPE_KINDS, fallback, function
from kvserve.kv.eviction import parse_eviction

_EPS = 1e-5
MAX_SEED = 2**63 - 1


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop (vLLM's names and defaults)."""

    max_tokens: int | None = 16
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # the KV eviction policy of this request ("sink:sinks=4,window=1020", ..., "none"): overrides
    # the engine's default (kvserve.kv.eviction)
    eviction: str | dict | None = None

    def __post_init__(self):
        if self.eviction is not None:
            parse_eviction(self.eviction)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED - self.n:
            raise ValueError(f"seed must be in [0, {MAX_SEED - self.n}] (sample i draws from seed + i), "
                             f"got {self.seed}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0 or (self.top_k and self.top_k < 1):
            raise ValueError(f"top_k must be 0 (off) or a positive integer, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"{name} must be non-negative, got {getattr(self, name)}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature < _EPS


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
    lm_head wrote them: right after its GEMM, 0.15 ms for 64 x 32000 float32 logits and 0.10 for
    bfloat16, against 0.31 and 0.45 for the two passes below (bfloat16 widened first). Elsewhere: the
    tiles' maxima, then the best tile (torch's argmax does not vectorize on the CPU, its amax does)."""
    rows, n = x.shape
    if x.device.type == "cpu" and x.dtype in COMPUTE_DTYPES and rows and n:
        fn = function("argmax_rows")
        if fn is not None and x.stride(-1) == 1:
            out = torch.empty(rows, dtype=torch.int64)
            fn(x.data_ptr(), rows, n, x.stride(0), DTYPE_KINDS[x.dtype], out.data_ptr(), torch.get_num_threads())
            return out
        fallback("argmax_rows", "the kernels are not built" if fn is None else "a row's numbers are not adjacent")
    x = x.float()
    # one or two rows: torch's single op, which costs less than the tiles' several right after a
    # decode step has streamed the weights through the caches (0.05 ms a step measured at batch 1)
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
        tokens = argmax(logits)
        sampled = not all(p.greedy for p in params)
        if sampled or any(p.logprobs is not None for p in params):
            logits = logits.float()     # keeps every bf16/fp16 value and its order
        if sampled:
            greedy = torch.tensor([p.greedy for p in params], device=logits.device)
            tokens = torch.where(greedy, tokens, self._sample(logits, params, generators))
        token_list = tokens.tolist()
        return SampleResult(token_list, self._logprobs(logits, token_list, params))

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
