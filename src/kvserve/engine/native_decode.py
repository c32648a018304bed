"""Decode steps run on the CPU by one C call (`csrc/decode_step.c`).

The CPU's counterpart of CUDA graphs. Decoding a few tokens reads every weight once per step, so the
step is bound by memory reads; run op by op from Python, it loses as much time again in dispatch and
in the small-matrix overheads of a GEMM library. The C step reads the weights as torch's Linear keeps
them ([out, in]), so the engine keeps those, on huge pages, beside the packed copies
(`CausalLM.pack_weights(keep_weights=True)`): the weights take twice their memory, as CUDA graphs
take memory of their own. Past a few sequences the step multiplies by the packed copies (csrc/gemm.c),
and still saves the Python and the passes between the GEMMs of a step run op by op. `enforce_eager`
turns it off.
"""
from __future__ import annotations

import ctypes

import torch

from kvserve.attention import AttentionBatch
from kvserve.attention.native import DTYPE_KINDS, NativeBackend
from kvserve.config import EngineConfig
from kvserve.engine.cpu_memory import huge_page_buffer
from kvserve.kernels import function, library
from kvserve.kv.storage import KVStorage
from kvserve.model.decoder import CausalLM
from kvserve.model.layers import Linear

DTYPES = (torch.float32, torch.bfloat16)
# From this many sequences on, the step multiplies by the packed GEMM (csrc/gemm.c) rather than by its
# own matrix-vector products: measured by kvserve bench throughput's sweep and alternated A/Bs here, the
# GEMM streams the weights faster even for one float32 sequence (503 against 452 tok/s, medians of 5),
# and ties with the products' bfloat16 dot-product instruction at one bfloat16 sequence (691 against 694);
# at two it is 1.36x and 1.22x.
GEMM_FROM = {torch.float32: 1, torch.bfloat16: 2}
# Where the model is not packed for csrc/gemm.c, the step takes at most this many sequences; past it,
# op by op with oneDNN's GEMMs was faster (at 4 sequences the products were 1.07x those in float32,
# 0.80-0.90x in bfloat16, two runs here).
MAX_BATCH = {torch.float32: 4, torch.bfloat16: 2}


class _Proj(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in ("w", "b", "packed")]


class _Layer(ctypes.Structure):
    _fields_ = [*((name, _Proj) for name in ("qkv", "o", "gate_up", "down")),
                *((name, ctypes.c_void_p) for name in ("input_norm", "post_norm", "q_norm", "k_norm", "kv"))]


class _Model(ctypes.Structure):
    _fields_ = [*((name, ctypes.c_int) for name in ("num_layers", "hidden", "num_heads", "num_kv_heads",
                                                    "head_dim", "intermediate", "vocab", "dtype",
                                                    "num_blocks", "block_size")),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float),
                ("embed", ctypes.c_void_p), ("norm", ctypes.c_void_p), ("lm_head", _Proj),
                ("layers", ctypes.POINTER(_Layer))]


def _address(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _proj(linear: Linear) -> _Proj:
    """A linear layer as the C step takes it: weight, bias and, where packed for csrc/gemm.c, the packed
    copy."""
    return _Proj(_address(linear.weight), _address(linear.bias), _address(linear.packed) if linear.own_gemm else None)


def linear_rows(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
    """x [n, in] (float32) @ w [out, in].T by the decode step's own matrix-vector products, as float32
    (rounded to w's dtype); None where the kernels cannot be built."""
    if w.dtype not in DTYPES or x.shape[-1] != w.shape[1]:
        raise ValueError(f"linear_rows takes float32 or bfloat16 weights [out, in] and inputs [n, in]; got "
                         f"{w.dtype} {tuple(w.shape)} and {tuple(x.shape)}")
    p, i = ctypes.c_void_p, ctypes.c_int
    fn = function("linear_rows", (p, i, p, i, i, i, p, i))
    if fn is None:
        return None
    w, x = w.contiguous(), x.float().contiguous()
    y = torch.empty(x.shape[0], w.shape[0])
    fn(w.data_ptr(), DTYPE_KINDS[w.dtype], x.data_ptr(), x.shape[0], w.shape[1], w.shape[0], y.data_ptr(),
       torch.get_num_threads())
    return y


def native_decode_wanted(config: EngineConfig, device: torch.device, dtype: torch.dtype, backend) -> bool:
    """On the CPU unless enforce_eager: a float32 or bfloat16 model whose decode the native attention
    backend runs over a full-precision cache, and the kernels built."""
    return (device.type == "cpu" and not config.enforce_eager and dtype in DTYPES
            and isinstance(backend, NativeBackend) and config.cache_mode != "none"
            and config.kv_cache_dtype == "auto" and library() is not None)


def weights_to_huge_pages(model: CausalLM) -> None:
    """Move the weights the C step streams every time (the linear layers', the embedding's) into one
    buffer on huge pages; call before packing them, so that the packed copies reuse the freed memory."""
    params = [m.weight for m in model.modules() if isinstance(m, Linear)] + [model.model.embed_tokens.weight]
    params = list({p.data_ptr(): p for p in params}.values())        # tied weights once
    sizes = [-(-p.numel() * p.element_size() // 64) * 64 for p in params]
    buffer = huge_page_buffer(sum(sizes))
    offset = 0
    for p, size in zip(params, sizes):
        view = buffer[offset:offset + p.numel() * p.element_size()].view(p.dtype).view(p.shape)
        p.data = view.copy_(p.data)
        offset += size


class NativeDecode:
    """The model's weights and cache pages as the C step reads them, and `run` for one step."""

    def __init__(self, model: CausalLM, storage: KVStorage):
        cfg = model.config
        self.model = model
        if any(m.weight.numel() == 0 for m in model.modules() if isinstance(m, Linear)):
            raise ValueError("the C decode step reads the plain weights: pack them with keep_weights=True")
        p, i = ctypes.c_void_p, ctypes.c_int
        self.fn = function("decode_step", (ctypes.POINTER(_Model), i, p, p, p, p, i, p, p, p, p, i, i))
        layers = []
        for index, layer in enumerate(model.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            norms = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                     attn.q_norm.weight if attn.qk_norm else None, attn.k_norm.weight if attn.qk_norm else None,
                     storage.layer(index)]
            layers.append(_Layer(*map(_proj, (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)),
                                 *map(_address, norms)))
        self._layers = (_Layer * len(layers))(*layers)
        self.spec = _Model(cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                           cfg.intermediate_size, cfg.vocab_size, DTYPE_KINDS[model.lm_head.weight.dtype],
                           storage.num_blocks, storage.block_size, cfg.rms_norm_eps, cfg.head_dim ** -0.5,
                           _address(model.model.embed_tokens.weight), _address(model.model.norm.weight),
                           _proj(model.lm_head), self._layers)
        dtype = model.lm_head.weight.dtype
        # steps of more sequences run op by op unless every layer is packed for csrc/gemm.c
        self.gemm_from = GEMM_FROM[dtype]
        packed = all(m.own_gemm for m in model.modules() if isinstance(m, Linear))
        self.max_batch = None if packed else MAX_BATCH[dtype]
        self.steps = 0

    def can_run(self, batch: AttentionBatch, prompt_logprobs: bool) -> bool:
        """A step of decodes only (at most max_batch, where that is set) that needs nothing but the logits."""
        return (batch.num_prefills == 0 and (self.max_batch is None or len(batch.query_lens) <= self.max_batch)
                and batch.kv_write is None and not batch.mass_requests and not prompt_logprobs)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """Logits [n, vocab] of a decode step of n sequences; their K/V go to the cache."""
        n = len(input_ids)
        rope = self.model.rope
        logits = torch.empty(n, self.spec.vocab, dtype=self.model.lm_head.weight.dtype)
        self.fn(ctypes.byref(self.spec), n, input_ids.data_ptr(), positions.data_ptr(), batch.slot_mapping.data_ptr(),
                batch.block_tables.data_ptr(), batch.block_tables.shape[1], batch.context_lens.data_ptr(),
                rope.cos.data_ptr(), rope.sin.data_ptr(), logits.data_ptr(), self.gemm_from, torch.get_num_threads())
        self.steps += 1
        return logits
