"""SamplingParams and the batched sampler: greedy, temperature, top-k, top-p, min-p, per-request seeds."""
from __future__ import annotations

import math
import numbers
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

import torch

from kvserve.kernels import COMPUTE_DTYPES, DTYPE_KINDS, fallback, function
from kvserve.kv.eviction import parse_eviction
from kvserve.kv.sparse import parse_sparse_attention
from kvserve.structured.params import StructuredOutputsParams
from kvserve.text import valid_unicode

_EPS = 1e-5
MAX_SEED = 2**63 - 1
MAX_LOGIT_BIAS = 100.0
# The most entries of one request's lists, vLLM's defaults: each is looked at for every token the request samples
MAX_STOP_STRINGS = 4                # VLLM_MAX_STOP_STRINGS
MAX_STOP_TOKEN_IDS = 128            # VLLM_MAX_STOP_TOKEN_IDS
MAX_LOGIT_BIAS_TOKENS = 1024        # vLLM's sampler: MAX_NUM_LOGIT_BIAS_TOKENS
MAX_ALLOWED_TOKEN_IDS = 1024        # vLLM's sampler: MAX_NUM_ALLOWED_TOKEN_IDS
MAX_BAD_WORDS = 128                 # VLLM_MAX_NUM_BAD_WORDS: words, and token sequences once tokenized
MAX_BAD_WORDS_TOKENS = 1024         # VLLM_MAX_BAD_WORDS_TOTAL_TOKENS
MAX_BAD_WORD_CHARS = 1024           # of one word: it is tokenized between two steps


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
    # the fewest tokens to generate before an EOS or a stop token may be sampled, or a stop string end the text
    min_tokens: int = 0
    include_stop_str_in_output: bool = False    # the text keeps the stop string (or stop token) that ended it
    # with skip_special_tokens=False: False writes adjacent added tokens without a space between them
    spaces_between_special_tokens: bool = True
    allowed_token_ids: list[int] | None = None  # only these tokens may be sampled
    # words never generated: the last token of a word's tokens is forbidden where it would complete the word
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None   # keep the prompt's last k tokens; -1: max_model_len of them
    # the output follows a JSON schema, a regex, a choice or a grammar (a dict of StructuredOutputsParams' fields
    # is taken too); the engine compiles it with its tokenizer
    structured_outputs: StructuredOutputsParams | None = None
    # the token sequences of bad_words, set by the engine with its tokenizer (update_from_tokenizer)
    bad_words_token_ids: list[list[int]] = field(default_factory=list, init=False, repr=False, compare=False)

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
        self.stop_token_ids = _token_ids("stop_token_ids", self.stop_token_ids, MAX_STOP_TOKEN_IDS) or []
        self._stop_token_set = frozenset(self.stop_token_ids)
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output",
                     "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                setattr(self, name, _integer(name, getattr(self, name), 0))
        if self.logit_bias is not None:
            self.logit_bias = _logit_bias(self.logit_bias)
        self.min_tokens = _integer("min_tokens", self.min_tokens, 0, self.max_tokens)   # at most max_tokens
        self.allowed_token_ids = _token_ids("allowed_token_ids", self.allowed_token_ids, MAX_ALLOWED_TOKEN_IDS)
        if self.allowed_token_ids == []:
            raise ValueError("allowed_token_ids must name at least one token (or be None)")
        self.bad_words = _bad_words(self.bad_words)
        if self.truncate_prompt_tokens is not None:
            self.truncate_prompt_tokens = _integer("truncate_prompt_tokens", self.truncate_prompt_tokens, -1)
            if self.truncate_prompt_tokens == 0:
                raise ValueError("truncate_prompt_tokens must be -1 (max_model_len) or at least 1, got 0")
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        elif not isinstance(self.structured_outputs, (StructuredOutputsParams, type(None))):
            raise ValueError(f"structured_outputs must be StructuredOutputsParams, got "
                             f"{type(self.structured_outputs).__name__}")
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

    @property
    def stop_token_set(self) -> frozenset[int]:
        """stop_token_ids as a set: a sampled token is looked up in it."""
        return self._stop_token_set

    @property
    def changes_logits(self) -> bool:
        """Whether a token is drawn from logits this request changes (its logits processors, or its structured
        outputs' grammar), not from the model's own."""
        return self.has_logits_processors or self.structured_outputs is not None

    @property
    def has_logits_processors(self) -> bool:
        """Whether the sampler's processors change this request's logits: logit_bias, allowed_token_ids, bad_words,
        min_tokens."""
        return bool(self.logit_bias or self.allowed_token_ids or self.bad_words or self.min_tokens)

    def update_from_tokenizer(self, tokenizer) -> None:
        """Tokenize bad_words as vLLM does (each word alone and after a space, where that makes other tokens
        of the same number); ValueError past MAX_BAD_WORDS sequences or MAX_BAD_WORDS_TOKENS tokens."""
        sequences: list[list[int]] = []
        for word in self.bad_words or ():
            for prefix in ("", " "):
                ids = tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False)
                if not ids:
                    if not prefix:
                        raise ValueError(f"bad_words: {word!r} is no token")
                    continue
                if not prefix or (ids[0] != sequences[-1][0] and len(ids) == len(sequences[-1])):
                    sequences.append(ids)
        total = sum(map(len, sequences))
        if len(sequences) > MAX_BAD_WORDS or total > MAX_BAD_WORDS_TOKENS:
            raise ValueError(f"bad_words make {len(sequences)} token sequences of {total} tokens; at most "
                             f"{MAX_BAD_WORDS} sequences of {MAX_BAD_WORDS_TOKENS} tokens in all")
        self.bad_words_token_ids = sequences


def seeded_generator(params: SamplingParams, index: int, device: torch.device) -> torch.Generator | None:
    """The generator of sample `index` of a seeded request: it draws from seed + index, the same as a separate run
    with that seed (None: the sampler's own)."""
    if params.seed is None:
        return None
    return torch.Generator(device).manual_seed(params.seed + index)


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
    """A string or a list of up to MAX_STOP_STRINGS non-empty strings, as a list."""
    stops = [stop] if isinstance(stop, str) else stop
    if stops is None:
        return []
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) for s in stops):
        raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
    _at_most("stop", stops, MAX_STOP_STRINGS)
    if not all(stops):
        raise ValueError("stop strings must be non-empty")
    for s in stops:
        _valid_text("stop", s)
    return list(stops)


def _token_ids(name: str, ids, most: int) -> list[int] | None:
    """None, or a list of up to `most` non-negative int token ids, as a list without repeats."""
    if ids is None:
        return None
    if not isinstance(ids, (list, tuple)):
        raise ValueError(f"{name} must be a list of token ids, got {type(ids).__name__} {ids!r}")
    _at_most(name, ids, most)
    return list(dict.fromkeys(_integer(f"{name}[{i}]", t, 0) for i, t in enumerate(ids)))


def _logit_bias(bias) -> dict[int, float]:
    """{token id: bias in [-100, 100]} with int ids and float biases, up to MAX_LOGIT_BIAS_TOKENS of them."""
    if not isinstance(bias, Mapping):
        raise ValueError(f"logit_bias must be a dict of token id -> bias, got {type(bias).__name__} {bias!r}")
    _at_most("logit_bias", bias, MAX_LOGIT_BIAS_TOKENS)
    return {_integer("logit_bias token id", t, 0): _real(f"logit_bias[{t!r}]", b, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
            for t, b in bias.items()}


def _bad_words(words) -> list[str] | None:
    """None, or a list of up to MAX_BAD_WORDS non-empty strings of up to MAX_BAD_WORD_CHARS, without repeats."""
    if words is None:
        return None
    if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) for w in words):
        raise ValueError(f"bad_words must be a list of strings, got {words!r}")
    _at_most("bad_words", words, MAX_BAD_WORDS)
    for w in words:
        if not w.strip() or len(w) > MAX_BAD_WORD_CHARS:
            raise ValueError(f"bad_words must be words of up to {MAX_BAD_WORD_CHARS} characters, not blank; got "
                             f"{w[:20]!r} ({len(w)} characters)")
        _valid_text("bad_words", w)
    return list(dict.fromkeys(words))


def _at_most(name: str, items, most: int) -> None:
    if len(items) > most:
        raise ValueError(f"{name} has {len(items)} entries, more than {most}")


def _valid_text(name: str, text: str) -> None:
    try:
        valid_unicode(text)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None


@dataclass
class Logprob:
    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass
class TokenMask:
    """The tokens some rows of a step may not sample (their structured outputs' grammars): `bias` [len(rows), vocab]
    float32 holds 0 where a row's token is allowed and -inf where it is not."""

    rows: list[int]
    bias: torch.Tensor

    def applied(self, logits: torch.Tensor) -> torch.Tensor:
        """A float32 copy of logits [rows, vocab] with the forbidden tokens at -inf."""
        logits = logits.to(torch.float32, copy=True)
        logits.index_add_(0, torch.tensor(self.rows, device=logits.device), self.bias.to(logits.device))
        return logits


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


# a row's tokens so far (its prompt's, then its outputs) and how many of them are its prompt's
History = tuple[list[int], int]


class Sampler:
    """Samples one token per row of logits [B, V], with each row's own parameters and generator."""

    def __init__(self, generator: torch.Generator | None = None, eos_token_ids: Collection[int] = ()):
        self.generator = generator
        self.eos_token_ids = frozenset(eos_token_ids)     # forbidden with the stop tokens before min_tokens

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
                 histories: list[History] | None = None, mask: TokenMask | None = None) -> SampleResult:
        """One token per row, drawn from the row's logits as its params change them (SamplingParams.changes_logits;
        bad_words and min_tokens read the row's `histories`), never one its `mask` forbids; the logprobs (of rows
        that ask) are the model's own, before those changes and the temperature (vLLM's default, raw_logprobs), but
        after the mask (as vLLM's, whose grammars mask the logits before its sampler)."""
        if mask is not None:
            logits = mask.applied(logits)
        raw = logits
        if any(p.has_logits_processors for p in params):
            logits = _processed(logits, params, histories or [([], 0)] * len(params), self.eos_token_ids)
        tokens = argmax(logits)
        sampled = not all(p.greedy for p in params)
        if sampled:
            logits = logits.float()     # keeps every bf16/fp16 value and its order
            greedy = torch.tensor([p.greedy for p in params], device=logits.device)
            tokens = torch.where(greedy, tokens, self._sample(logits, params, generators))
        token_list = tokens.tolist()
        return SampleResult(token_list, self._logprobs(raw, token_list, params))

    def _sample(self, logits, params, generators) -> torch.Tensor:
        probs = _distribution(logits, params)
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


def _distribution(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Each row's probabilities to draw from (float logits in): its temperature (1 for greedy rows), top-k, top-p,
    min-p; min-p's masked tokens are not renormalized (argmax(p / E) draws alike)."""
    dev = logits.device
    temp = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=dev)
    logits = logits / temp[:, None]
    if any(p.top_k for p in params) or any(p.top_p < 1 for p in params):
        logits = _top_k_top_p(logits, [p.top_k for p in params], [p.top_p for p in params])
    probs = logits.softmax(-1)
    if any(p.min_p for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=dev)
        probs = probs.masked_fill(probs < min_p[:, None] * probs.max(-1, keepdim=True).values, 0)
    return probs


def _processed(logits: torch.Tensor, params: list[SamplingParams], histories: list[History],
               eos_token_ids: frozenset[int]) -> torch.Tensor:
    """A float32 copy of logits with each row's logit_bias added, and -inf for the tokens a row may not sample:
    those outside its allowed_token_ids, those that would complete one of its bad words, and, until it has
    min_tokens outputs, EOS and its stop tokens (as vLLM's logits processors). Rows that change nothing stay
    as they were."""
    rows, cols, values = [], [], []
    forbidden_rows, forbidden = [], []
    out = logits.to(torch.float32, copy=True)
    for i, (p, (tokens, prompt_len)) in enumerate(zip(params, histories)):
        for token, bias in (p.logit_bias or {}).items():
            rows.append(i)
            cols.append(token)
            values.append(bias)
        if p.allowed_token_ids:
            keep = torch.zeros(out.shape[-1], dtype=torch.bool, device=out.device)
            keep[p.allowed_token_ids] = True
            out[i].masked_fill_(~keep, -math.inf)
        banned = _bad_word_ends(p.bad_words_token_ids, tokens[prompt_len:]) if p.bad_words_token_ids else []
        if len(tokens) - prompt_len < p.min_tokens:
            banned += [*p.stop_token_set, *eos_token_ids]
        forbidden_rows += [i] * len(banned)
        forbidden += banned
    dev = out.device
    if rows:
        out[torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)] += torch.tensor(values, device=dev)
    if forbidden:
        out[torch.tensor(forbidden_rows, device=dev), torch.tensor(forbidden, device=dev)] = -math.inf
    return out


def _bad_word_ends(sequences: list[list[int]], outputs: list[int]) -> list[int]:
    """The last token of each bad word's tokens that the row's outputs end with all the others of (vLLM's rule: a
    one-token word always)."""
    ends = []
    for seq in sequences:
        before = len(seq) - 1
        if before <= len(outputs) and (before == 0 or outputs[-before:] == seq[:-1]):
            ends.append(seq[-1])
    return ends


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


@dataclass
class DraftResult:
    """A verification's outcome for one sequence: its accepted drafts, then the token drawn after them."""

    token_ids: list[int]
    logprobs: list[dict[int, tuple[float, int]] | None]      # of each token, where the sequence asks
    num_accepted: int


class RejectionSampler:
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023) over the Sampler's distributions, for drafts
    proposed deterministically (prompt lookup, a draft model's argmax): their distribution q is one-hot, so that
    draft d is accepted with probability min(1, p(d) / q(d)) = p(d), and where it is rejected the token is drawn
    from max(p - q, 0) renormalized, p less d; once every draft is accepted, one more from the last row's p. Each
    token then follows the target's p exactly, as plain sampling would draw it. A greedy sequence accepts each draft
    that is p's argmax and emits the argmax at the first that is not: the tokens of plain greedy decoding. p is what
    the Sampler draws from: the request's logits processors (with its history and the drafts before the row),
    temperature, top-k, top-p, min-p; a seeded sequence draws from its own generator."""

    def __init__(self, sampler: Sampler):
        self.sampler = sampler

    def __call__(self, logits: torch.Tensor, drafts: list[list[int]], params: list[SamplingParams],
                 generators: list[torch.Generator | None], histories: list[History],
                 mask: TokenMask | None = None) -> list[DraftResult]:
        """logits [sum of (1 + drafts), V]: each sequence's rows in turn, after its last verified token then after each
        of its drafts; its drafts, params, generator and tokens (History). p is zero where the `mask` of a row forbids
        a token (a grammar's: its drafts are ones it allows), and the logprobs are taken after the mask, as the
        Sampler's."""
        if mask is not None:
            logits = mask.applied(logits)
        rows, starts = [], []
        for d, p, (tokens, prompt_len) in zip(drafts, params, histories):
            starts.append(len(rows))
            rows += [(p, (tokens + d[:j], prompt_len) if p.changes_logits else None) for j in range(len(d) + 1)]
        raw = logits
        row_params = [p for p, _ in rows]
        processed = raw
        if any(p.changes_logits for p in params):
            processed = _processed(raw, row_params, [h or ([], 0) for _, h in rows], self.sampler.eos_token_ids)
        best = argmax(processed).tolist()
        probs = None
        if not all(p.greedy for p in params):
            probs = _distribution(processed.float(), row_params)
            probs /= probs.sum(-1, keepdim=True)
        results = []
        for d, p, g, r in zip(drafts, params, generators, starts):
            num_accepted, token = self._accept(d, p, g or self.sampler.generator, best[r:r + len(d) + 1],
                                               None if p.greedy else probs[r:r + len(d) + 1])
            tokens = d[:num_accepted] + [token]
            lps = [None] * len(tokens)
            if p.logprobs is not None:
                lps = token_logprobs(raw[r:r + len(tokens)], tokens, [p.logprobs] * len(tokens))
            results.append(DraftResult(tokens, lps, num_accepted))
        return results

    @staticmethod
    def _accept(drafts: list[int], params: SamplingParams, generator: torch.Generator | None, best: list[int],
                probs: torch.Tensor | None) -> tuple[int, int]:
        """(drafts accepted, the token after them) of one sequence: `best` its rows' argmax, `probs` their
        distributions (None: greedy)."""
        if probs is None:
            n = next((j for j, t in enumerate(drafts) if best[j] != t), len(drafts))
            return n, best[n]
        dev = probs.device
        chance = probs[torch.arange(len(drafts), device=dev), torch.tensor(drafts, dtype=torch.long, device=dev)]
        accepted = (torch.rand(len(drafts), device=dev, generator=generator) < chance).tolist()
        n = accepted.index(False) if False in accepted else len(drafts)
        dist = probs[n]
        if n < len(drafts):           # max(p - q, 0) of a one-hot q: p less the rejected draft
            dist = dist.clone()
            dist[drafts[n]] = 0
        noise = torch.empty_like(dist).exponential_(generator=generator)
        return n, int((dist / noise).argmax())
