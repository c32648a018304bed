"""One decoder for the Llama family and its relatives (Llama 2/3, Mistral, Qwen2, Qwen3, Gemma 2/3, Phi-3), over a
flat token batch: the differences are switches of ModelConfig (biases, q/k norms, per-layer sliding windows,
soft-capping, GeGLU, Gemma's norms, scaled embeddings, a RoPE base of the sliding layers, partial RoPE)."""
from __future__ import annotations

import torch
from torch import nn

from kvserve.attention.batch import AttentionBatch
from kvserve.attention.mass import accumulate_attention_mass
from kvserve.config import ModelConfig
from kvserve.kv.nocache import NoKVStorage
from kvserve.kv.pages import LayerPages
from kvserve.kv.quant import rotate_keys_
from kvserve.kv.storage import KVStorage
from kvserve.model.embed_head import ParallelLMHead, VocabParallelEmbedding
from kvserve.model.layers import GemmaRMSNorm, RMSNorm, RotaryEmbedding, apply_rope_
from kvserve.model.linear import GateUpParallelLinear, GeluGateUpParallelLinear, QKVParallelLinear, RowParallelLinear
from kvserve.parallel.group import TensorParallel, place
from kvserve.parallel.sharding import shard_config


def _norm(cfg: ModelConfig, dim: int) -> RMSNorm:
    return (GemmaRMSNorm if cfg.gemma_norms else RMSNorm)(dim, cfg.rms_norm_eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TensorParallel | None = None):
        super().__init__()
        self.layer = layer
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads,
                                          bias=cfg.qkv_bias, tp=tp)
        self.o_proj = RowParallelLinear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias, tp=tp)
        # the heads of this layer's shard (qkv_proj's)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        self.sliding_window = cfg.sliding_windows[layer] if cfg.sliding_windows else None
        self.logits_soft_cap = cfg.attn_logit_softcapping
        self.rotary_dim = cfg.rotary_dim
        # the sliding layers' own RoPE base (Gemma 3): CausalLM.forward hands them its second table
        self.local_rope = self.sliding_window is not None and cfg.rope_local_base_freq is not None
        if cfg.qk_norm:
            self.q_norm = _norm(cfg, cfg.head_dim)
            self.k_norm = _norm(cfg, cfg.head_dim)
        self.qk_norm = cfg.qk_norm

    def forward(self, x, rope: tuple[torch.Tensor, torch.Tensor], batch: AttentionBatch, backend,
                kv_cache: LayerPages | None) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        tokens, nh, nkv, hd = qkv.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        # q, k and v stay views of qkv: rope rotates q and k in place, and k, v go to the cache
        # in one write since they are adjacent.
        qk = qkv[:, :self.q_size + self.kv_size].view(tokens, nh + nkv, hd)
        if self.qk_norm:
            qk[:, :nh] = self.q_norm(qk[:, :nh])
            qk[:, nh:] = self.k_norm(qk[:, nh:])
        apply_rope_(qk if self.rotary_dim == hd else qk[..., :self.rotary_dim], *rope)
        if kv_cache is not None and kv_cache.format.rotates_keys:
            # the cache stores its keys rotated: the queries turn alike, and every backend (and the
            # attention mass) sees the scores unchanged, the step's own fresh keys included
            rotate_keys_(qk)
        kv = qkv[:, self.q_size:].view(tokens, 2, nkv, hd)
        if kv_cache is not None:
            backend.store(kv_cache, kv, batch)
        out = backend.forward(qk[:, :nh], kv[:, 0], kv[:, 1], kv_cache, batch, self.scale,
                              sliding_window=self.sliding_window, logits_soft_cap=self.logits_soft_cap)
        if batch.mass_requests and (batch.mass_layers is None or self.layer in batch.mass_layers):
            accumulate_attention_mass(qk[:, :nh], kv_cache, batch, self.scale, self.logits_soft_cap)
        return self.o_proj(out.reshape(tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None):
        super().__init__()
        gate_up = GateUpParallelLinear if cfg.hidden_act == "silu" else GeluGateUpParallelLinear
        self.gate_up_proj = gate_up(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias, tp=tp)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias, tp=tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TensorParallel | None = None):
        super().__init__()
        self.self_attn = Attention(cfg, layer, tp)
        self.mlp = MLP(cfg, tp)
        self.input_layernorm = _norm(cfg, cfg.hidden_size)
        self.post_attention_layernorm = _norm(cfg, cfg.hidden_size)
        self.gemma_norms = cfg.gemma_norms
        if cfg.gemma_norms:
            self.pre_feedforward_layernorm = _norm(cfg, cfg.hidden_size)
            self.post_feedforward_layernorm = _norm(cfg, cfg.hidden_size)

    def forward(self, x, residual, rope, batch, backend, kv_cache):
        """The layer's output and the residual stream before it is added (None: x is the stream)."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, rope, batch, backend, kv_cache)
        if not self.gemma_norms:
            h, residual = self.post_attention_layernorm(h, residual)
            return self.mlp(h), residual
        # each sublayer's output is normed before it joins the stream
        h, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(h), residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = _norm(cfg, cfg.hidden_size)


class CausalLM(nn.Module):
    """Parameter names follow the Hugging Face checkpoints, with q/k/v and gate/up merged.

    With `tp` (a rank's group, parallel/group.py), the model is one rank's shard, cut and joined by its layers
    (model/linear.py, model/embed_head.py): `config` stays the whole model's, `shard_config` is the shape of the
    shard, and `tp` is kept for the executors' collectives (None: one rank)."""

    # checkpoint shard -> (merged parameter, index of the shard within it)
    stacked_params = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                      "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None):
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.shard_config = shard_config(cfg, place(tp)[1])
        self.model = DecoderModel(cfg, tp)
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, tp, soft_cap=cfg.final_logit_softcapping)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope: RotaryEmbedding | None = None
        self.rope_local: RotaryEmbedding | None = None      # the sliding layers' (Gemma 3), else None
        self.rope_max_model_len: int | None = None          # what LongRoPE chose its factors for

    def init_rope(self, max_positions: int, device: torch.device, max_model_len: int | None = None) -> None:
        """RoPE tables of the positions below max_positions. max_model_len (default: max_positions) picks
        LongRoPE's factors, long or short (see rope_inv_freq), for the tables' whole life."""
        cfg = self.config
        self.rope_max_model_len = max_model_len or max_positions
        self.rope = RotaryEmbedding(cfg.rotary_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, device,
                                    self.rope_max_model_len)
        if cfg.rope_local_base_freq is not None and cfg.has_sliding_window:
            self.rope_local = RotaryEmbedding(cfg.rotary_dim, max_positions, cfg.rope_local_base_freq, None, device)

    def ensure_rope(self, num_positions: int) -> None:
        """Cover positions below num_positions: a `sink` cache lets generation run past max_model_len."""
        size = len(self.rope.cos)
        if num_positions > size:
            self.init_rope(max(num_positions, 2 * size), self.rope.cos.device, self.rope_max_model_len)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                backend, storage: KVStorage | NoKVStorage) -> torch.Tensor:
        """Hidden states [tokens, hidden] of a flat batch; K/V of the new tokens go to `storage` (NoKVStorage: none)."""
        x = self.model.embed_tokens(input_ids)
        if self.config.embed_scale != 1.0:
            # the scale rounded to the embeddings' dtype first, as transformers' Gemma multiplies
            x = x * float(torch.tensor(self.config.embed_scale, dtype=x.dtype))
        rope = self.rope(positions, x.dtype)
        local = self.rope_local(positions, x.dtype) if self.rope_local is not None else None
        residual = None
        for i, layer in enumerate(self.model.layers):
            own = local if layer.self_attn.local_rope else rope
            x, residual = layer(x, residual, own, batch.for_layer(i), backend, storage.layer(i))
        return self.model.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits of hidden states [n, hidden]; soft-capped where the model caps them (Gemma 2). Tensor parallel:
        every rank's vocabulary shard gathered on rank 0; None on the others (ParallelLMHead)."""
        return self.lm_head(hidden)
