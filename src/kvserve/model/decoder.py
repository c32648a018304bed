"""One decoder for the Llama family (Llama 2/3, Mistral, Qwen2, Qwen3), over a flat token batch."""
from __future__ import annotations

import torch
from torch import nn

from kvserve.attention.batch import AttentionBatch
from kvserve.attention.mass import accumulate_attention_mass
from kvserve.config import ModelConfig
from kvserve.kv.nocache import NoKVStorage
from kvserve.kv.storage import KVStorage
from kvserve.model.layers import Embedding, GateUpLinear, Linear, RMSNorm, RotaryEmbedding, apply_rope_


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.scale = cfg.head_dim ** -0.5
        self.qkv_proj = Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm

    def forward(self, x, rope: tuple[torch.Tensor, torch.Tensor], batch: AttentionBatch, backend,
                kv_cache: torch.Tensor | None) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        tokens, nh, nkv, hd = qkv.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        # q, k and v stay views of qkv: rope rotates q and k in place, and k, v go to the cache
        # in one write since they are adjacent.
        qk = qkv[:, :self.q_size + self.kv_size].view(tokens, nh + nkv, hd)
        if self.qk_norm:
            qk[:, :nh] = self.q_norm(qk[:, :nh])
            qk[:, nh:] = self.k_norm(qk[:, nh:])
        apply_rope_(qk, *rope)
        kv = qkv[:, self.q_size:].view(tokens, 2, nkv, hd)
        if kv_cache is not None:
            backend.store(kv_cache, kv, batch)
        out = backend.forward(qk[:, :nh], kv[:, 0], kv[:, 1], kv_cache, batch, self.scale)
        if batch.mass_requests:
            accumulate_attention_mass(qk[:, :nh], kv_cache, batch, self.scale)
        return self.o_proj(out.reshape(tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = GateUpLinear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, rope, batch, backend, kv_cache):
        """The layer's output and the residual stream before it is added (None: x is the stream)."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(h, rope, batch, backend, kv_cache), residual)
        return self.mlp(h), residual


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """Parameter names follow the Hugging Face checkpoints, with q/k/v and gate/up merged."""

    # checkpoint shard -> (merged parameter, index of the shard within it)
    stacked_params = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                      "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope: RotaryEmbedding | None = None

    def init_rope(self, max_positions: int, device: torch.device) -> None:
        cfg = self.config
        self.rope = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, device)

    def ensure_rope(self, num_positions: int) -> None:
        """Cover positions below num_positions: a `sink` cache lets generation run past max_model_len."""
        size = len(self.rope.cos)
        if num_positions > size:
            self.init_rope(max(num_positions, 2 * size), self.rope.cos.device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                backend, storage: KVStorage | NoKVStorage) -> torch.Tensor:
        """Hidden states [tokens, hidden] of a flat batch; K/V of the new tokens go to `storage` (NoKVStorage: none)."""
        x = self.model.embed_tokens(input_ids)
        rope = self.rope(positions, x.dtype)
        residual = None
        for i, layer in enumerate(self.model.layers):
            x, residual = layer(x, residual, rope, batch, backend, storage.layer(i))
        return self.model.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def shard_slice(self, name: str, shard: int) -> slice:
        """Rows of a merged parameter that hold one checkpoint shard."""
        cfg = self.config
        if name == "qkv_proj":
            sizes = [cfg.q_size, cfg.kv_size, cfg.kv_size]
        else:
            sizes = [cfg.intermediate_size, cfg.intermediate_size]
        start = sum(sizes[:shard])
        return slice(start, start + sizes[shard])
