"""ModelRunner: turns a scheduled step into flat tensors and runs it by the first executor that takes it."""
from __future__ import annotations

from collections import Counter
from dataclasses import replace

import numpy as np
import torch

from kvserve.attention import AttentionBatch
from kvserve.attention.sparse import SparseStats
from kvserve.engine.cuda_graphs import DecodeGraphs
from kvserve.engine.executor import CudaGraphs, Executor, NativeStep, Step, StepInputs, StepOutput
from kvserve.engine.native_decode import NativeDecode
from kvserve.engine.scheduler import SchedulerOutput
from kvserve.kv import KVCache, KVStorage, NoKVStorage
from kvserve.model.decoder import CausalLM


def index_tensor(values: list, device: torch.device) -> torch.Tensor:
    """int64 tensor of a (nested) list of ints: through numpy, which converts a list in C, where
    torch.tensor inspects every element in Python."""
    return torch.from_numpy(np.asarray(values, dtype=np.int64)).to(device)


class ModelRunner:
    """Turns a scheduled step into flat tensors and runs it on the first of `executors` that supports it
    (engine/executor.py); `steps` counts the steps each executor ran, by name. `kv` is the cache manager whose
    block tables place the step's tokens in `storage`. `mass_layers`: the layers whose attention mass scores the
    cached tokens for h2o and snapkv (AttentionBatch.mass_layers; None: every layer)."""

    def __init__(self, model: CausalLM, storage: KVStorage | NoKVStorage, kv: KVCache,
                 backend, device: torch.device, executors: list[Executor], mass_layers: frozenset[int] | None = None):
        self.model = model
        self.mass_layers = mass_layers
        # a model whose every layer attends within a sliding window has no mass to gather
        self.gathers_mass = mass_layers is None or bool(mass_layers)
        self.storage = storage
        self.kv = kv
        self.backend = backend
        self.device = device
        self.executors = executors
        self.steps: Counter[str] = Counter(dict.fromkeys((e.name for e in executors), 0))
        self.sparse = SparseStats(model.config.num_layers, device)     # sparse attention's reads

    @property
    def native(self) -> NativeDecode | None:
        """The C step of the native executors, if the engine has them."""
        return next((e.native for e in self.executors if isinstance(e, NativeStep)), None)

    @property
    def graphs(self) -> DecodeGraphs | None:
        """The captured CUDA graphs, if the engine has them."""
        return next((e.graphs for e in self.executors if isinstance(e, CudaGraphs)), None)

    def prepare(self, sched: SchedulerOutput) -> StepInputs:
        input_ids, starts, q_lens, ctx_lens, logits_indices, sample_rows = [], [], [], [], [], []
        prompt_indices, prompt_spans, evicted, mass_requests = [], [], [], []
        for i, (seq, n) in enumerate(zip(sched.seqs, sched.num_new_tokens)):
            start = seq.num_computed_tokens
            offset = len(input_ids)
            input_ids += seq.token_ids[start:start + n]
            starts.append(start)
            q_lens.append(n)
            # positions count every token (RoPE); the cache holds those not evicted
            evicted.append(seq.num_evicted_tokens)
            ctx_lens.append(seq.num_tokens_in_cache + n)
            if seq.eviction is not None and seq.eviction.needs_scores and self.gathers_mass:
                scored = self._scored_queries(seq, n)
                if scored:
                    mass_requests.append((i, offset + n - scored, scored, seq.eviction.mass_reduce))
            if start + n == seq.num_tokens:
                logits_indices.append(len(input_ids) - 1)
                sample_rows.append(i)
            if seq.prompt_logprobs is not None:
                # position p scores prompt token p + 1; skip tokens scored before a recomputation
                first = max(start, len(seq.prompt_logprobs) - 1)
                last = min(start + n, seq.num_prompt_tokens - 1)
                if last > first:
                    prompt_indices += range(offset + first - start, offset + last - start)
                    prompt_spans.append((i, first + 1, last - first))
        dev = self.device
        self.model.ensure_rope(max(s + n for s, n in zip(starts, q_lens)))
        # the cache holds the tokens not evicted: their places there
        cache_starts = [s - e for s, e in zip(starts, evicted)]
        group_tables = self._group_tables(sched)
        tables = group_tables[0] if group_tables else None
        positions, slot_mapping, block_tables = self._places(starts, cache_starts, q_lens, len(input_ids), tables)
        nd = sched.num_decodes
        batch = AttentionBatch(
            num_decodes=nd,
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            context_lens=index_tensor(ctx_lens, dev),
            query_lens=q_lens,
            context_lens_list=ctx_lens,
            # a quantized cache is read by every prefill, so that a sequence's result never depends on
            # which others share its step (the step's own K/V would be exact, the cache's are not)
            has_prefix=bool(self.storage.quantized) or any(c > q for c, q in zip(ctx_lens[nd:], q_lens[nd:])),
            mass_requests=mass_requests,
            mass_layers=self.mass_layers,
        )
        # the decodes' sparse attention; a prefill attends densely, the prompt's last token too where a prefix hit
        # leaves it alone (a decode to the scheduler): the first token is the dense model's, cached prefix or not
        batch.sparse = self.sparse.decode([s.seq_id for s in sched.seqs],
                                          [s.sparse if i < nd and s.num_computed_tokens >= s.num_prompt_tokens
                                           else None for i, s in enumerate(sched.seqs)],
                                          0 if block_tables is None else block_tables.shape[1])
        # each layer group's batch but the first's (this one): its slots and block tables
        batch.groups = [self._group_batch(batch, t, starts, cache_starts, q_lens, len(input_ids))
                        for t in group_tables[1:]]
        batch.layer_group = self.storage.layer_group
        return StepInputs(index_tensor(input_ids, dev), positions, batch, index_tensor(logits_indices, dev),
                          sample_rows, index_tensor(prompt_indices, dev), prompt_spans)

    def _group_tables(self, sched: SchedulerOutput) -> list[list[list[int]]]:
        """The step's block tables [layer group][sequence] (none where the engine keeps no cache)."""
        return [list(tables) for tables in zip(*(self.kv.group_tables(s.seq_id) for s in sched.seqs))]

    def _group_batch(self, batch: AttentionBatch, tables: list[list[int]], starts: list[int],
                     cache_starts: list[int], q_lens: list[int], num_tokens: int) -> AttentionBatch:
        """The batch of another layer group of a hybrid cache: its slots and block tables, and scratch of its own
        (what backends derive from the tables)."""
        _, slot_mapping, block_tables = self._places(starts, cache_starts, q_lens, num_tokens, tables)
        return replace(batch, slot_mapping=slot_mapping, block_tables=block_tables, scratch={})

    def _places(self, starts: list[int], cache_starts: list[int], q_lens: list[int], num_tokens: int,
                tables: list[list[int]] | None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Positions of the step's tokens, their cache slots and the padded block tables (no cache: None)."""
        dev = self.device
        block_tables = slot_mapping = None
        if tables is not None:
            width = max(len(t) for t in tables)
            block_tables = index_tensor([t + [0] * (width - len(t)) for t in tables], dev)
        if num_tokens == len(q_lens):
            # one token per sequence (decodes): cheaper in Python than a dozen small tensor ops
            positions = index_tensor(starts, dev)
            if tables is not None:
                bs = self.storage.block_size
                slot_mapping = index_tensor([t[c // bs] * bs + c % bs for t, c in zip(tables, cache_starts)], dev)
            return positions, slot_mapping, block_tables
        q_lens_t = index_tensor(q_lens, dev)
        rows = torch.repeat_interleave(torch.arange(len(q_lens), device=dev), q_lens_t)
        offsets = torch.arange(num_tokens, device=dev) - (torch.cumsum(q_lens_t, 0) - q_lens_t)[rows]
        positions = index_tensor(starts, dev)[rows] + offsets
        if tables is not None:
            bs = self.storage.block_size
            cache_positions = index_tensor(cache_starts, dev)[rows] + offsets
            slot_mapping = block_tables[rows, cache_positions // bs] * bs + cache_positions % bs
        return positions, slot_mapping, block_tables

    @staticmethod
    def _scored_queries(seq, n: int) -> int:
        """How many of the step's last queries the sequence's policy scores the cache with: all of
        them for h2o; for snapkv, the prompt's last `window` once, in the step that ends the prompt."""
        policy = seq.eviction
        if policy.name == "h2o":
            return n
        ends_prompt = seq.num_computed_tokens + n >= seq.num_prompt_tokens
        return min(n, policy.window) if ends_prompt and not seq.prompt_compacted else 0

    @torch.inference_mode()
    def run(self, sched: SchedulerOutput) -> StepOutput:
        """The step, run by the first executor that supports it (counted in `steps`): the logits of the tokens
        that sample and of the prompt tokens asked to be scored, or the tokens of several decode steps."""
        step = Step(sched, self._copy_and_prepare)
        executor = next(e for e in self.executors if e.supports(step))
        out = executor.run(step)
        self.steps[executor.name] += step.num_steps
        return out

    def _copy_and_prepare(self, sched: SchedulerOutput) -> StepInputs:
        """The step's inputs, its copy-on-write blocks copied first (those of every block it reserved)."""
        self.storage.copy_blocks(sched.block_copies)
        return self.prepare(sched)
