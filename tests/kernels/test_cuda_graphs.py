"""Decode from CUDA graphs: padded static-buffer steps give the eager tokens.

On the CPU the graphs are built without capturing (DecodeGraphs(capture=False)) and the Triton
kernels run in the interpreter: everything but the capture itself is checked. On CUDA the same
test captures, and the engine's default (graphs on) is checked against enforce_eager.
"""
from __future__ import annotations

import triton_setup  # noqa: F401  (first: TRITON_INTERPRET before the kernels are imported)
import pytest
import torch
from triton_setup import DEVICE

from kvserve import LLM, SamplingParams
from kvserve.engine.cuda_graphs import DecodeGraphs, capture_sizes
from kvserve.engine.executor import CudaGraphs

CUDA = DEVICE.type == "cuda"


@pytest.fixture(scope="module")
def ckpt(checkpoint):
    return checkpoint("llama", max_position_embeddings=64)


def prompts_and_params():
    """Five requests of mixed lengths that finish at different steps: decode batches of 5, 4, 3, 2, 1."""
    g = torch.Generator().manual_seed(3)
    prompts = [{"prompt_token_ids": torch.randint(3, 384, (n,), generator=g).tolist()} for n in (3, 9, 1, 14, 6)]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (4, 7, 5, 3, 6)]
    return prompts, params


def tokens(llm: LLM) -> list[list[int]]:
    prompts, params = prompts_and_params()
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_capture_sizes_follow_vllms_ladder():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(16) == [1, 2, 4, 8, 16]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]


def test_padded_graph_steps_give_the_eager_tokens(ckpt):
    kwargs = dict(device=str(DEVICE), attention_backend="triton", block_size=4, num_kv_blocks=48, max_num_seqs=6,
                  enforce_eager=True)
    want = tokens(LLM(str(ckpt), **kwargs))
    llm = LLM(str(ckpt), **kwargs)
    engine = llm.engine
    graphs = DecodeGraphs(engine.model, engine.storage, engine.backend, 6, engine.max_model_len, engine.device,
                          capture=CUDA)
    graphs.capture_all()
    engine.runner.executors.insert(0, CudaGraphs(graphs, engine.model))
    assert tokens(llm) == want
    # 5 and 3 sequences ran padded to 6 and 4; 2 and 1 exactly
    assert graphs.replays[6] > 0 and graphs.replays[4] > 0 and graphs.replays[2] > 0 and graphs.replays[1] > 0
    assert llm.stats()["steps"]["cuda_graphs"] == sum(graphs.replays.values())
    # padding rows wrote nothing: every block is back, and a second run gives the same tokens
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]
    assert tokens(llm) == want


def test_steps_that_need_more_than_the_forward_run_eagerly(ckpt):
    llm = LLM(str(ckpt), device=str(DEVICE), attention_backend="triton", block_size=4, num_kv_blocks=48,
              max_num_seqs=2, enforce_eager=True)
    engine = llm.engine
    graphs = DecodeGraphs(engine.model, engine.storage, engine.backend, 2, engine.max_model_len, engine.device,
                          capture=CUDA)
    graphs.capture_all()
    engine.runner.executors.insert(0, CudaGraphs(graphs, engine.model))
    llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=3, ignore_eos=True,
                                                                 eviction="h2o:budget=8,recent=2"), use_tqdm=False)
    assert sum(graphs.replays.values()) == 0       # h2o scores every step's attention
    llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert sum(graphs.replays.values()) == 2       # the two decode steps after the prompt's
    assert llm.stats()["steps"] == {"eager": 4, "cuda_graphs": 2}


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_the_engine_captures_by_default_on_cuda(ckpt):
    graphed = LLM(str(ckpt), device="cuda", block_size=4, num_kv_blocks=48, max_num_seqs=6)
    assert graphed.engine.runner.graphs is not None
    eager = LLM(str(ckpt), device="cuda", block_size=4, num_kv_blocks=48, max_num_seqs=6, enforce_eager=True)
    assert eager.engine.runner.graphs is None
    assert tokens(graphed) == tokens(eager)
    assert sum(graphed.engine.runner.graphs.replays.values()) > 0
    assert graphed.stats()["steps"]["cuda_graphs"] == sum(graphed.engine.runner.graphs.replays.values())
