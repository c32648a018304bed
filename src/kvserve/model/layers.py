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

from kvserve.kernels import COMPUTE_DTYPES, DTYPE_KINDS, fallback, function

ROPE_TYPES = ("default", "linear", "llama3", "longrope")
_PACK_BATCH_HINT = 64


class Linear(nn.Linear):
    """nn.Linear whose weight can be packed once for a CPU GEMM: the project's own (csrc/gemm.c) where this
    CPU's build multiplies the dtype, else oneDNN's prepacked one (2-3x faster than MKL's on many CPUs)."""

    packed: torch.Tensor | None = None
    own_gemm: bool = False     # packed for csrc/gemm.c (else for oneDNN)
    gated = False              # GateUpLinear: csrc/gemm.c packs it as a gated weight

    def reset_parameters(self) -> None:
        pass

    def pack(self, free_weight: bool = True) -> bool:
        """Pack the weight (CPU, float32/bfloat16); False if neither GEMM takes it here.

        The plain weight is then dropped, unless it is shared (tied embeddings), to not hold it twice.
        """
        w = self.weight.detach()
        if w.device.type != "cpu" or w.dtype not in COMPUTE_DTYPES:
            return False
        self.packed = gemm_pack(w, self.gated)
        self.own_gemm = self.packed is not None
        if not self.own_gemm:
            self.packed = onednn_pack(w)
            if self.packed is None:
                return False
        if free_weight:
            self.weight = nn.Parameter(w.new_empty(0), requires_grad=False)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        if self.own_gemm:
            return gemm(x, self.packed, self.bias, self.out_features)
        return onednn_linear(x, self.packed, self.bias)


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
            return gemm(x, self.packed, self.bias, half, gated=True)
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
    """csrc/gemm.c's `name` where this CPU's build multiplies dtype, else None."""
    dtypes = function("gemm_dtypes")
    if dtypes is None or dtype not in COMPUTE_DTYPES or not dtypes() >> DTYPE_KINDS[dtype] & 1:
        return None
    return function(name)


def gemm_packs(dtype: torch.dtype) -> bool:
    """Whether csrc/gemm.c multiplies dtype on this CPU (Linear.pack then packs for it)."""
    return _gemm_function("gemm", dtype) is not None


def gemm_pack(w: torch.Tensor, gated: bool = False) -> torch.Tensor | None:
    """w [out, in] packed for gemm(), or None (a fallback: see kvserve.kernels) where csrc/gemm.c does not
    multiply its dtype here. gated: w is [gate; up], for gemm(gated=True)."""
    size, pack = _gemm_function("gemm_packed_size", w.dtype), _gemm_function("gemm_pack", w.dtype)
    if pack is None:
        fallback("gemm_pack", f"csrc/gemm.c does not multiply {w.dtype} on this CPU (or the kernels are not built)")
        return None
    kind, (n, k) = DTYPE_KINDS[w.dtype], w.shape
    if gated and n % 2:
        raise ValueError(f"a gated weight has an even number of rows (gate and up), got {n}")
    packed = torch.empty(size(kind, n, k, gated), dtype=w.dtype)
    pack(w.contiguous().data_ptr(), kind, n, k, gated, packed.data_ptr())
    return packed


def gemm(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int,
         gated: bool = False) -> torch.Tensor:
    """F.linear(x, w, bias) by csrc/gemm.c, w packed by gemm_pack; gated: silu(gate) * up of out_features
    each, w packed gated."""
    if x.dtype != packed.dtype or (bias is not None and bias.dtype != packed.dtype):
        raise TypeError(f"Linear: input {x.dtype} and bias {None if bias is None else bias.dtype} must be the "
                        f"weight's dtype {packed.dtype}")
    if x.shape[-1] == 0:        # no products: the bias alone, as F.linear gives
        y = torch.zeros(*x.shape[:-1], out_features * (1 + gated), dtype=x.dtype)
        y = y if bias is None else y.add_(bias)
        return F.silu(y[..., :out_features]) * y[..., out_features:] if gated else y
    fn = _gemm_function("gemm", x.dtype)
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    y = torch.empty(*x.shape[:-1], out_features, dtype=x.dtype)
    fn(packed.data_ptr(), None if bias is None else bias.data_ptr(), DTYPE_KINDS[x.dtype], rows.data_ptr(),
       rows.stride(0), rows.shape[0], rows.shape[1], out_features, y.data_ptr(), gated, torch.get_num_threads())
    return y


class Embedding(nn.Embedding):
    def reset_parameters(self) -> None:
        pass


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
