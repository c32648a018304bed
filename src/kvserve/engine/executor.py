"""How a step runs: the one place that decides, and that says which way each step went.

An engine builds its executors once from its configuration (build_executors, at the end of this file),
and its runner runs each step on the first of them that supports it, in this order:

  native_multi_step   several greedy decode steps in one C call, each step's argmax the next one's
                      input (vLLM's multi-step scheduling); CPU
  native              one decode step in one C call (csrc/decode_step.c), over full-precision or quantized
                      pages (int8, fp8, int4: written as kv/quant.py's codecs write them, bit for bit) and
                      over each layer group's block tables of a hybrid cache; a verification of speculative
                      drafts too (a multi-token decode: a row per token, engine/runner.py); CPU
  cuda_graphs         one decode step replayed from the CUDA graph of its padded batch size; CUDA
  eager               the model op by op, by its attention backend: any step
  native_tp           native on every rank of a tensor-parallel engine (tensor_parallel_size > 1) on the
                      CPU: rank 0 sends the step to the other ranks (parallel/workers.py), then each runs its
                      shard's C step, which stops for the all-reduces between the layers' halves
  eager_tp            eager on every rank of a tensor-parallel engine: any step

Under tensor parallelism the C step runs per layer with the all-reduces between (native_tp), chosen over
op by op by measurement (`kvserve bench tp`, docs/performance.md's tp section); not several steps in one
call (each step's argmax needs every rank's logits), and CUDA graphs are not captured over collectives:
on CUDA every step runs eager_tp.

Each executor's `supports` holds all its conditions on a step; the functions before build_executors,
those on the engine for it to be built at all. The runner counts the steps each executor ran
(LLMEngine.stats()["steps"], /metrics' kvserve:steps_total): a multi-step call counts its decode steps.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Container
from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol

import torch

from kvserve.attention import AttentionBatch
from kvserve.attention.native import NativeBackend
from kvserve.config import EngineConfig
from kvserve.engine.cuda_graphs import DecodeGraphs
from kvserve.engine.native_decode import DTYPES, NativeDecode
from kvserve.engine.scheduler import Scheduler, SchedulerOutput
from kvserve.kernels import fallback, function
from kvserve.kv import KVSpec, KVStorage, NoKVStorage
from kvserve.model.decoder import CausalLM

log = logging.getLogger(__name__)


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    batch: AttentionBatch
    # flat indices of each sequence that samples: its last token's, then (a verification) each of its drafts'
    logits_indices: torch.Tensor
    sample_rows: list[int]         # which scheduled sequences sample this step
    prompt_indices: torch.Tensor   # flat indices whose logits score the next prompt token
    prompt_spans: list[tuple[int, int, int]]   # (row, first prompt token scored, count) per sequence
    num_drafts: list[int] = field(default_factory=list)   # the drafts each sampling sequence verifies
    row_seqs: list[int] = field(default_factory=list)     # each row's sequence (a verification has several rows)


@dataclass
class StepOutput:
    """What a step computed. An executor gives the logits of every row of logits_indices in `logits`; the runner
    then leaves there one row per sampling sequence, and a verification's rows in `verify_logits` too."""

    logits: torch.Tensor           # [sampling sequences, vocab]
    sample_rows: list[int]
    prompt_logits: torch.Tensor    # [scored prompt tokens, vocab], in prompt_spans order
    prompt_spans: list[tuple[int, int, int]]
    attention_mass: dict[int, torch.Tensor]   # sequence -> [layers * KVH, context] mass, for eviction policies
    tokens: list[list[int]] | None = None     # [steps][sequences]: several decode steps' tokens, sampled already
    num_drafts: list[int] = field(default_factory=list)    # per sampling sequence: the drafts it verifies
    # each verifying sequence's rows in turn: the logits after its last verified token, then after each draft
    verify_logits: torch.Tensor | None = None


@dataclass
class Step:
    """A scheduled step as the executors see it: the scheduler's output, and its flat inputs, prepared when an
    executor first asks for them (after native_multi_step has reserved the blocks its steps write)."""

    sched: SchedulerOutput
    prepare: Callable[[SchedulerOutput], StepInputs]
    num_steps: int = 1             # decode steps it runs: more where native_multi_step takes it

    @cached_property
    def inputs(self) -> StepInputs:
        return self.prepare(self.sched)


class Executor(Protocol):
    name: str

    def supports(self, step: Step) -> bool:
        """Whether this executor runs the step."""

    def run(self, step: Step) -> StepOutput:
        """The step's logits (of the tokens that sample and of the prompt tokens scored), or its tokens."""


def decodes_for_logits(inputs: StepInputs) -> bool:
    """A step of decodes only that needs nothing of the forward but its logits: no prompt token computed or
    scored (prompt_logprobs), no attention mass for an eviction policy."""
    batch = inputs.batch
    return batch.num_prefills == 0 and not batch.mass_requests and not inputs.prompt_spans


def _takes(native: NativeDecode, num_seqs: int) -> bool:
    """Whether the C step takes a batch of num_seqs sequences: any number over weights packed for its GEMMs,
    else up to its matrix-vector products' max_batch."""
    return native.max_batch is None or num_seqs <= native.max_batch


def _logits(model: CausalLM, hidden: torch.Tensor, inputs: StepInputs) -> StepOutput:
    """The output of a forward's hidden states: the logits of the tokens that sample and of the prompt tokens
    scored, and the attention mass the layers gathered."""
    num_sample = len(inputs.logits_indices)
    logits = model.compute_logits(hidden[torch.cat((inputs.logits_indices, inputs.prompt_indices))])
    mass = {row: torch.cat(layers) for row, layers in inputs.batch.mass.items()}
    return StepOutput(logits[:num_sample], inputs.sample_rows, logits[num_sample:], inputs.prompt_spans, mass)


class NativeMultiStep:
    """Several greedy decode steps in one call of the C step, where nobody sees the steps between."""

    name = "native_multi_step"

    def __init__(self, native: NativeDecode, max_steps: int, scheduler: Scheduler, final_only: Container[str],
                 max_model_len: int):
        self.native, self.max_steps, self.scheduler = native, max_steps, scheduler
        self.final_only = final_only          # the engine's requests reported only once finished
        self.max_model_len = max_model_len

    def supports(self, step: Step) -> bool:
        """Decodes only, with no drafts to verify, as many as the C step takes, of final-only requests (nobody sees
        the steps between) that are greedy, with no logprobs, no eviction and logits they do not change (logit_bias,
        allowed_token_ids, bad_words, min_tokens: the C step takes the plain argmax), none at its prompt's last token
        (its first token is sampled, and its n samples forked, as any step's), while no request waits for a place or
        for its blocks from the second tier (it would wait the whole call); at least two steps before any sequence
        reaches its max_tokens or max_model_len.
        Then it reserves the blocks of all the steps (all or none: without them, the step is not taken)."""
        sched = step.sched
        if (sched.num_decodes < len(sched.seqs) or any(sched.num_spec_tokens) or self.scheduler.waiting
                or self.scheduler.loading or not _takes(self.native, len(sched.seqs))):
            return False
        steps = self.max_steps
        for seq in sched.seqs:
            p = seq.params
            # (a prompt computed a token a step is scheduled as a decode, and samples nothing yet); its last token
            # goes alone: its n samples fork from it, and under sparse attention, whose choice holds for the whole
            # call, it attends densely
            if (not p.greedy or p.logprobs is not None or seq.eviction is not None or p.changes_logits
                    or seq.request_id not in self.final_only or seq.num_computed_tokens + 1 < seq.num_tokens
                    or seq.num_computed_tokens < seq.num_prompt_tokens):
                return False
            steps = min(steps, seq.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens)
        if steps < 2 or not self.scheduler.reserve_ahead(sched, steps):
            return False
        step.num_steps = steps
        return True

    def run(self, step: Step) -> StepOutput:
        inputs = step.inputs
        self.native.model.ensure_rope(int(inputs.positions.max()) + step.num_steps)
        tokens = self.native.run_steps(inputs.input_ids, inputs.positions, inputs.batch, step.num_steps)
        nothing = torch.empty(0)
        return StepOutput(nothing, [], nothing, [], {}, tokens.tolist())


class NativeStep:
    """One decode step in one call of the C step."""

    name = "native"

    def __init__(self, native: NativeDecode):
        self.native = native

    def supports(self, step: Step) -> bool:
        """Decodes for their logits only (a verification's rows among them), as many rows as the C step takes."""
        inputs = step.inputs
        return decodes_for_logits(inputs) and _takes(self.native, len(inputs.batch.query_lens))

    def run(self, step: Step) -> StepOutput:
        inputs = step.inputs
        logits = self.native.run(inputs.input_ids, inputs.positions, inputs.batch)
        if len(inputs.logits_indices) < len(logits):     # the others compute a prompt a token at a time
            logits = logits[inputs.logits_indices]
        return StepOutput(logits, inputs.sample_rows, logits[:0], [], {})


class CudaGraphs:
    """One decode step replayed from the captured graph of its padded batch size."""

    name = "cuda_graphs"

    def __init__(self, graphs: DecodeGraphs, model: CausalLM):
        self.graphs, self.model = graphs, model        # graphs: captured (capture_all)

    def supports(self, step: Step) -> bool:
        """Decodes for their logits only, none under sparse attention (the graphs attend densely), within the largest
        captured batch and context, whose block tables fit the graphs' buffer, while the RoPE table is the one the
        graphs read (a `sink` sequence that outgrows it reallocates it)."""
        inputs, graphs = step.inputs, self.graphs
        batch = inputs.batch
        return (decodes_for_logits(inputs) and batch.sparse is None and len(batch.query_lens) <= graphs.sizes[-1]
                and max(batch.context_lens_list) <= graphs.max_context
                and batch.block_tables.shape[1] <= graphs.block_tables.shape[1]
                and self.model.rope.cos is graphs.rope_table)

    def run(self, step: Step) -> StepOutput:
        inputs = step.inputs
        return _logits(self.model, self.graphs.run(inputs.input_ids, inputs.positions, inputs.batch), inputs)


class Eager:
    """The model op by op: any step."""

    name = "eager"

    def __init__(self, model: CausalLM, backend, storage: KVStorage | NoKVStorage):
        self.model, self.backend, self.storage = model, backend, storage

    def supports(self, step: Step) -> bool:
        """Every step."""
        return True

    def run(self, step: Step) -> StepOutput:
        inputs = step.inputs
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.batch, self.backend, self.storage)
        return _logits(self.model, hidden, inputs)


class TensorParallelNative(NativeStep):
    """NativeStep on every rank: the step goes to the workers first, then each rank runs its shard's C step, whose
    team stops at each all-reduce between the layers' halves to meet the other ranks'; the logits are gathered
    to rank 0."""

    name = "native_tp"

    def __init__(self, native: NativeDecode, workers):
        super().__init__(native)
        self.workers = workers                     # parallel.workers.Workers

    def run(self, step: Step) -> StepOutput:
        return self.workers.run_step(step.sched.block_copies, step.inputs, True, lambda: NativeStep.run(self, step))


class TensorParallelEager(Eager):
    """Eager on every rank: the step goes to the workers first, then rank 0 runs its shard; the collectives of
    the forward meet the workers', and the logits are gathered to rank 0."""

    name = "eager_tp"

    def __init__(self, model: CausalLM, backend, storage: KVStorage | NoKVStorage, workers):
        super().__init__(model, backend, storage)
        self.workers = workers                     # parallel.workers.Workers

    def run(self, step: Step) -> StepOutput:
        return self.workers.run_step(step.sched.block_copies, step.inputs, False, lambda: self._run(step))

    def _run(self, step: Step) -> StepOutput:
        inputs = step.inputs
        out = Eager.run(self, step)
        if inputs.batch.mass_requests:      # every KV head's mass, for eviction to choose as one rank would
            reduces = {row: reduce for row, _, _, reduce in inputs.batch.mass_requests}
            out.attention_mass = self.model.tp.gather_mass(out.attention_mass, reduces, self.model.config)
        return out


def native_decode_wanted(config: EngineConfig, device: torch.device, dtype: torch.dtype, backend) -> bool:
    """The native executors: on the CPU unless enforce_eager (under tensor parallelism on every rank, with the
    all-reduces between the layers' halves: native_tp), for a float32 or bfloat16 model (any family
    ModelConfig reads, Gemma 2/3 and partial RoPE included, over a hybrid cache's layer groups too: the C step
    reads each layer's group's block table) whose attention the native backend runs over a paged or contiguous
    cache, and the kernels built. Its pages may be quantized (kv_cache_dtype int8, fp8, int4, and
    kv_cache_dtype_skip_layers' full-precision layers among them): the C step writes each step's K/V as the
    codecs of kv/quant.py write them, bit for bit (int4's keys turned by its Hadamard matrix, and the queries
    alike), and attends over the quantized pages as the native backend does. What falls back to op by op, and
    why: float16 (the kernels compute in float32 or bfloat16); another attention backend; cache_mode "none" (no
    pages to write). Of the steps of an engine that has them, NativeStep.supports and NativeMultiStep.supports
    say which run natively (decodes only, for their logits). (Asked before the model loads, whose weights are
    then held as the C step reads them where the GEMM choice allows: model/gemm_choice.py.)"""
    return (device.type == "cpu" and not config.enforce_eager and dtype in DTYPES
            and isinstance(backend, NativeBackend) and config.cache_mode != "none"
            and function("decode_step") is not None)


def cuda_graphs_wanted(config: EngineConfig, device: torch.device, spec: KVSpec, backend,
                       num_layer_groups: int = 0) -> bool:
    """cuda_graphs: on CUDA unless enforce_eager, a paged, full-precision cache with one block table for every
    layer (the graphs read one: a hybrid cache of several layer groups decodes eagerly) read by a backend that
    can be captured (and the capture succeeding: build_executors); not under tensor parallelism."""
    return (device.type == "cuda" and not config.enforce_eager and config.tensor_parallel_size == 1
            and config.cache_mode != "none" and not spec.quantized_layers and backend.supports_cuda_graphs
            and num_layer_groups <= 1)


def build_executors(config: EngineConfig, model: CausalLM, storage: KVStorage | NoKVStorage, spec: KVSpec, backend,
                    device: torch.device, scheduler: Scheduler, final_only: Container[str],
                    max_model_len: int, num_layer_groups: int = 0, workers=None) -> list[Executor]:
    """The engine's executors, in the order a step tries them; eager, last, takes what the others do not.
    num_layer_groups: the KV cache's layer groups (0: no cache). With `workers` (tensor parallel),
    native_tp where the C step runs, and eager_tp."""
    executors: list[Executor] = []
    native = None
    if native_decode_wanted(config, device, model.lm_head.weight.dtype, backend) \
            and NativeDecode.reads(model):
        native = NativeDecode(model, storage)
    if workers is not None:
        if native is not None:
            executors.append(TensorParallelNative(native, workers))
        return [*executors, TensorParallelEager(model, backend, storage, workers)]
    if native is not None:
        if config.num_scheduler_steps > 1:
            executors.append(NativeMultiStep(native, config.num_scheduler_steps, scheduler, final_only,
                                             max_model_len))
        executors.append(NativeStep(native))
    if cuda_graphs_wanted(config, device, spec, backend, num_layer_groups):
        graphs = DecodeGraphs(model, storage, backend, config.max_num_seqs, max_model_len, device)
        try:
            graphs.capture_all()
            executors.append(CudaGraphs(graphs, model))
        except Exception as e:  # noqa: BLE001  (a driver or kernel that cannot be captured: serve eagerly)
            fallback("CUDA graph capture", f"{type(e).__name__}: {e}")
            log.warning("CUDA graph capture failed (%s: %s); decoding eagerly", type(e).__name__, e)
    executors.append(Eager(model, backend, storage))
    return executors
