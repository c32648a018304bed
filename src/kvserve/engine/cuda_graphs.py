"""Decode steps replayed from CUDA graphs: the model's forward captured once per batch size.

A step of decodes only runs from the graph of the smallest captured size that holds it; the rows
past its sequences are padding that writes no K/V (slot -1) and reads no context (length 0). The
graph reads its inputs from static buffers that each step fills first, and launches its decode
kernels for the longest context it serves (max_model_len, at most MAX_CONTEXT as vLLM's
max_seq_len_to_capture), so the same launches serve every step. Which steps run from the graphs
(decodes that need nothing but the forward, within the captured sizes and context, while the RoPE
table is the one the graphs read) is for engine/executor.py's CudaGraphs to say.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvserve.attention import AttentionBatch
from kvserve.kv.storage import KVStorage
from kvserve.model.decoder import CausalLM

log = logging.getLogger(__name__)
MAX_CONTEXT = 8192


def capture_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's ladder: 1, 2, 4, then every multiple of 8, up to max_num_seqs (always included)."""
    sizes = [s for s in (1, 2, 4, *range(8, max_num_seqs + 1, 8)) if s <= max_num_seqs]
    return sizes if sizes[-1] == max_num_seqs else [*sizes, max_num_seqs]


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph | None   # None when built without capturing (the CPU tests)
    hidden: torch.Tensor                 # [size, hidden] the graph's output


class DecodeGraphs:
    """Static input buffers, one graph per size, and `run` that pads a step to the next size.

    capture=False builds the same padded, static-buffer steps and runs them eagerly: how the CPU
    tests check everything here but the capture itself."""

    def __init__(self, model: CausalLM, storage: KVStorage, backend, max_num_seqs: int, max_model_len: int,
                 device: torch.device, capture: bool = True):
        self.model, self.storage, self.backend = model, storage, backend
        self.max_context, self.capture = min(max_model_len, MAX_CONTEXT), capture
        self.sizes = capture_sizes(max_num_seqs)
        n = self.sizes[-1]
        max_blocks = -(-self.max_context // storage.block_size)
        long = dict(dtype=torch.long, device=device)
        self.input_ids = torch.zeros(n, **long)
        self.positions = torch.zeros(n, **long)
        self.slot_mapping = torch.full((n,), -1, **long)
        self.block_tables = torch.zeros(n, max_blocks, **long)
        self.context_lens = torch.zeros(n, **long)
        self.graphs: dict[int, _Captured] = {}
        self.replays = dict.fromkeys(self.sizes, 0)
        self.rope_table = model.rope.cos        # the graphs read it: reallocated (ensure_rope), it is not theirs

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture the largest size first, so that smaller graphs reuse its memory pool."""
        pool = torch.cuda.graph_pool_handle() if self.capture else None
        for size in reversed(self.sizes):
            self.graphs[size] = self._capture(size, pool)
        if self.capture:
            log.info("CUDA graphs: decode captured at %d batch sizes up to %d", len(self.sizes), self.sizes[-1])

    def _batch(self, size: int) -> AttentionBatch:
        return AttentionBatch(num_decodes=size, slot_mapping=self.slot_mapping[:size],
                              block_tables=self.block_tables[:size], context_lens=self.context_lens[:size],
                              query_lens=[1] * size, context_lens_list=[self.max_context] * size,
                              has_prefix=False, decode_context_bound=self.max_context)

    def _forward(self, size: int, batch: AttentionBatch) -> torch.Tensor:
        return self.model(self.input_ids[:size], self.positions[:size], batch, self.backend, self.storage)

    def _capture(self, size: int, pool) -> _Captured:
        if not self.capture:
            return _Captured(None, torch.empty(0))
        self._forward(size, self._batch(size))      # compiles the kernels and settles the allocator
        torch.cuda.synchronize()
        # a fresh batch: what the backends derive from the inputs (batch.scratch) must be computed
        # inside the graph, so that every replay derives it again from the static buffers. It is not
        # kept: its temporaries (the decode workspace) go back to the pool for the next captures,
        # which never replay at the same time
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            hidden = self._forward(size, self._batch(size))
        return _Captured(graph, hidden)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """Hidden states [n, hidden] of a decode step of n sequences, from the graph of its padded size."""
        n = len(input_ids)
        size = next(s for s in self.sizes if s >= n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(batch.slot_mapping)
        width = batch.block_tables.shape[1]
        self.block_tables[:n, :width].copy_(batch.block_tables)
        self.block_tables[:n, width:].zero_()
        self.context_lens[:n].copy_(batch.context_lens)
        # padding rows: no write, no context
        self.slot_mapping[n:size].fill_(-1)
        self.context_lens[n:size].zero_()
        captured = self.graphs[size]
        self.replays[size] += 1
        if captured.graph is None:
            return self._forward(size, self._batch(size))[:n]
        captured.graph.replay()
        return captured.hidden[:n]
