"""Decode steps run on the CPU by one C call (`csrc/decode_step.c`).

The CPU's counterpart of CUDA graphs: run op by op from Python, a decode step loses time in dispatch
and in each op's own pass over the activations between the GEMMs; the C step runs them all in one
OpenMP team. Its linear layers are csrc/gemm.c's over the packed weights, the model's only copies (a
tied embedding table reads its rows from lm_head's). Where the weights are held plain (CPUs whose
csrc/gemm.c does not multiply the dtype), the step reads them as torch's Linear keeps them ([out, in]) by
matrix-vector products, which win only while reading the weights bounds the step: larger steps then run
op by op, by torch's F.linear over the same weights. `enforce_eager` turns it off; engine/executor.py
says which steps it runs and how the weights are held.

It computes the layers of every family ModelConfig reads: the Llama family's (Llama, Mistral, Qwen2/3,
Phi-3/4-mini: RMSNorm, QKV with biases, Qwen3's q/k norms, RoPE of any table, LongRoPE's too, over whole heads
or their first channels, SwiGLU) and Gemma 2/3's (GeGLU, (1 + weight) norms around each sublayer, scaled
embeddings, soft-capped scores and logits, query_pre_attn_scalar, the sliding layers' own RoPE table), each
layer over its own sliding window and its layer group's block tables (a hybrid cache).
"""
from __future__ import annotations

import ctypes

import torch

from kvserve.attention import AttentionBatch
from kvserve.attention.native import DTYPE_KINDS
from kvserve.kernels import check_layout, function, library
from kvserve.kv.storage import KVStorage
from kvserve.model.decoder import CausalLM
from kvserve.model.layers import WEIGHT_KINDS, Linear

DTYPES = (torch.float32, torch.bfloat16)
# Where the model is not packed for csrc/gemm.c, the step takes at most this many sequences: its
# matrix-vector products read each weight once per sequence, so past a few sequences op by op with
# torch's GEMMs, which read it once per step, wins (`kvserve bench throughput` sweeps both by batch size).
MAX_BATCH = {torch.float32: 4, torch.bfloat16: 2}


# copies of csrc/decode_step.c's structs (NativeDecode checks them against the library's: check_layout)
class _Proj(ctypes.Structure):
    _fields_ = [*((name, ctypes.c_void_p) for name in ("w", "b", "packed", "scales")),
                *((name, ctypes.c_int) for name in ("kind", "amx_from"))]


class _Layer(ctypes.Structure):
    _fields_ = [*((name, _Proj) for name in ("qkv", "o", "gate_up", "down")),
                *((name, ctypes.c_void_p) for name in ("input_norm", "post_norm", "q_norm", "k_norm", "kv")),
                ("window", ctypes.c_int64), ("group", ctypes.c_int), ("local_rope", ctypes.c_int),
                ("pre_ff_norm", ctypes.c_void_p), ("post_ff_norm", ctypes.c_void_p)]


_KIND_DTYPES = {kind: dtype for dtype, kind in DTYPE_KINDS.items()}
# rows, count, dtype kind -> 0, or nonzero where the collective failed
_ALL_REDUCE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int)


class _Model(ctypes.Structure):
    _fields_ = [*((name, ctypes.c_int) for name in ("num_layers", "hidden", "num_heads", "num_kv_heads",
                                                    "head_dim", "rotary_dim", "intermediate", "vocab", "dtype",
                                                    "num_blocks", "block_size")),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float),
                *((name, ctypes.c_int) for name in ("gelu", "gemma_norms")),
                *((name, ctypes.c_float) for name in ("embed_scale", "attn_cap", "logit_cap")),
                ("embed", ctypes.c_void_p), ("norm", ctypes.c_void_p), ("lm_head", _Proj),
                ("layers", ctypes.POINTER(_Layer)), ("vocab_start", ctypes.c_int64), ("all_reduce", _ALL_REDUCE)]


def _address(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _proj(linear: Linear) -> _Proj:
    """A linear layer as the C step takes it: the weight (where not packed for csrc/gemm.c), bias, the
    packed copy (where packed for csrc/gemm.c) with its numbers' kind and an int8 weight's scales, and the
    rows from which it runs AMX's kernel."""
    packed = _address(linear.packed) if linear.own_gemm else None
    kind = WEIGHT_KINDS[linear.packed.dtype if packed else linear.weight.dtype]
    return _Proj(None if packed else _address(linear.weight), _address(linear.bias), packed, _address(linear.scales),
                 kind, linear.amx_from)


def _table(model: CausalLM) -> int | None:
    """The embedding table as the C step takes it: None where its rows are read from lm_head's packed weight."""
    embed = model.model.embed_tokens
    return None if embed.rows_of is not None else _address(embed.weight)


def linear_rows(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
    """x [n, in] (float32) @ w [out, in].T by the decode step's own matrix-vector products, as float32
    (rounded to w's dtype); None where the kernels cannot be built (only outside KVSERVE_STRICT_KERNELS=1)."""
    if w.dtype not in DTYPES or x.shape[-1] != w.shape[1]:
        raise ValueError(f"linear_rows takes float32 or bfloat16 weights [out, in] and inputs [n, in]; got "
                         f"{w.dtype} {tuple(w.shape)} and {tuple(x.shape)}")
    fn = function("linear_rows")
    if fn is None:
        return None
    w, x = w.contiguous(), x.float().contiguous()
    y = torch.empty(x.shape[0], w.shape[0])
    fn(w.data_ptr(), DTYPE_KINDS[w.dtype], x.data_ptr(), x.shape[0], w.shape[1], w.shape[0], y.data_ptr(),
       torch.get_num_threads())
    return y


class _RankReduce:
    """The C step's all_reduce on a tensor-parallel rank: the rows summed by the rank's collective (TensorParallel),
    and the error of one that failed kept for the step's caller to raise (a callback's exception would not cross
    the C code)."""

    def __init__(self, tp):
        self.tp = tp
        self.error: BaseException | None = None
        self.callback = _ALL_REDUCE(self)

    def __call__(self, rows: int, count: int, kind: int) -> int:
        try:
            dtype = _KIND_DTYPES[kind]
            buffer = (ctypes.c_char * (count * dtype.itemsize)).from_address(rows)
            self.tp.all_reduce(torch.frombuffer(buffer, dtype=dtype))
            return 0
        except BaseException as e:  # noqa: BLE001  (raised by NativeDecode.run once the C step returns)
            self.error = e
            return 1


class NativeDecode:
    """The model's weights and cache pages as the C step reads them, `run` for one step and `run_steps`
    for several; `steps` counts the decode steps run. A tensor-parallel rank's shard runs its step with the
    all-reduces between its layers' halves, and its logits are gathered to rank 0 (not run_steps: each step's
    argmax would be over one rank's vocab rows)."""

    @staticmethod
    def reads(model: CausalLM) -> bool:
        """Whether the step reads the model's weights: every linear layer packed for csrc/gemm.c, or every one
        plain (not packed for oneDNN, where the GEMM choice took oneDNN's)."""
        formats = {m.weight_format for m in model.modules() if isinstance(m, Linear)}
        return formats in ({"gemm"}, {"plain"})

    def __init__(self, model: CausalLM, storage: KVStorage):
        for structure, name in ((_Proj, "Proj"), (_Layer, "Layer"), (_Model, "Model")):
            check_layout(library(), structure, name)
        cfg = model.config
        self.model = model
        linears = [m for m in model.modules() if isinstance(m, Linear)]
        self.packed = all(m.own_gemm for m in linears)
        if not self.packed and any(m.weight_format != "plain" for m in linears):
            raise ValueError("the C decode step reads every linear layer packed for csrc/gemm.c, or every one plain: "
                             f"got {sorted({m.weight_format for m in linears})}")
        tp, cfg = model.tp, model.shard_config         # (the whole model's config without tensor parallelism)
        self.reduce = None if tp is None else _RankReduce(tp)
        self.fn, self.steps_fn = function("decode_step"), function("decode_steps")
        # a hybrid cache's layer groups (kv/groups.py), each with its own block tables; else one
        owner = getattr(storage, "layer_group", None) or [0] * cfg.num_layers
        layers = []
        for index, layer in enumerate(model.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            norms = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                     attn.q_norm.weight if attn.qk_norm else None, attn.k_norm.weight if attn.qk_norm else None,
                     storage.layer(index).pages]
            gemma = [layer.pre_feedforward_layernorm.weight, layer.post_feedforward_layernorm.weight] \
                if layer.gemma_norms else [None, None]
            layers.append(_Layer(*map(_proj, (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)),
                                 *map(_address, norms), attn.sliding_window or 0, owner[index], attn.local_rope,
                                 *map(_address, gemma)))
        self._layers = (_Layer * len(layers))(*layers)
        dtype = model.lm_head.weight.dtype
        # the embedding scale rounded to the dtype, as CausalLM.forward multiplies by it
        embed_scale = float(torch.tensor(cfg.embed_scale, dtype=dtype))
        self.spec = _Model(cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                           cfg.rotary_dim, cfg.intermediate_size, cfg.vocab_size, DTYPE_KINDS[dtype],
                           storage.num_blocks, storage.block_size, cfg.rms_norm_eps,
                           model.model.layers[0].self_attn.scale, cfg.hidden_act != "silu", cfg.gemma_norms,
                           embed_scale, cfg.attn_logit_softcapping or 0.0, cfg.final_logit_softcapping or 0.0,
                           _table(model), _address(model.model.norm.weight),
                           _proj(model.lm_head), self._layers, 0 if tp is None else tp.rank * cfg.vocab_size,
                           _ALL_REDUCE() if tp is None else self.reduce.callback)
        # the packed GEMMs take any batch; the matrix-vector products only small ones
        self.max_batch = None if self.packed else MAX_BATCH[model.lm_head.weight.dtype]
        self.steps = 0

    @staticmethod
    def _tables(batch: AttentionBatch) -> tuple[ctypes.Array, ctypes.Array, ctypes.Array]:
        """Each layer group's slots, block tables and their widths, as the C step takes them (the first group's
        are the batch's own: AttentionBatch.groups holds the others')."""
        groups = [batch, *batch.groups]
        pointers = ctypes.c_void_p * len(groups)
        return (pointers(*(g.slot_mapping.data_ptr() for g in groups)),
                pointers(*(g.block_tables.data_ptr() for g in groups)),
                (ctypes.c_int * len(groups))(*(g.block_tables.shape[1] for g in groups)))

    def _rope_tables(self) -> tuple[int, int, int | None, int | None]:
        """RoPE's cos and sin, then the sliding layers' own (Gemma 3; else None): asked at each call, since a
        `sink` sequence that outgrows them reallocates them (CausalLM.ensure_rope)."""
        rope, local = self.model.rope, self.model.rope_local
        return (rope.cos.data_ptr(), rope.sin.data_ptr(), *((None, None) if local is None else
                                                            (local.cos.data_ptr(), local.sin.data_ptr())))

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch) -> torch.Tensor | None:
        """Logits [n, vocab] of a decode step of n sequences; their K/V go to the cache (each layer at its group's
        slots, a hybrid cache's). A tensor-parallel rank: rank 0 the whole vocab's, gathered; the others None. A
        failed collective is raised."""
        n = len(input_ids)
        logits = torch.empty(n, self.spec.vocab, dtype=self.model.lm_head.weight.dtype)
        slots, tables, widths = self._tables(batch)
        self.fn(ctypes.byref(self.spec), n, input_ids.data_ptr(), positions.data_ptr(), slots, tables, widths,
                batch.context_lens.data_ptr(), *self._rope_tables(), logits.data_ptr(), torch.get_num_threads())
        self.steps += 1
        if self.reduce is None:
            return logits
        if self.reduce.error is not None:
            error, self.reduce.error = self.reduce.error, None
            raise error
        return self.model.tp.gather_logits(logits, self.model.config.vocab_size)

    def run_steps(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                  steps: int) -> torch.Tensor:
        """Tokens [steps, n] of `steps` greedy decode steps of n sequences, each step's argmax the next one's
        input (their block tables, in every layer group, hold blocks for all the steps); input_ids, positions and
        the batch's context_lens advance in place."""
        if self.reduce is not None:
            raise ValueError("run_steps: a tensor-parallel rank's argmax would be over its own vocab rows")
        n = len(input_ids)
        logits = torch.empty(n, self.spec.vocab, dtype=self.model.lm_head.weight.dtype)
        tokens = torch.empty(steps, n, dtype=torch.int64)
        _, tables, widths = self._tables(batch)
        self.steps_fn(ctypes.byref(self.spec), n, steps, input_ids.data_ptr(), positions.data_ptr(), len(widths),
                      tables, widths, batch.context_lens.data_ptr(), *self._rope_tables(), logits.data_ptr(),
                      tokens.data_ptr(), torch.get_num_threads())
        self.steps += steps
        return tokens
