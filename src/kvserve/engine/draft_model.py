"""The draft_model proposer: a small model that shares the target's tokenizer guesses each sequence's next tokens.

It runs beside the target model, on the same device and threads, with a KV cache of its own (a pool of as many
blocks as the target's, each of the draft's smaller pages, and one table per sequence of every layer): each
sequence it drafts for has a mirror there (a Sequence of the same tokens), whose computed tokens stay as long as
the target's tokens agree with them. A round catches each mirror up with the target's tokens (the whole prompt at
first, then the one or two tokens the last verification added) in one step, whose argmax is the first draft; then
k - 1 greedy decode steps give the others, by the C step's several steps in one call where it runs (as
native_multi_step does), else one at a time. Its drafts are its argmax: a one-hot proposal, which the rejection
sampler verifies exactly (sampling.RejectionSampler).
"""
from __future__ import annotations

import torch

from kvserve.attention import get_backend
from kvserve.config import EngineConfig, ModelConfig
from kvserve.engine.executor import Eager, NativeStep, native_decode_wanted
from kvserve.engine.native_decode import NativeDecode
from kvserve.engine.runner import ModelRunner
from kvserve.engine.scheduler import SchedulerOutput
from kvserve.engine.sequence import Sequence
from kvserve.engine.speculative import Proposer, SpeculativeConfig
from kvserve.kv import KVCacheManager, KVSpec, KVStorage, LayerGroup
from kvserve.kv.blocks import cdiv
from kvserve.kv.quant import resolve_kv_cache_dtype
from kvserve.model.gemm_choice import choose_gemm
from kvserve.model.loader import load_model, resolve_model
from kvserve.sampling import SamplingParams, argmax


class DraftModelProposer(Proposer):
    """Drafts by the model of spec.model (vLLM's draft_model): its greedy tokens after each sequence's own."""

    def __init__(self, spec: SpeculativeConfig, config: EngineConfig, target: ModelConfig, dtype: torch.dtype,
                 device: torch.device, max_model_len: int, num_blocks: int, max_num_seqs: int):
        path = resolve_model(spec.model)
        mcfg = ModelConfig.from_path(path)
        if mcfg.vocab_size != target.vocab_size:
            raise ValueError(f"speculative_config: the draft model's vocab_size ({mcfg.vocab_size}) is not the "
                             f"target's ({target.vocab_size}): a draft model must share the target's tokenizer")
        # positions it computes: a sequence past them proposes nothing
        self.max_model_len = min(max_model_len, mcfg.max_position_embeddings)
        backend = get_backend(config.attention_backend, device)
        native = native_decode_wanted(config, device, dtype, backend)
        gemm = choose_gemm(mcfg, dtype, device, native, spec.quantization)
        self.model = load_model(path, mcfg, dtype, device, self.max_model_len, gemm.weight_format, spec.quantization)
        gemm.apply(self.model)
        groups = [LayerGroup(None, tuple(range(mcfg.num_layers)))]      # windows, if any, applied by attention
        kv_spec = KVSpec.from_model(mcfg, dtype, config.block_size, resolve_kv_cache_dtype("auto", dtype))
        # the target's blocks, and room for each sequence's drafts beyond them
        blocks = num_blocks + max_num_seqs * (cdiv(spec.num_speculative_tokens, config.block_size) + 1)
        self.kv = KVCacheManager(blocks, config.block_size, groups)
        storage = KVStorage(kv_spec, blocks, device, groups)
        executors = [Eager(self.model, backend, storage)]
        if native and NativeDecode.reads(self.model):
            executors.insert(0, NativeStep(NativeDecode(self.model, storage)))
        self.runner = ModelRunner(self.model, storage, self.kv, backend, device, executors)
        self.mirrors: dict[int, Sequence] = {}
        self.params = SamplingParams(temperature=0)
        self.k = spec.num_speculative_tokens

    def retain(self, running: list[Sequence]) -> None:
        """The mirrors of sequences no longer running leave the draft's cache."""
        ids = {s.seq_id for s in running}
        for seq_id in [i for i in self.mirrors if i not in ids]:
            self.kv.free(seq_id)
            del self.mirrors[seq_id]

    def draft(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        """Each sequence's draft model's greedy tokens after its own, max(limits) of them cut to its limit; none for a
        sequence past the draft's positions or whose blocks the draft's pool lacks."""
        k = max(limits)
        batch = [(seq, m) for seq in seqs if (m := self._reserve(seq, k)) is not None]
        drafts: dict[int, list[int]] = {}
        if batch:
            tokens = self._run([m for _, m in batch], k)
            drafts = {seq.seq_id: row for (seq, _), row in zip(batch, tokens)}
        return [drafts.get(seq.seq_id, [])[:limit] for seq, limit in zip(seqs, limits)]

    def _reserve(self, seq: Sequence, k: int) -> Sequence | None:
        """The sequence's mirror, caught up with its tokens, and blocks for what a round of k drafts writes (its
        uncomputed tokens and k - 1 drafts); None where they do not fit."""
        if seq.num_tokens + k - 1 > self.max_model_len:
            return None
        mirror = self._mirror(seq)
        n = seq.num_tokens - mirror.num_computed_tokens + k - 1
        if self.kv.num_new_blocks(mirror.seq_id, mirror.num_computed_tokens, n) > self.kv.num_free_blocks:
            return None
        self.kv.allocate(mirror.seq_id, mirror.num_computed_tokens, n)
        return mirror

    def _mirror(self, seq: Sequence) -> Sequence:
        """The sequence's mirror with its tokens: the computed ones that still agree with them stay (the last round's
        drafts the target accepted), but its last token (computed again: its logits give the first draft), the blocks
        past them go."""
        mirror = self.mirrors.get(seq.seq_id)
        if mirror is None:
            mirror = self.mirrors[seq.seq_id] = Sequence(seq.seq_id, seq.request_id, None, list(seq.token_ids),
                                                         self.params, 0, 0.0)
            return mirror
        computed = zip(mirror.token_ids[:mirror.num_computed_tokens], seq.token_ids)
        agree = next((i for i, (a, b) in enumerate(computed) if a != b), mirror.num_computed_tokens)
        mirror.num_computed_tokens = min(agree, seq.num_tokens - 1)
        mirror.token_ids = list(seq.token_ids)
        self.kv.truncate(mirror.seq_id, self.kv.blocks_for(mirror.num_computed_tokens))
        return mirror

    @torch.inference_mode()
    def _run(self, mirrors: list[Sequence], k: int) -> list[list[int]]:
        """k greedy tokens after each mirror's: one step that computes its uncomputed tokens, then k - 1 decodes."""
        sched = SchedulerOutput()
        for m in sorted(mirrors, key=lambda m: not self._catches_up(m)):        # decodes first
            n = m.num_tokens - m.num_computed_tokens
            if self._catches_up(m) and n > 1:
                # the tokens after its first as rows of one query each, as a verification's drafts (engine/runner.py)
                m.token_ids, m.spec_token_ids = m.token_ids[:1 - n], m.token_ids[1 - n:]
            sched.add(m, n, len(m.spec_token_ids))
        sched.num_decodes = sum(self._catches_up(m) for m in sched.seqs)
        out = self.runner.run(sched)
        last, end = [], 0          # each mirror's last row: a catch-up's among its rows of verify_logits
        for i, num_spec in enumerate(out.num_drafts):
            end += num_spec + 1 if num_spec else 0
            last.append(out.verify_logits[end - 1] if num_spec else out.logits[i])
        for m, n, token in zip(sched.seqs, sched.num_new_tokens, argmax(torch.stack(last)).tolist()):
            m.token_ids += m.spec_token_ids + [token]
            m.spec_token_ids = []
            m.num_computed_tokens += n
        if k > 1:
            self._decode(sched.seqs, k - 1)
        return [m.token_ids[-k:] for m in mirrors]

    def _catches_up(self, mirror: Sequence) -> bool:
        """A mirror behind by a verification's tokens (its computed ones and at most a round's drafts and one more),
        not a prompt."""
        return 0 < mirror.num_computed_tokens and mirror.num_tokens - mirror.num_computed_tokens <= self.k + 1

    def _decode(self, mirrors: list[Sequence], steps: int) -> None:
        """`steps` greedy decode steps of the mirrors, each appending its token: by one call of the C step where it
        runs, else a step at a time."""
        sched = SchedulerOutput()
        for m in mirrors:
            sched.add(m, 1)
        sched.num_decodes = len(mirrors)
        native = self.runner.native
        if native is not None and (native.max_batch is None or len(mirrors) <= native.max_batch):
            inputs = self.runner.prepare(sched)
            self.model.ensure_rope(int(inputs.positions.max()) + steps)
            tokens = native.run_steps(inputs.input_ids, inputs.positions, inputs.batch, steps).T.tolist()
            for m, row in zip(mirrors, tokens):
                m.num_computed_tokens += steps
                m.token_ids += row
            return
        for _ in range(steps):
            tokens = argmax(self.runner.run(sched).logits).tolist()
            for m, token in zip(mirrors, tokens):
                m.num_computed_tokens += 1
                m.token_ids.append(token)
