"""LLMEngine: requests in, one scheduled step at a time, RequestOutputs out.

The engine's parts are built by engine/builder.py; a request goes through the input processor (tokens, checks, its
grammar, a Sequence), the scheduler, the runner (a step by the first executor that takes it) and the sampler (with
the masks of the sequences' grammars, computed while the model runs), and its tokens through the output processor
(stops, text, forks of n samples, outputs)."""
from __future__ import annotations

import weakref
from functools import partial
from itertools import count

import torch

from kvserve.config import EngineConfig
from kvserve.engine.builder import EngineBuilder
from kvserve.engine.input_processor import InputProcessor
from kvserve.engine.output_processor import OutputProcessor
from kvserve.engine.sequence import Sequence
from kvserve.outputs import RequestOutput
from kvserve.sampling import SamplingParams
from kvserve.structured.manager import StructuredOutputManager


class LLMEngine:
    """Its attributes are its parts (EngineParts: config, model, kv, storage, scheduler, runner, connector, ...),
    `inputs` and `outputs` (the processors) and `requests` (each request's sequences, until reported finished)."""

    def __init__(self, config: EngineConfig):
        # the parts are the engine's attributes: engine.kv, engine.scheduler, engine.runner, ...
        vars(self).update(vars(EngineBuilder(config).build()))
        seq_ids = count()
        self.structured = StructuredOutputManager(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        self.inputs = InputProcessor(self.tokenizer, self.model_config, self.max_model_len, self.kv,
                                     self.scheduler_config, self.eviction, self.sliding_layers, self.device, seq_ids,
                                     self.structured, self.sparse, self.speculator)
        self.outputs = OutputProcessor(self.tokenizer, self.eos_token_ids, self.max_model_len, self.scheduler,
                                       self.final_only, self.device, seq_ids)
        self.requests = self.outputs.requests
        # when the engine closes, is collected, or at exit: with kv_offload the pool's cached blocks go to the tier,
        # then the KV events publisher sends the last events (the tier's too)
        self._close_connector = weakref.finalize(self, _close_in_turn, self.connector, self.kv_events)

    def add_request(self, request_id: str, prompt: str | list[int] | dict,
                    params: SamplingParams | None = None, cache_salt: str | None = None,
                    final_only: bool = False) -> Sequence:
        """Validate and queue one request; a bad request raises ValueError and changes nothing.

        Its n samples start as one sequence, forked into n once the prompt is computed. `final_only`:
        step() reports it once, finished (vLLM's FINAL_ONLY output kind, for offline batches), not at
        every step it gains tokens.
        """
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq = self.inputs.process(request_id, prompt, params or SamplingParams(), cache_salt)
        self.outputs.add(seq, final_only)
        self.scheduler.add(seq)
        return seq

    def abort_request(self, request_id: str) -> None:
        """Stop a request now; its blocks return to the pool at once."""
        for seq in self.outputs.pop(request_id):
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once (or, where nobody sees the steps between, several greedy decode steps
        at once: engine/executor.py), verify the drafts it computed, sample; propose the next drafts (speculative
        decoding: engine/speculative.py); returns the requests that gained tokens. The masks of the step's grammars
        are computed while the model runs."""
        sched = self.scheduler.schedule()
        if sched.empty:
            return []
        masks = self.structured.start_masks(sched.seqs)
        try:
            out = self.runner.run(sched)
        except BaseException:
            self.scheduler.forget_uncomputed(sched)   # no later request may share blocks never written
            raise
        self.scheduler.commit(sched)
        self.structured.wait(masks)     # (what follows reads and advances the grammars that the masks read)
        if out.tokens is not None:
            outputs = self.outputs.append_steps(sched, out.tokens)
            self.speculator.propose(sched.seqs, self.scheduler.running)
            return outputs
        try:
            # the drafts first: those rejected leave the cache before the evictor reads it
            verified, seqs, logits = self.speculator.verify([sched.seqs[r] for r in out.sample_rows], out,
                                                            partial(self.structured.draft_masks, masks))
            self.evictor.after_step(sched.seqs, out.attention_mass)
            if out.prompt_spans:
                self.outputs.score_prompts(sched.seqs, out.prompt_logits, out.prompt_spans)
            logits = self.outputs.fork_samples(seqs, logits)
            result = self.sampler(logits, [s.params for s in seqs], [s.generator for s in seqs],
                                  [(s.token_ids, s.num_prompt_tokens) for s in seqs],
                                  self.structured.masks(masks, seqs))
        except BaseException:
            # The step's sequences advanced without their tokens: they cannot go on.
            for request_id in {s.request_id for s in sched.seqs}:
                self.abort_request(request_id)
            raise
        for v in verified:
            self.outputs.append_tokens(v.seq, v.result.token_ids, v.result.logprobs)
        for seq, token, lp in zip(seqs, result.token_ids, result.logprobs):
            self.outputs.append(seq, token, lp)
        gained = [v.seq for v in verified] + seqs
        self.speculator.propose(gained, self.scheduler.running)
        return self.outputs.reports(gained)

    def kv_bytes_in_use(self) -> int:
        """Bytes of the blocks that running sequences hold."""
        return self.kv.blocks_held([s.seq_id for s in self.scheduler.running]) * self.kv_spec.bytes_per_block

    def stats(self) -> dict:
        return {
            "cache_mode": self.cache_config.cache_mode,
            **self.kv.stats(),
            "kv_cache_dtype": self.kv_spec.kv_cache_dtype,
            "kv_bytes_per_token": self.kv_spec.bytes_per_token,
            "kv_cache_bytes": self.storage.nbytes,
            "num_running": len(self.scheduler.running),
            # with those waiting for their blocks from the second tier (vLLM's WAITING_FOR_REMOTE_KVS)
            "num_waiting": len(self.scheduler.waiting) + len(self.scheduler.loading),
            "num_preemptions": self.scheduler.num_preemptions,
            "num_evicted_tokens": self.evictor.num_evicted_tokens,
            "prefix_cache_queries": self.scheduler.prefix_cache_queries,
            "prefix_cache_hits": self.scheduler.prefix_cache_hits,
            "max_model_len": self.max_model_len,
            "steps": dict(self.runner.steps),     # executor -> steps it ran (engine/executor.py)
            **self.runner.sparse.stats(),         # blocks sparse attention read, and of its contexts
            "tensor_parallel_size": self.config.tensor_parallel_size,
            "kv_offload": self.config.kv_offload,
            **self.connector.stats(),
            **self.kv_events.stats(),
            "gemm": self.gemm.report(),           # how the linear layers multiply (model/gemm_choice.py)
            **self.speculator.stats(),            # spec_decode_* (vLLM's), with a speculative_config
            **self.structured.stats(),
        }

    def close(self) -> None:
        """Release what outlives a step: with kv_offload, the tier's reader stops (a read under way finishes,
        the requests of those not started compute their blocks instead), the pool's cached blocks go to the
        tier (a disk tier keeps them for the next engine) and its writer stops; the tier takes no block
        after (it still serves what it holds, read at once); then the KV events publisher sends what it holds."""
        self._close_connector()

    def shutdown(self) -> None:
        """Stop the engine's worker processes (tensor parallel); none is left running. The engine cannot step
        after it."""
        if self.workers is not None:
            self.workers.close()
            if self.rank_threads is not None:
                torch.set_num_threads(self.rank_threads)
                self.rank_threads = None


def _close_in_turn(*parts) -> None:
    """Close each part in turn (the tier before the events publisher, so that its last events are sent)."""
    for part in parts:
        part.close()
