"""The KV pool's size on a GPU: gpu_memory_utilization less what is in use and the largest step's activations."""
from __future__ import annotations

import pytest
import torch

from kvserve import LLM
from kvserve.engine.gpu_memory import dummy_forward, kv_pool_bytes

GiB = 2**30


@pytest.fixture(scope="module")
def ckpt(checkpoint):
    return checkpoint("llama")


def test_pool_is_the_utilized_share_less_what_is_in_use_and_the_activations():
    # an 80 GiB card with 20 GiB in use (weights, context, others) and a 5 GiB activation peak
    assert kv_pool_bytes(80 * GiB, 60 * GiB, 5 * GiB, 0.9) == int(72 * GiB) - 20 * GiB - 5 * GiB
    assert kv_pool_bytes(80 * GiB, 10 * GiB, 5 * GiB, 0.9) < 0       # the engine refuses this


def test_dummy_step_covers_the_largest_batch(ckpt):
    llm = LLM(str(ckpt), device="cpu", num_kv_blocks=8, max_model_len=64)
    engine = llm.engine
    # 150 tokens as prompts of 64, 64 and 22: logits of the first 3 tokens, over the vocabulary
    logits = dummy_forward(engine.model, engine.backend, engine.device, 150, 64, 3)
    assert logits.shape == (3, engine.model_config.vocab_size) and logits.isfinite().all()


def test_gpu_memory_utilization_is_checked(ckpt):
    for bad in (0, -0.5, 1.5):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            LLM(str(ckpt), gpu_memory_utilization=bad)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_pool_on_a_gpu_comes_from_the_profile(ckpt):
    # requests long and many enough that the card, not the cap of what they could use, bounds the pool
    llm = LLM(str(ckpt), device="cuda", gpu_memory_utilization=0.5, max_model_len=10**6, max_num_seqs=1024,
              allow_long_max_model_len=True, max_num_batched_tokens=8192)
    total = torch.cuda.mem_get_info()[1]
    # far more than the fixed default a CPU gets, and within the share it was given
    assert 2 * 2**30 < llm.engine.storage.nbytes <= 0.5 * total
    small = LLM(str(ckpt), device="cuda", max_model_len=128, max_num_seqs=4)
    assert small.stats()["kv_blocks_total"] == 4 * 128 // small.engine.kv.block_size
