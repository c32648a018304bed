"""Property: whatever the pool, block size, token budget and mix, batching never changes tokens."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve import LLM, SamplingParams

MAX_NEW = 8


@pytest.fixture(scope="module")
def ckpt(checkpoint):
    return checkpoint("llama", max_position_embeddings=128)


@pytest.fixture(scope="module")
def reference(ckpt):
    """Greedy tokens of each prompt length, run alone with a roomy cache."""
    llm = LLM(str(ckpt), block_size=16, num_kv_blocks=16, max_num_seqs=1)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    return {n: llm.generate({"prompt_token_ids": prompt(n)}, params, use_tqdm=False)[0].outputs[0].token_ids
            for n in range(1, 41)}


def prompt(n: int) -> list[int]:
    return torch.randint(3, 384, (n,), generator=torch.Generator().manual_seed(n)).tolist()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lens=st.lists(st.integers(1, 40), min_size=1, max_size=8),
       max_tokens=st.lists(st.integers(1, MAX_NEW), min_size=8, max_size=8),
       block_size=st.integers(1, 9), spare_blocks=st.integers(0, 30),
       budget=st.integers(1, 64), max_num_seqs=st.integers(1, 8), chunk=st.integers(1, 50))
def test_batching_never_changes_tokens(ckpt, reference, lens, max_tokens, block_size, spare_blocks, budget,
                                       max_num_seqs, chunk):
    need = max(-(-(n + m) // block_size) for n, m in zip(lens, max_tokens))
    llm = LLM(str(ckpt), block_size=block_size, num_kv_blocks=need + spare_blocks,
              max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, long_prefill_token_threshold=chunk)
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in max_tokens[:len(lens)]]
    outs = llm.generate([{"prompt_token_ids": prompt(n)} for n in lens], params, use_tqdm=False)
    for n, m, out in zip(lens, max_tokens, outs):
        assert out.outputs[0].token_ids == reference[n][:m]
    stats = llm.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
