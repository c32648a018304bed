"""Every weight held once, whatever runs it: the tensors the model holds, and the process's resident memory."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from kvserve import LLM
from kvserve.bench.common import process_memory
from kvserve.kernels import STRICT_ENV
from kvserve.model import layers

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")


def checkpoint_bytes(path: Path, dtype: torch.dtype) -> int:
    """Bytes of the checkpoint's tensors in dtype: one copy of the weights (the tiny models' layers are whole
    panels of csrc/gemm.c: packing pads nothing)."""
    total = 0
    for file in path.glob("*.safetensors"):
        data = file.read_bytes()
        header = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])
        total += sum(torch.Size(t["shape"]).numel() * dtype.itemsize for name, t in header.items()
                     if name != "__metadata__")
    return total


def held_bytes(*objects) -> int:
    """Bytes of the distinct tensors the modules of `objects` (and the objects themselves) hold: parameters,
    buffers and tensor attributes such as a packed weight."""
    seen: dict[int, int] = {}
    for obj in objects:
        modules = list(obj.modules()) if isinstance(obj, torch.nn.Module) else [obj]
        for m in modules:
            tensors = [*vars(m).values()]
            if isinstance(m, torch.nn.Module):
                tensors += [*m.parameters(recurse=False), *m.buffers(recurse=False)]
            for t in tensors:
                if isinstance(t, torch.Tensor) and t.numel():
                    # (oneDNN's packed weights have no storage of torch's: each is its own)
                    key = id(t) if t.layout == torch._mkldnn else t.data_ptr()
                    seen[key] = max(seen.get(key, 0), t.numel() * t.element_size())
    return sum(seen.values())


CASES = {
    "gemm": (dict(), "gemm"),
    "gemm-tied": (dict(arch="qwen3", head_dim=32, tie_word_embeddings=True), "gemm"),
    "gemm-eager": (dict(enforce_eager=True), "gemm"),
    # CPUs whose csrc/gemm.c does not multiply the dtype: plain for the C step, oneDNN's without it
    "plain-native": (dict(no_gemm=True), "plain"),
    "plain-native-tied": (dict(no_gemm=True, arch="qwen3", head_dim=32, tie_word_embeddings=True), "plain"),
    "onednn-eager": (dict(no_gemm=True, enforce_eager=True), "onednn"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_model_holds_one_copy_of_its_weights(checkpoint, monkeypatch, case):
    kwargs, weight_format = CASES[case]
    kwargs = dict(kwargs)
    if kwargs.pop("no_gemm", False):
        monkeypatch.setenv(STRICT_ENV, "0")
        monkeypatch.setattr(layers, "_gemm_function", lambda *args: None)
    eager = kwargs.pop("enforce_eager", False)
    path = checkpoint(kwargs.pop("arch", "llama"), **kwargs)
    llm = LLM(str(path), block_size=4, num_kv_blocks=16, dtype="float32", enforce_eager=eager)
    model, native = llm.engine.model, llm.engine.runner.native
    formats = {m.weight_format for m in model.modules() if isinstance(m, layers.Linear)}
    tied = model.config.tie_word_embeddings
    # a tied lm_head is packed only where the table reads its rows back from it (csrc/gemm.c)
    assert formats == ({weight_format, "plain"} if tied and weight_format == "onednn" else {weight_format})
    assert (native is None) == eager
    assert held_bytes(model, *([native] if native else [])) == checkpoint_bytes(path, torch.float32)


def test_loading_peaks_at_about_one_copy_of_the_weights(checkpoint):
    """With glibc's heap keeping freed memory (cpu_allocator_tuning), a weight loaded, packed and dropped
    would stay resident: a process that loads the model and decodes peaks at one copy of the weights, and a
    little, above what it held before loading."""
    path = checkpoint("llama", dtype=torch.bfloat16, hidden_size=512, intermediate_size=2048,
                      num_hidden_layers=8, vocab_size=4096)
    weights = checkpoint_bytes(path, torch.bfloat16)
    kwargs = dict(block_size=16, num_kv_blocks=8, dtype="bfloat16", skip_tokenizer_init=True, cpu_allocator_tuning=True)
    memory = process_memory("kvserve", path, [[5] * 20] * 2, 4, "bfloat16", kwargs)
    assert memory["peak"] - memory["before_load"] <= 1.1 * weights + 32 * 2**20, (memory, weights)
