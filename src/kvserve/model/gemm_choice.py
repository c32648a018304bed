"""Which GEMM multiplies the CPU's linear layers: chosen by measurement at start-up, not by instruction set.

Candidates, timed on each of the model's linear shapes at a few row counts (ROWS: decode steps of 1 to 64
sequences, and a prefill's PREFILL_ROWS): csrc/gemm.c's vector kernel (AVX-512's, AVX2's in a build for a
CPU without AVX-512, NEON's in an ARM64 build), its AMX kernel (bfloat16, where the CPU has AMX and the OS grants
it) and oneDNN's prepacked GEMM. A weight is held once (Linear.load),
packed for csrc/gemm.c or for oneDNN, so one of the two packs the whole model: the one whose products take
less time per row at the decode row counts, summed over the model's layers (decoding reads every weight
for each token; a prefill, many rows at once, runs on whichever packs the weights, and the report says what
it loses there). oneDNN must win by ONEDNN_MARGIN: the native decode step multiplies only csrc/gemm.c's
panels. Within
csrc/gemm.c, a layer runs AMX's kernel from the smallest row count at which AMX is faster there and at
every larger count measured (Linear.amx_from). Quantized weights have two more candidates (bfloat16 products):
"widen", each chunk of the weight dequantized to bfloat16 once for all rows, and "vnni", x rounded to int8 and
multiplied by the weight's bytes (csrc/gemm.c). Below amx_from, a layer runs widen from the smallest row count
from which it is faster than avx512 and vnni at every count measured (Linear.widen_from), and below that vnni from
the smallest from which it is faster than avx512 at every count measured (Linear.vnni_from).

The timings are cached per CPU and build of the kernels, torch version and thread count, under
~/.cache/kvserve/gemm (or $KVSERVE_CACHE): a second start measures nothing. KVSERVE_GEMM forces a choice:
avx512, avx2, neon, amx, vnni or widen (csrc/gemm.c, that kernel at every row count: one the build has; vnni and
widen multiply quantized weights, others by the vector kernel) or onednn; `measure`, the default, measures.
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass, field

import torch

from kvserve.config import ModelConfig
from kvserve.kernels import COMPUTE_DTYPES, build_key, cache_dirs
from kvserve.model.layers import (GEMM_KERNELS, NEVER, QUANTIZED_KERNELS, GateUpLinear, Linear, gemm_kernel,
                                  gemm_kernels, gemm_packs, vector_kernel)

log = logging.getLogger(__name__)
GEMM_ENV = "KVSERVE_GEMM"
# oneDNN packs the weights only where its decode products take less than 1 / ONEDNN_MARGIN of csrc/gemm.c's time:
# packed for oneDNN, the model loses the native decode step, whose saving (the steps' dispatch, the ops between
# the products) these timings do not see
ONEDNN_MARGIN = 1.25
CHOICES = ("measure", "avx512", "amx", "onednn", "avx2", "neon", "vnni", "widen")
DECODE_ROWS = (1, 4, 8, 16, 64)
PREFILL_ROWS = 512
ROWS = (*DECODE_ROWS, PREFILL_ROWS)
# Each candidate is timed _REPEATS times at least, and until its timed runs add up to _BUDGET seconds (at most
# _MAX_RUNS): the fastest run is taken, and on a shared machine a run often loses time to other work (a thread
# of the team waits for one that lost its core), the more so the shorter it is. A product of more than _LONG
# seconds is timed once.
_REPEATS, _BUDGET, _MAX_RUNS, _LONG = 3, 0.03, 60, 0.05
# numbers of a weight timed: a larger one is timed on its first output columns, and its times scaled up (the
# measurement's memory stays small beside the model's, and a product's time per column is flat at that size)
_MAX_TIMED = 2**25


@dataclass(frozen=True)
class Shape:
    """The linear layers of one shape in a model: their name there, [out, in], gated (gate_up), how many."""

    name: str
    out_features: int
    in_features: int
    gated: bool
    count: int

    @property
    def key(self) -> str:
        return f"{self.out_features}x{self.in_features}" + ("-gated" if self.gated else "")


def model_shapes(cfg: ModelConfig) -> list[Shape]:
    """The shapes of a decoder's linear layers (decoder.py's names), lm_head last."""
    h, n = cfg.hidden_size, cfg.num_layers
    return [Shape("qkv_proj", cfg.q_size + 2 * cfg.kv_size, h, False, n), Shape("o_proj", h, cfg.q_size, False, n),
            Shape("gate_up_proj", 2 * cfg.intermediate_size, h, True, n),
            Shape("down_proj", h, cfg.intermediate_size, False, n), Shape("lm_head", cfg.vocab_size, h, False, 1)]


# seconds of one product: layer name -> rows -> candidate ("avx512", "avx2" or "neon", "amx", "vnni", "widen",
# "onednn") -> seconds
Timings = dict[str, dict[int, dict[str, float]]]


@dataclass
class GemmChoice:
    """How the CPU's linear layers multiply: the weights' format (Linear.load), the rows from which each layer
    (by name) runs csrc/gemm.c's AMX kernel (and, quantized, its widen and vnni kernels), and what decided it:
    `source` (measured, cached, or why nothing was) and the timings behind it."""

    weight_format: str
    source: str
    amx_from: dict[str, int] = field(default_factory=dict)
    seconds: Timings = field(default_factory=dict)
    shapes: list[Shape] = field(default_factory=list)
    widen_from: dict[str, int] = field(default_factory=dict)
    vnni_from: dict[str, int] = field(default_factory=dict)

    def apply(self, model: torch.nn.Module) -> None:
        """Set amx_from, widen_from and vnni_from of each of the model's layers packed for csrc/gemm.c, by its
        name."""
        for name, m in model.named_modules():
            if isinstance(m, Linear) and m.own_gemm:
                m.set_kernel_plan(self.plan(name.rsplit(".", 1)[-1]))

    def plan(self, name: str) -> dict[str, int]:
        """The rows from which the layer `name` runs each kernel (Linear.kernel_plan's keys)."""
        return {"amx_from": self.amx_from.get(name, NEVER), "widen_from": self.widen_from.get(name, NEVER),
                "vnni_from": self.vnni_from.get(name, NEVER)}

    def per_row(self, rows: tuple[int, ...]) -> dict[str, float]:
        """Seconds per row of the model's products at each of `rows`, summed, by csrc/gemm.c (its kernel at
        each row count by amx_from) and by oneDNN; empty where nothing was measured."""
        if not self.seconds:
            return {}
        totals = {"gemm": 0.0, "onednn": 0.0}
        for s in self.shapes:
            for m in rows:
                t = self.seconds[s.name][m]
                totals["gemm"] += s.count * t[gemm_kernel(m, vector_kernel(tuple(t)), **self.plan(s.name))] / m
                totals["onednn"] += s.count * t.get("onednn", float("inf")) / m
        return totals

    def report(self) -> dict:
        """The choice as LLMEngine.stats()["gemm"] gives it (seconds: per layer, rows, candidate)."""
        def rows(starts: dict[str, int]) -> dict[str, int | None]:
            return {k: (None if v == NEVER else v) for k, v in starts.items()}

        return {"weight_format": self.weight_format, "source": self.source, "amx_from": rows(self.amx_from),
                "widen_from": rows(self.widen_from), "vnni_from": rows(self.vnni_from),
                "decode_s_per_row": self.per_row(DECODE_ROWS), "prefill_s_per_row": self.per_row((PREFILL_ROWS,)),
                "seconds": {name: {str(m): t for m, t in by_rows.items()} for name, by_rows in self.seconds.items()}}

    def describe(self) -> str:
        """One line for the log."""
        packed = {"gemm": "csrc/gemm.c", "onednn": "oneDNN", "plain": "nobody (plain [out, in])"}[self.weight_format]
        text = f"weights packed for {packed} ({self.source})"
        decode, prefill = self.per_row(DECODE_ROWS), self.per_row((PREFILL_ROWS,))
        if decode:
            text += (f"; oneDNN's products take {decode['onednn'] / decode['gemm']:.2f}x csrc/gemm.c's time at "
                     f"{'/'.join(map(str, DECODE_ROWS))} rows, {prefill['onednn'] / prefill['gemm']:.2f}x at "
                     f"{PREFILL_ROWS}")
        for kernel, starts in (("AMX", self.amx_from), ("widen", self.widen_from), ("vnni", self.vnni_from)):
            shown = starts if kernel == "AMX" else {k: v for k, v in starts.items() if v != NEVER}
            if self.weight_format == "gemm" and shown:
                text += f"; {kernel} from " + ", ".join(f"{'never' if v == NEVER else f'{v} rows'} ({k})"
                                                        for k, v in shown.items())
        return text


def kernel_threshold(by_rows: dict[int, dict[str, float]], kernel: str, rivals: tuple[str, ...],
                     below: int = NEVER) -> int:
    """The smallest row count measured (under `below`) from which `kernel` is faster than each of `rivals` that
    was measured, at every count measured from there up to `below`; NEVER if at none (or it was not measured)."""
    start = NEVER
    for m in sorted((m for m in by_rows if m < below), reverse=True):
        t = by_rows[m]
        if kernel not in t or any(t[kernel] >= t[r] for r in rivals if r in t):
            break
        start = m
    return start


def amx_threshold(by_rows: dict[int, dict[str, float]]) -> int:
    """The smallest row count measured from which AMX's kernel is faster than each of csrc/gemm.c's others at
    every count measured; NEVER if at none (or it was not measured)."""
    return kernel_threshold(by_rows, "amx", tuple(k for k in GEMM_KERNELS if k != "amx"))


def quantized_thresholds(by_rows: dict[int, dict[str, float]], amx_from: int) -> tuple[int, int]:
    """widen_from and vnni_from (see the module's docstring) below amx_from."""
    vector = vector_kernel(tuple(next(iter(by_rows.values()), ())))
    widen_from = kernel_threshold(by_rows, "widen", (vector, "vnni"), amx_from)
    return widen_from, kernel_threshold(by_rows, "vnni", (vector,), min(widen_from, amx_from))


def decide(shapes: list[Shape], seconds: Timings, source: str) -> GemmChoice:
    """The choice the timings make (see the module's docstring)."""
    choice = GemmChoice("gemm", source, {s.name: amx_threshold(seconds[s.name]) for s in shapes}, seconds, shapes)
    for s in shapes:
        choice.widen_from[s.name], choice.vnni_from[s.name] = quantized_thresholds(seconds[s.name],
                                                                                   choice.amx_from[s.name])
    per_row = choice.per_row(DECODE_ROWS)
    if per_row["onednn"] * ONEDNN_MARGIN < per_row["gemm"]:
        choice.weight_format = "onednn"
    return choice


def choose_gemm(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, native: bool,
                quantization: str | None = None) -> GemmChoice:
    """How the model's linear layers will multiply (GemmChoice): measured here, or read from the cache, or
    forced by KVSERVE_GEMM. Off the CPU, or in another dtype, plain weights; where csrc/gemm.c does not
    multiply dtype, plain for the native step (native) or oneDNN's without it. Quantized weights are
    csrc/gemm.c's alone (its kernels are measured): a ValueError where it cannot take them. The choice is
    logged, forced or not (the test suite forces one: the log says which ran)."""
    choice = _choose(cfg, dtype, device, native, quantization)
    log.info("GEMMs: %s", choice.describe())
    return choice


def _choose(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, native: bool,
            quantization: str | None) -> GemmChoice:
    forced = os.environ.get(GEMM_ENV) or "measure"
    if forced not in CHOICES:
        raise ValueError(f"{GEMM_ENV} must be one of {', '.join(CHOICES)}, got {forced!r}")
    if quantization is not None:
        _check_quantizable(quantization, dtype, device, forced)
    if device.type != "cpu" or dtype not in COMPUTE_DTYPES:
        return GemmChoice("plain", f"{device.type} {dtype}: torch's own GEMMs")
    if forced == "onednn":
        return GemmChoice("onednn", f"{GEMM_ENV}=onednn")
    if not gemm_packs(dtype):
        return GemmChoice("plain" if native else "onednn", f"csrc/gemm.c does not multiply {dtype} on this CPU")
    shapes = model_shapes(cfg)
    kernels = gemm_kernels(dtype)
    if forced != "measure":
        if forced not in kernels:
            raise ValueError(f"{GEMM_ENV}={forced}: csrc/gemm.c has no {forced} kernel for {dtype} on this CPU "
                             f"(it has {', '.join(kernels)})")
        starts = {key: {s.name: rows for s in shapes} for key, rows in _forcing(forced).items()}
        return GemmChoice("gemm", f"{GEMM_ENV}={forced}", **starts)
    cache = TimingCache(dtype)
    seconds, measured = {}, False
    for s in shapes:
        key = s.key if quantization is None else f"{s.key}-{quantization}"
        timed = cache.get(key)
        if timed is None:
            timed, measured = time_shape(s, dtype, kernels, quantization), True
            cache.put(key, timed)
        seconds[s.name] = timed
    if measured:
        cache.save()
    return decide(shapes, seconds, "measured" if measured else "cached")


def _check_quantizable(quantization: str, dtype: torch.dtype, device: torch.device, forced: str) -> None:
    """A ValueError unless csrc/gemm.c multiplies the quantized weights here."""
    where = None
    if device.type != "cpu":
        where = f"the CPU only (csrc/gemm.c), not {device.type}"
    elif dtype not in COMPUTE_DTYPES or not gemm_packs(dtype):
        where = (f"csrc/gemm.c, which needs kernels built with AVX2 and FMA, AVX-512 (F, BW, VL; bfloat16 also "
                 f"BF16) or ARM64's NEON, a C compiler and a float32 or bfloat16 model; here it does not multiply "
                 f"{dtype}")
    elif forced == "onednn":
        where = f"csrc/gemm.c, not oneDNN ({GEMM_ENV}=onednn)"
    if where:
        raise ValueError(f"quantization={quantization!r} runs on {where}")


def time_shape(shape: Shape, dtype: torch.dtype, kernels: tuple[str, ...],
               quantization: str | None = None) -> dict[int, dict[str, float]]:
    """Seconds of one product of a random weight of the shape by each candidate, at each of ROWS: the best of
    _REPEATS, the candidates taking turns (a shared machine slows them alike). Quantized: csrc/gemm.c's kernels
    over its quantized panels."""
    n, k = shape.out_features, shape.in_features
    unit = 64 if shape.gated else 32            # whole panels (a gated weight's: pairs)
    timed_n = n if n * k <= _MAX_TIMED else max(unit, _MAX_TIMED // k // unit * unit)
    g = torch.Generator().manual_seed(n * 31 + k)
    w = torch.randn(timed_n, k, generator=g, dtype=dtype)
    packed = {}
    for fmt in ("gemm",) if quantization else ("gemm", "onednn"):
        layer = (GateUpLinear if shape.gated else Linear)(k, timed_n, bias=False, dtype=dtype)
        if layer.load(w.clone(), fmt, quantization) == fmt:
            packed[fmt] = layer
    del w
    # candidate -> (layer, its kernel plan): csrc/gemm.c's kernels share one packed weight; those of quantized
    # weights alone are measured on quantized weights
    candidates = {kernel: (packed["gemm"], _forcing(kernel)) for kernel in kernels
                  if quantization or kernel not in QUANTIZED_KERNELS}
    if "onednn" in packed:
        candidates["onednn"] = (packed["onednn"], _forcing("onednn"))
    out: dict[int, dict[str, float]] = {}
    with torch.inference_mode():
        for m in ROWS:
            x = torch.randn(m, k, generator=g, dtype=dtype)
            best = dict.fromkeys(candidates, float("inf"))
            runs, spent = dict.fromkeys(candidates, 0), dict.fromkeys(candidates, 0.0)
            for kernel, (layer, plan) in candidates.items():      # warm-up: first touch, caches
                layer.set_kernel_plan(plan)
                layer(x)
            while pending := [k for k in candidates if _more(runs[k], spent[k], best[k])]:
                for kernel in pending:
                    layer, plan = candidates[kernel]
                    layer.set_kernel_plan(plan)
                    start = time.perf_counter()
                    layer(x)
                    seconds = time.perf_counter() - start
                    best[kernel] = min(best[kernel], seconds)
                    runs[kernel], spent[kernel] = runs[kernel] + 1, spent[kernel] + seconds
            out[m] = {kernel: s * n / timed_n for kernel, s in best.items()}
    return out


def _forcing(kernel: str) -> dict[str, int]:
    """The kernel plan (Linear.kernel_plan) of a layer that runs `kernel` at every row count (the vector kernel's,
    or oneDNN's: none)."""
    return {f"{k}_from": 1 if kernel == k else NEVER for k in ("amx", "widen", "vnni")}


def _more(runs: int, spent: float, best: float) -> bool:
    """Whether a candidate is timed again (see _REPEATS)."""
    if runs and best > _LONG:
        return False
    return runs < _REPEATS or (spent < _BUDGET and runs < _MAX_RUNS)


class TimingCache:
    """time_shape's results for dtype, kept in a file per CPU and build of the kernels, torch version and thread
    count (any of them changes the times)."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = str(dtype).removeprefix("torch.")
        self.name = f"{build_key()}-torch{torch.__version__}-threads{torch.get_num_threads()}.json"
        self.entries: dict[str, dict[int, dict[str, float]]] = self._read().get(self.dtype, {})
        self.new: dict[str, dict[int, dict[str, float]]] = {}

    def _read(self) -> dict:
        for d in cache_dirs("gemm"):
            try:
                data = json.loads((d / self.name).read_text())
            except (OSError, ValueError):
                continue
            return {dtype: {key: {int(m): t for m, t in rows.items()} for key, rows in shapes.items()}
                    for dtype, shapes in data.items()}
        return {}

    def get(self, key: str) -> dict[int, dict[str, float]] | None:
        """The timings of a shape (Shape.key), if cached with every row count of ROWS."""
        timed = self.entries.get(key)
        return timed if timed is not None and set(ROWS) <= set(timed) else None

    def put(self, key: str, timed: dict[int, dict[str, float]]) -> None:
        self.entries[key] = self.new[key] = timed

    def save(self) -> None:
        """Add the new timings to the file (another process's since are kept), atomically; where no cache
        directory is writable, nothing is kept."""
        data = self._read()
        data.setdefault(self.dtype, {}).update(self.new)
        for d in cache_dirs("gemm"):
            try:
                d.mkdir(parents=True, exist_ok=True)
                with tempfile.NamedTemporaryFile("w", dir=d, delete=False, suffix=".tmp") as f:
                    json.dump(data, f)
                os.replace(f.name, d / self.name)
                return
            except OSError:
                continue
        log.warning("no writable directory for the GEMM timings among %s", ", ".join(map(str, cache_dirs("gemm"))))
