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
layer over its own sliding window and its layer group's block tables (a hybrid cache), and over its pages as they
are: the model's dtype, or quantized (kv_cache_dtype int8, fp8, int4; kv_cache_dtype_skip_layers mixes both),
whose K/V it writes as kv/quant.py's codecs write them, bit for bit (csrc/kv_codecs.c).

The structs it takes are csrc/decode_step.h's, built from that header (STRUCTS) and checked against the library
as a NativeDecode starts; step_plan says what each field holds, by its name, and kvserve.kernels.fill refuses a
plan that leaves one out.
"""
from __future__ import annotations

import ctypes

import torch

from kvserve.attention import AttentionBatch
from kvserve.attention.native import DTYPE_KINDS, cache_args
from kvserve.kernels import CSRC, c_structs, check_layout, fill, function, library
from kvserve.kv.pages import LayerPages
from kvserve.kv.storage import KVStorage
from kvserve.model.decoder import CausalLM, DecoderLayer
from kvserve.model.layers import WEIGHT_KINDS, Linear

DTYPES = (torch.float32, torch.bfloat16)
# Where the model is not packed for csrc/gemm.c, the step takes at most this many sequences: its
# matrix-vector products read each weight once per sequence, so past a few sequences op by op with
# torch's GEMMs, which read it once per step, wins (`kvserve bench throughput` sweeps both by batch size).
MAX_BATCH = {torch.float32: 4, torch.bfloat16: 2}

# csrc/decode_step.h's structs (and its all_reduce's function type), built from the header itself
STRUCTS = c_structs((CSRC / "decode_step.h").read_text())
Proj, Layer, Model, AllReduce = (STRUCTS[name] for name in ("Proj", "Layer", "Model", "AllReduce"))
_KIND_DTYPES = {kind: dtype for dtype, kind in DTYPE_KINDS.items()}


def _address(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _proj(linear: Linear) -> dict[str, object]:
    """A linear layer as the C step takes it (Proj): the weight (where not packed for csrc/gemm.c), bias, the packed
    copy (where packed for csrc/gemm.c) with its numbers' kind and an int8 weight's scales, and the rows from which
    it runs each of csrc/gemm.c's kernels (Linear.kernel_plan)."""
    packed = _address(linear.packed) if linear.own_gemm else None
    return {"w": None if packed else _address(linear.weight), "b": _address(linear.bias), "packed": packed,
            "scales": _address(linear.scales),
            "kind": WEIGHT_KINDS[linear.packed.dtype if packed else linear.weight.dtype], **linear.kernel_plan()}


def _cache(kv_cache: LayerPages) -> dict[str, object]:
    """A layer's pages as the C step takes them (Layer's kv fields): their address, kind and K and V scales as the
    attention kernels read them (attention/native.py's cache_args), and whether the keys are stored rotated (the
    queries then turn alike). ValueError for pages the kernels do not read."""
    args = cache_args(kv_cache)
    if args is None:
        raise ValueError(f"the C decode step does not read these pages ({kv_cache.format.name}, or not contiguous)")
    pages, kind, *_, k_meta, v_meta, summary, summary_kind = args
    return {"kv": pages, "kv_kind": kind, "k_meta": k_meta, "v_meta": v_meta, "summary": summary,
            "summary_kind": summary_kind, "rotate_keys": kv_cache.format.rotates_keys}


def _layer(layer: DecoderLayer, kv_cache: LayerPages, group: int) -> dict[str, object]:
    """A decoder layer as the C step takes it (Layer), over its cache, of its layer group."""
    attn, mlp, gemma = layer.self_attn, layer.mlp, layer.gemma_norms
    return {"qkv": _proj(attn.qkv_proj), "o": _proj(attn.o_proj), "gate_up": _proj(mlp.gate_up_proj),
            "down": _proj(mlp.down_proj), "input_norm": _address(layer.input_layernorm.weight),
            "post_norm": _address(layer.post_attention_layernorm.weight),
            "q_norm": _address(attn.q_norm.weight) if attn.qk_norm else None,
            "k_norm": _address(attn.k_norm.weight) if attn.qk_norm else None,
            **_cache(kv_cache), "window": attn.sliding_window or 0, "group": group, "local_rope": attn.local_rope,
            "pre_ff_norm": _address(layer.pre_feedforward_layernorm.weight) if gemma else None,
            "post_ff_norm": _address(layer.post_feedforward_layernorm.weight) if gemma else None}


def _table(model: CausalLM) -> int | None:
    """The embedding table as the C step takes it: None where its rows are read from lm_head's packed weight."""
    embed = model.model.embed_tokens
    return None if embed.rows_of is not None else _address(embed.weight)


def step_plan(model: CausalLM, storage: KVStorage, all_reduce) -> dict[str, object]:
    """Everything the C step reads of a model (a tensor-parallel rank's shard) and its cache, by the names of
    csrc/decode_step.h's fields: Model's, its `layers` a list of Layer's, a linear layer's (Proj's) a mapping in its
    field; all_reduce: an AllReduce (null without tensor parallelism). kvserve.kernels.fill builds the structs from
    it, and refuses a field left out."""
    cfg, tp = model.shard_config, model.tp
    dtype = model.lm_head.weight.dtype
    owner = storage.layer_group            # each layer's group: its block tables
    return {"num_layers": cfg.num_layers, "hidden": cfg.hidden_size, "num_heads": cfg.num_heads,
            "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "rotary_dim": cfg.rotary_dim,
            "intermediate": cfg.intermediate_size, "vocab": cfg.vocab_size, "dtype": DTYPE_KINDS[dtype],
            "num_blocks": storage.num_blocks, "block_size": storage.block_size, "eps": cfg.rms_norm_eps,
            "scale": model.model.layers[0].self_attn.scale, "gelu": cfg.hidden_act != "silu",
            "gemma_norms": cfg.gemma_norms,
            # the embedding scale rounded to the dtype, as CausalLM.forward multiplies by it
            "embed_scale": float(torch.tensor(cfg.embed_scale, dtype=dtype)),
            "attn_cap": cfg.attn_logit_softcapping or 0.0, "logit_cap": cfg.final_logit_softcapping or 0.0,
            "embed": _table(model), "norm": _address(model.model.norm.weight), "lm_head": _proj(model.lm_head),
            "layers": [_layer(layer, storage.layer(i), owner[i]) for i, layer in enumerate(model.model.layers)],
            "vocab_start": 0 if tp is None else tp.rank * cfg.vocab_size, "all_reduce": all_reduce}


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
        self.callback = AllReduce(self)

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
        for structure in (Proj, Layer, Model):
            check_layout(library(), structure)
        self.model = model
        linears = [m for m in model.modules() if isinstance(m, Linear)]
        self.packed = all(m.own_gemm for m in linears)
        if not self.packed and any(m.weight_format != "plain" for m in linears):
            raise ValueError("the C decode step reads every linear layer packed for csrc/gemm.c, or every one plain: "
                             f"got {sorted({m.weight_format for m in linears})}")
        self.reduce = None if model.tp is None else _RankReduce(model.tp)
        self.fn, self.steps_fn = function("decode_step"), function("decode_steps")
        self.spec = fill(Model, step_plan(model, storage, AllReduce() if self.reduce is None else self.reduce.callback))
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

    @staticmethod
    def _sparse(batch: AttentionBatch) -> tuple:
        """The step's sparse attention as the C step takes it: the sequences' options, counts, the record and its
        width (addresses; None and 0 without)."""
        sparse = batch.sparse
        if sparse is None:
            return None, None, None, 0
        record = sparse.record
        return (sparse.params.data_ptr(), sparse.counts.data_ptr(), None if record is None else record.data_ptr(),
                0 if record is None else record.shape[2])

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch) -> torch.Tensor | None:
        """Logits [n, vocab] of a decode step of n sequences; their K/V go to the cache (each layer at its group's
        slots, a hybrid cache's), the decodes under the batch's sparse attention. A tensor-parallel rank: rank 0
        the whole vocab's, gathered; the others None. A failed collective is raised."""
        n = len(input_ids)
        logits = torch.empty(n, self.spec.vocab, dtype=self.model.lm_head.weight.dtype)
        slots, tables, widths = self._tables(batch)
        self.fn(ctypes.byref(self.spec), n, input_ids.data_ptr(), positions.data_ptr(), slots, tables, widths,
                batch.context_lens.data_ptr(), *self._rope_tables(), *self._sparse(batch), logits.data_ptr(),
                torch.get_num_threads())
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
                      tables, widths, batch.context_lens.data_ptr(), *self._rope_tables(), *self._sparse(batch),
                      logits.data_ptr(), tokens.data_ptr(), torch.get_num_threads())
        self.steps += steps
        return tokens
