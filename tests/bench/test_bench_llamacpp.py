"""bench throughput's llama.cpp peer: the GGUF it converts holds the checkpoint, in llama.cpp's RoPE order."""
from __future__ import annotations

import gguf             # in the test extra; llama-cpp-python itself only in the peers extra
import pytest
import torch

from kvserve.bench.llamacpp import _to_ggml_rope, write_gguf


def _hf_rope(x: torch.Tensor, pos: int, base: float = 10000.0) -> torch.Tensor:
    """Hugging Face's RoPE of x [heads, d]: channel i turns with channel i + d/2."""
    d = x.shape[-1]
    angle = pos * base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    cos, sin = torch.cos(angle).repeat(2), torch.sin(angle).repeat(2)
    return x * cos + torch.cat((-x[..., d // 2:], x[..., :d // 2]), -1) * sin


def _ggml_rope(x: torch.Tensor, pos: int, base: float = 10000.0) -> torch.Tensor:
    """llama.cpp's RoPE of x [heads, d] for Llama: channel 2i turns with channel 2i + 1."""
    d = x.shape[-1]
    angle = pos * base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    even, odd = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = even * torch.cos(angle) - odd * torch.sin(angle)
    out[..., 1::2] = even * torch.sin(angle) + odd * torch.cos(angle)
    return out


def test_reordered_projections_give_llama_cpp_the_same_attention_scores():
    heads, d, hidden = 3, 8, 12
    g = torch.Generator().manual_seed(0)
    wq, wk = (torch.randn(heads * d, hidden, generator=g, dtype=torch.float64) for _ in range(2))
    x, y = torch.randn(hidden, generator=g, dtype=torch.float64), torch.randn(hidden, generator=g, dtype=torch.float64)
    q, k = _hf_rope((wq @ x).view(heads, d), 7), _hf_rope((wk @ y).view(heads, d), 3)
    q2 = _ggml_rope((_to_ggml_rope(wq, heads) @ x).view(heads, d), 7)
    k2 = _ggml_rope((_to_ggml_rope(wk, heads) @ y).view(heads, d), 3)
    torch.testing.assert_close((q2 * k2).sum(-1), (q * k).sum(-1))
    # and without the reorder the scores differ: the test can tell
    q3, k3 = _ggml_rope((wq @ x).view(heads, d), 7), _ggml_rope((wk @ y).view(heads, d), 3)
    assert not torch.allclose((q3 * k3).sum(-1), (q * k).sum(-1))


@pytest.mark.parametrize("tied", [False, True])
def test_gguf_holds_the_checkpoint(checkpoint, tmp_path, tied):
    from safetensors.torch import load_file

    path = checkpoint(tie_word_embeddings=tied)
    reader = gguf.GGUFReader(write_gguf(path, tmp_path / "model.gguf"))
    field = {f.name: f.contents() for f in reader.fields.values()}
    assert field["general.architecture"] == "llama" and field["tokenizer.ggml.model"] == "no_vocab"
    assert (field["llama.attention.head_count"], field["llama.attention.head_count_kv"]) == (4, 2)
    assert (field["llama.rope.dimension_count"], field["llama.block_count"], field["llama.vocab_size"]) == (16, 2, 384)

    weights = load_file(path / "model.safetensors")
    tensors = {t.name: t for t in reader.tensors}
    assert ("output.weight" in tensors) is not tied
    q = tensors["blk.1.attn_q.weight"]
    assert q.tensor_type == gguf.GGMLQuantizationType.BF16
    got = torch.from_numpy(q.data.copy()).view(torch.bfloat16).reshape(64, 64)
    assert torch.equal(got, _to_ggml_rope(weights["model.layers.1.self_attn.q_proj.weight"], 4).bfloat16())
    down = torch.from_numpy(tensors["blk.0.ffn_down.weight"].data.copy()).view(torch.bfloat16).reshape(64, 128)
    assert torch.equal(down, weights["model.layers.0.mlp.down_proj.weight"].bfloat16())
    norm = tensors["output_norm.weight"]
    assert norm.tensor_type == gguf.GGMLQuantizationType.F32
    assert torch.equal(torch.from_numpy(norm.data.copy()), weights["model.norm.weight"].float())


def test_only_llama_checkpoints_convert(checkpoint, tmp_path):
    path = checkpoint(arch="qwen2")
    with pytest.raises(ValueError, match="Llama checkpoints only, not 'qwen2'"):
        write_gguf(path, tmp_path / "model.gguf")
