"""Building blocks of the decoder: linear and embedding layers, RMSNorm, rotary position embeddings.

Parameters are not initialised: the loader fills every one from the checkpoint (and checks it did).
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.config import QUANTIZATIONS
from kvserve.engine.cpu_memory import cpu_tensor
from kvserve.kernels import COMPUTE_DTYPES, DTYPE_KINDS, fallback, function, library

ROPE_TYPES = ("default", "linear", "llama3", "longrope")
_PACK_BATCH_HINT = 64
GEMM_KERNELS = ("avx512", "amx", "avx2", "neon", "vnni", "widen")     # csrc/gemm.c's kernels, as it numbers them
# csrc/gemm.c's kernels of quantized weights alone (bfloat16 products): elsewhere they run as its vector kernel
QUANTIZED_KERNELS = ("vnni", "widen")
NEVER = 2**31 - 1                    # the amx_from (vnni_from, widen_from) of a layer that never runs that kernel
WEIGHT_FORMATS = ("gemm", "onednn", "plain")
# the numbers of a packed weight, as csrc/common.h numbers their kinds
# (uint8: int4 numbers 0..15, one a byte unpacked, two a byte packed)
WEIGHT_KINDS = {**DTYPE_KINDS, torch.int8: 3, torch.uint8: 5}
INT4_GROUP = 32                      # k numbers of an int4 group (csrc/gemm.c's G4)


class Linear(nn.Linear):
    """nn.Linear whose weight is held once, in one of WEIGHT_FORMATS (`weight_format`): gemm (packed in
    panels for csrc/gemm.c, `packed`), onednn (oneDNN's prepacked weight, `packed`) or plain (`weight`
    [out, in], as torch keeps it). A packed layer's `weight` is an empty placeholder of its dtype."""

    packed: torch.Tensor | None = None
    scales: torch.Tensor | None = None      # int8: float32, one per output column; int4: its groups' (float16)
    quantization: str | None = None         # of QUANTIZATIONS
    weight_format = "plain"
    gated = False              # GateUpLinear: csrc/gemm.c packs it as a gated weight
    amx_from = NEVER           # csrc/gemm.c: the rows from which AMX's kernel multiplies, not the vector kernel
    # quantized weights, below amx_from: the rows from which csrc/gemm.c's kernel of the weight widened to the dtype
    # multiplies, and below those the rows from which its kernel of x rounded to int8 does (gemm_kernel)
    widen_from = NEVER
    vnni_from = NEVER
    # int8: the largest magnitude of each output column over all its inputs, where the layer holds a part of them
    # (RowParallelLinear), taken for the column's scale; None: the weight's own
    column_absmax: torch.Tensor | None = None

    def reset_parameters(self) -> None:
        pass

    @property
    def own_gemm(self) -> bool:
        """Whether csrc/gemm.c multiplies the layer (its weight packed for it)."""
        return self.weight_format == "gemm"

    def load(self, w: torch.Tensor, weight_format: str, quantization: str | None = None) -> str:
        """Hold w [out, in] in weight_format, and no other copy of it: plain where that packing does not take
        it (not on the CPU, not float32/bfloat16, or a fallback: see kvserve.kernels). Returns the format held.
        quantization "int8": w is quantized per output column (quantize_int8) into csrc/gemm.c's panels, whose
        products are those of the dequantized weight; a ValueError where csrc/gemm.c cannot take it."""
        if weight_format not in WEIGHT_FORMATS:
            raise ValueError(f"weight_format must be one of {WEIGHT_FORMATS}, got {weight_format!r}")
        if quantization is not None:
            self._load_quantized(w, weight_format, quantization)
            self.column_absmax = None
            return self.weight_format
        packed = None
        if weight_format != "plain" and w.device.type == "cpu" and w.dtype in COMPUTE_DTYPES:
            packed = gemm_pack(w, self.gated) if weight_format == "gemm" else onednn_pack(w)
        self.packed, self.scales, self.quantization = packed, None, None
        self.weight_format = "plain" if packed is None else weight_format
        self.weight = nn.Parameter(w if packed is None else w.new_empty(0), requires_grad=False)
        self.column_absmax = None
        return self.weight_format

    def _load_quantized(self, w: torch.Tensor, weight_format: str, quantization: str) -> None:
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS} (or None), got {quantization!r}")
        if weight_format != "gemm" or w.device.type != "cpu" or not gemm_packs(w.dtype):
            raise ValueError(f"quantization={quantization!r} multiplies by csrc/gemm.c's panels: kernels built "
                             f"with AVX2 and FMA, AVX-512 (F, BW, VL; for bfloat16 also BF16) or ARM64's NEON, a C "
                             f"compiler and a float32 or bfloat16 model; got a {w.dtype} weight on {w.device.type} "
                             f"packed as {weight_format!r}")
        if quantization == "int8":
            q, self.scales = quantize_int8(w, self.column_absmax)
        else:
            q, scales, mins = quantize_int4(w)
            self.scales = gemm_pack_groups(scales, mins, self.gated, w.dtype)
        self.packed = gemm_pack(q, self.gated, dtype=w.dtype)
        self.quantization, self.weight_format = quantization, "gemm"
        self.weight = nn.Parameter(w.new_empty(0), requires_grad=False)

    def pack(self) -> bool:
        """Pack the weight for csrc/gemm.c where it multiplies the dtype here, else for oneDNN (CPU,
        float32/bfloat16), dropping the plain copy; False (left plain) if neither takes it."""
        return self.load(self.weight.detach(), "gemm" if gemm_packs(self.weight.dtype) else "onednn") != "plain"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_format == "plain":
            return F.linear(x, self.weight, self.bias)
        if self.own_gemm:
            return gemm(x, self.packed, self.bias, self.out_features, scales=self.scales, **self.kernel_plan())
        return onednn_linear(x, self.packed, self.bias)

    def kernel_plan(self) -> dict[str, int]:
        """The rows from which csrc/gemm.c runs each of its kernels on this layer (gemm's keywords)."""
        return {"amx_from": self.amx_from, "widen_from": self.widen_from, "vnni_from": self.vnni_from}

    def set_kernel_plan(self, plan: dict[str, int]) -> None:
        """Run csrc/gemm.c's kernels from the rows `plan` gives (kernel_plan's keys)."""
        self.amx_from, self.widen_from, self.vnni_from = plan["amx_from"], plan["widen_from"], plan["vnni_from"]


class GeluGateUpLinear(Linear):
    """gate_proj and up_proj as one Linear [2 x intermediate, hidden] whose forward is the activation
    gelu_tanh(gate) * up (GeGLU, Gemma's MLP). Packed as a plain weight: csrc/gemm.c's epilogue computes SwiGLU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = super().forward(x).split(self.out_features // 2, dim=-1)
        return F.gelu(gate, approximate="tanh").mul_(up)


class GateUpLinear(Linear):
    """An MLP's gate_proj and up_proj as one Linear [2 x intermediate, hidden], whose forward is the
    activation silu(gate) * up (SwiGLU). csrc/gemm.c applies it as it writes the products, where it packs
    the weight: the 2 x intermediate products per token are not stored and read back by two more
    passes (torch's silu and mul_)."""

    gated = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        half = self.out_features // 2
        if self.own_gemm:
            return gemm(x, self.packed, self.bias, half, gated=True, scales=self.scales, **self.kernel_plan())
        gate, up = super().forward(x).split(half, dim=-1)
        return F.silu(gate).mul_(up)


def onednn_pack(w: torch.Tensor) -> torch.Tensor | None:
    """w [out, in] prepacked for oneDNN's GEMM (onednn_linear), or None (a fallback: see kvserve.kernels)
    where torch has no oneDNN."""
    if not torch.backends.mkldnn.is_available():
        fallback("onednn_pack", "this build of torch has no oneDNN")
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(w, _PACK_BATCH_HINT)
    except (RuntimeError, AttributeError) as e:
        fallback("onednn_pack", f"{type(e).__name__}: {e}")
        return None


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@lru_cache(maxsize=None)
def _gemm_function(name: str, dtype: torch.dtype):
    """csrc/gemm.c's `name` where the built library multiplies dtype (its gemm_dtypes), else None."""
    dtypes = function("gemm_dtypes")
    if dtypes is None or dtype not in COMPUTE_DTYPES or not dtypes() >> DTYPE_KINDS[dtype] & 1:
        return None
    return function(name)


def gemm_packs(dtype: torch.dtype) -> bool:
    """Whether csrc/gemm.c, as built here, multiplies dtype (Linear.pack then packs for it)."""
    return _gemm_function("gemm", dtype) is not None


def quantize_int8(w: torch.Tensor, absmax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] as int8 q and a float32 scale per output column, symmetric: scale = max |w| / 127 of the
    column (1 for a column of zeros), q = round(w / scale); w's dequantized weight is q * scale (in float32).
    absmax: each column's max |w| where w holds a part of its inputs (a tensor-parallel rank's), float32.
    In blocks of columns, so that no float32 copy of the whole weight is held."""
    q = cpu_tensor(tuple(w.shape), torch.int8) if w.device.type == "cpu" else torch.empty_like(w, dtype=torch.int8)
    scales = torch.empty(w.shape[0], dtype=torch.float32, device=w.device)
    block = max(1, 2**22 // max(1, w.shape[1]))
    work = _work_block(w, block, w.shape[1])
    for start in range(0, w.shape[0], block):
        rows = w[start:start + block]
        part = work[:len(rows)].copy_(rows)
        # max |w|, with no |w| block
        most = (torch.maximum(part.amax(dim=1), part.amin(dim=1).neg_()) if absmax is None
                else absmax[start:start + block])
        scale = most / 127
        scale[scale == 0] = 1.0
        q[start:start + block] = part.div_(scale[:, None]).round_().clamp_(-127, 127)
        scales[start:start + block] = scale
    return q, scales


def _work_block(w: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """A float32 block [min(rows, w's), width] in which a quantizer works on w's rows. On the CPU a mapping of
    its own (cpu_tensor), unmapped once the weight is quantized: taken from glibc's heap, each layer's blocks
    left pages there that it did not hand back, about one more copy of the quantized weights by the end of
    loading."""
    shape = (min(rows, w.shape[0]), width)
    return cpu_tensor(shape, torch.float32) if w.device.type == "cpu" else torch.empty(shape, device=w.device)


def dequantize(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The weight (float32) whose products an int8 layer computes: q * scale, column by column."""
    return q.float() * scales[:, None]


def quantize_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [out, in] as int4 numbers q (0..15, one a byte: uint8) with a float16 scale and minimum per output column
    and group of INT4_GROUP inputs (the last group may be shorter), asymmetric: min = the group's smallest number,
    scale = (largest - min) / 15 (1 where they are equal), both rounded to float16, q = round((w - min) / scale).
    dequantize_int4 gives the weight (float32) whose products an int4 layer computes (rounded to its dtype where
    csrc/gemm.c widens it: float32 products, and AMX's tiles)."""
    n, k = w.shape
    groups = -(-k // INT4_GROUP)
    q = cpu_tensor((n, k), torch.uint8) if w.device.type == "cpu" else torch.empty_like(w, dtype=torch.uint8)
    scales = torch.empty(n, groups, dtype=torch.float16, device=w.device)
    mins = torch.empty_like(scales)
    block = max(1, 2**22 // max(1, k))
    work = _work_block(w, block, groups * INT4_GROUP)
    for start in range(0, n, block):
        rows = w[start:start + block]
        part = work[:len(rows)]
        part[:, :k] = rows
        if groups * INT4_GROUP > k:     # the short group filled with its own last number: no new min or max
            part[:, k:] = part[:, k - 1:k]
        g = part.view(len(part), groups, INT4_GROUP)
        low, high = g.amin(dim=-1), g.amax(dim=-1)
        scale = ((high - low) / 15).to(torch.float16)
        scale[scale == 0] = 1.0
        low = low.to(torch.float16)
        g.sub_(low.float()[..., None]).div_(scale.float()[..., None]).round_().clamp_(0, 15)
        q[start:start + block] = g.view(len(part), -1)[:, :k]
        scales[start:start + block], mins[start:start + block] = scale, low
    return q, scales, mins


def dequantize_int4(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """The weight (float32) of quantize_int4's numbers: q * scale + min, group by group."""
    k = q.shape[1]
    expand = lambda t: t.float().repeat_interleave(INT4_GROUP, dim=1)[:, :k]   # noqa: E731
    return q.float() * expand(scales) + expand(mins)


def gemm_pack_groups(scales: torch.Tensor, mins: torch.Tensor, gated: bool, dtype: torch.dtype) -> torch.Tensor:
    """An int4 weight's scales and minimums ([out, groups], float16) laid out beside its panels (gemm_pack of
    its numbers for products in dtype), as gemm() takes them."""
    size, pack = _gemm_function("gemm_groups_size", dtype), _gemm_function("gemm_pack_groups", dtype)
    n, k = scales.shape[0], scales.shape[1] * INT4_GROUP
    out = cpu_tensor((size(DTYPE_KINDS[dtype], n, k, gated),), torch.float16)     # on huge pages, as the panels
    pack(scales.contiguous().data_ptr(), mins.contiguous().data_ptr(), DTYPE_KINDS[dtype], n, k, gated, out.data_ptr())
    return out


def gemm_pack(w: torch.Tensor, gated: bool = False, dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """w [out, in] packed for gemm(), or None (a fallback: see kvserve.kernels) where csrc/gemm.c does not
    multiply the products' dtype here. dtype: that of the products, w's unless w is int8 (quantize_int8) or int4
    (uint8, quantize_int4: packed two a byte). gated: w is [gate; up], for gemm(gated=True)."""
    dtype = dtype or w.dtype
    size, pack = _gemm_function("gemm_packed_size", dtype), _gemm_function("gemm_pack", dtype)
    if pack is None:
        fallback("gemm_pack", f"csrc/gemm.c does not multiply {dtype} on this CPU (or the kernels are not built)")
        return None
    if w.dtype not in (dtype, torch.int8, torch.uint8):
        raise TypeError(f"gemm_pack takes a weight of the products' dtype {dtype}, int8 or int4 (uint8), got {w.dtype}")
    kind, (n, k) = WEIGHT_KINDS[w.dtype], w.shape
    if gated and n % 2:
        raise ValueError(f"a gated weight has an even number of rows (gate and up), got {n}")
    numbers = size(kind, DTYPE_KINDS[dtype], n, k, gated)
    packed = cpu_tensor((numbers // 2 if w.dtype == torch.uint8 else numbers,), w.dtype)
    pack(w.contiguous().data_ptr(), kind, DTYPE_KINDS[dtype], n, k, gated, packed.data_ptr())
    return packed


def gemm_kernels(dtype: torch.dtype) -> tuple[str, ...]:
    """The kernels csrc/gemm.c runs for dtype in this process, of GEMM_KERNELS, as the built library reports them:
    its vector kernel wherever it multiplies dtype (avx512; avx2 in a build for a CPU without AVX-512, see
    kvserve.kernels.march; neon in an ARM64 build); amx for bfloat16 where the build and the CPU have AMX and the OS
    grants this process its tile state (asked here)."""
    fn = _gemm_function("gemm_kernels", dtype)
    if fn is None:
        return ()
    bits = fn()
    return tuple(k for i, k in enumerate(GEMM_KERNELS)
                 if bits >> i & 1 and (k not in ("amx", *QUANTIZED_KERNELS) or dtype == torch.bfloat16))


def vector_kernel(kernels: tuple[str, ...]) -> str:
    """The kernel of `kernels` (csrc/gemm.c's, or a timing's candidates) that multiplies below a layer's amx_from:
    its vector kernel, avx512, avx2 or neon (avx512 where it has none)."""
    return next((k for k in kernels if k in ("avx512", "avx2", "neon")), "avx512")


def gemm_kernel(rows: int, vector: str, amx_from: int = NEVER, widen_from: int = NEVER, vnni_from: int = NEVER) -> str:
    """The kernel of GEMM_KERNELS that multiplies `rows` rows: amx from amx_from rows, below that widen from
    widen_from, below that vnni from vnni_from, below that the vector kernel (avx512, avx2 or neon)."""
    for kernel, start in (("amx", amx_from), ("widen", widen_from), ("vnni", vnni_from)):
        if rows >= start:
            return kernel
    return vector


def gemm(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int,
         gated: bool = False, amx_from: int = NEVER, scales: torch.Tensor | None = None, widen_from: int = NEVER,
         vnni_from: int = NEVER) -> torch.Tensor:
    """F.linear(x, w, bias) by csrc/gemm.c, w packed by gemm_pack (quantized: with its scales, int8's or int4's
    gemm_pack_groups, and w its dequantized weight); gated: silu(gate) * up of out_features each, w packed gated.
    The kernel at x's row count is gemm_kernel's (where gemm_kernels has it; else csrc/gemm.c runs its vector
    kernel, as it does for weights that are not quantized where the kernel is one of QUANTIZED_KERNELS)."""
    quantized = packed.dtype in (torch.int8, torch.uint8)
    if quantized != (scales is not None) or (not quantized and x.dtype != packed.dtype) or \
            (bias is not None and bias.dtype != x.dtype):
        raise TypeError(f"Linear: input {x.dtype} and bias {None if bias is None else bias.dtype} must be of one "
                        f"dtype, the weight's {packed.dtype} unless quantized (with scales: {scales is not None})")
    if x.shape[-1] == 0:        # no products: the bias alone, as F.linear gives
        y = torch.zeros(*x.shape[:-1], out_features * (1 + gated), dtype=x.dtype)
        y = y if bias is None else y.add_(bias)
        return F.silu(y[..., :out_features]) * y[..., out_features:] if gated else y
    fn = _gemm_function("gemm", x.dtype)
    kernel = gemm_kernel(x.numel() // x.shape[-1], _vector_kernel(library(), x.dtype), amx_from, widen_from,
                         vnni_from)
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    y = torch.empty(*x.shape[:-1], out_features, dtype=x.dtype)
    fn(packed.data_ptr(), None if scales is None else scales.data_ptr(), WEIGHT_KINDS[packed.dtype],
       None if bias is None else bias.data_ptr(), DTYPE_KINDS[x.dtype], rows.data_ptr(), rows.stride(0), rows.shape[0],
       rows.shape[1], out_features, y.data_ptr(), gated,
       GEMM_KERNELS.index(kernel), torch.get_num_threads())
    return y


@lru_cache(maxsize=None)
def _vector_kernel(lib: object, dtype: torch.dtype) -> str:
    """vector_kernel of the library lib's kernels (kvserve.kernels.library: one answer per build)."""
    return vector_kernel(gemm_kernels(dtype))


class Embedding(nn.Embedding):
    """nn.Embedding whose table may be the packed weight of a tied lm_head (`rows_of`), its only copy."""

    rows_of: Linear | None = None

    def reset_parameters(self) -> None:
        pass

    def share_with(self, lm_head: Linear) -> None:
        """Read the table's rows from lm_head's weight, packed for csrc/gemm.c from this table, and drop the
        table's own copy."""
        if not lm_head.own_gemm:
            raise ValueError("an embedding reads its rows only from a weight packed for csrc/gemm.c")
        object.__setattr__(self, "rows_of", lm_head)      # not a submodule: lm_head stays the model's alone
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.rows_of is None:
            return super().forward(ids)
        flat = ids.reshape(-1).contiguous()
        out = torch.empty(len(flat), self.embedding_dim, dtype=self.weight.dtype)
        if len(flat) and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            raise IndexError(f"token ids must be in [0, {self.num_embeddings}), got {flat.min()}..{flat.max()}")
        head = self.rows_of
        function("gemm_rows")(head.packed.data_ptr(), None if head.scales is None else head.scales.data_ptr(),
                              WEIGHT_KINDS[head.packed.dtype], DTYPE_KINDS[out.dtype], self.embedding_dim,
                              flat.data_ptr(), len(flat), out.data_ptr(), torch.get_num_threads())
        return out.view(*ids.shape, self.embedding_dim)


def _layer_op(name: str, x: torch.Tensor, *contiguous: torch.Tensor):
    """The C kernel `name` (csrc/layer_ops.c) where it runs on x (CPU, float32/bfloat16) and the tensors
    in `contiguous` are, else None."""
    if x.device.type != "cpu" or x.dtype not in COMPUTE_DTYPES or not all(t.is_contiguous() for t in contiguous):
        return None
    return function(name)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """RMSNorm(x); with a residual, it first becomes residual + x (in place), and both are returned:
        (RMSNorm(residual + x), residual + x). One C pass on the CPU."""
        same = self.weight.dtype == x.dtype and (residual is None or residual.dtype == x.dtype)
        fn = _layer_op("add_rms_norm", x, x, *([] if residual is None else [residual])) if same else None
        if fn is None:
            if residual is None:
                return self._norm(x)
            return self._norm(residual.add_(x)), residual
        out = torch.empty_like(x)
        rows, dim = x.numel() // x.shape[-1], x.shape[-1]
        # without a residual, x is normalised where the kernel reads the residual, and left as it is
        fn(None if residual is None else x.data_ptr(), (x if residual is None else residual).data_ptr(),
           self.weight.data_ptr(), out.data_ptr(), rows, dim, self.eps, DTYPE_KINDS[x.dtype],
           torch.get_num_threads())
        return out if residual is None else (out, residual)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalise in float32 and scale in x's dtype, rounding where the reference does.
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: it scales by (1 + weight), all in float32, rounded once to x's dtype."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """RMSNorm's promise: with a residual, it first becomes residual + x (in place), and both are returned."""
        if residual is None:
            return self._norm(x)
        return self._norm(residual.add_(x)), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), self.weight.shape, self.weight.float() + 1.0, self.eps).to(x.dtype)


def rope_inv_freq(dim: int, theta: float, scaling: dict[str, Any] | None,
                  max_model_len: int | None = None) -> torch.Tensor:
    """Inverse frequencies of RoPE over `dim` channels, with linear, Llama 3 or LongRoPE scaling. LongRoPE
    (Phi-3) divides them by its long factors where max_model_len exceeds the original context, else by its
    short ones: one table for every sequence (vLLM's rule), as the keys in the cache keep their rotation."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    if rope_type == "longrope":
        long = max_model_len is not None and max_model_len > scaling["original_max_position_embeddings"]
        factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
        if factors.shape != inv_freq.shape:
            raise ValueError(f"longrope's factors must number {len(inv_freq)} (half the rotated channels), "
                             f"got {len(factors)}")
        return inv_freq / factors
    raise ValueError(f"unsupported rope_scaling type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")


def rope_attention_factor(scaling: dict[str, Any] | None) -> float:
    """What cos and sin are multiplied by: LongRoPE's attention factor (transformers' default where the
    config gives none), else 1."""
    if (scaling or {}).get("rope_type") != "longrope":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


class RotaryEmbedding:
    """Precomputed cos/sin for every position up to max_positions (rotate-half layout) over `dim` channels."""

    def __init__(self, dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None, device: torch.device, max_model_len: int | None = None):
        inv_freq = rope_inv_freq(dim, theta, scaling, max_model_len)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        # rotate_half(x) = cat(-x2, x1) = roll(x, d/2) * [-1.., +1..]: fold the sign into sin
        sign = torch.cat((-torch.ones_like(inv_freq), torch.ones_like(inv_freq)))
        factor = rope_attention_factor(scaling)
        self.cos, self.sin = (emb.cos() * factor).to(device), (emb.sin() * factor * sign).to(device)

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin [T, 1, D] of a step's positions, computed once for all layers."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate x [..., D] in place: x * cos + rotate_half(x) * sin (cos, sin broadcast to x). One C pass
    on the CPU for a step's x [T, heads, D] whose heads are adjacent (q and k, views of qkv's rows)
    and its cos, sin [T, 1, D]."""
    d = x.shape[-1]
    fits = x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == d and cos.shape == sin.shape == (len(x), 1, d) \
        and cos.dtype == sin.dtype == x.dtype
    fn = _layer_op("rope", x, cos, sin) if fits else None
    if fn is None:
        rolled = x.roll(d // 2, dims=-1)
        x.mul_(cos).addcmul_(rolled, sin)
        return
    fn(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], d, cos.data_ptr(), sin.data_ptr(), DTYPE_KINDS[x.dtype],
       torch.get_num_threads())
