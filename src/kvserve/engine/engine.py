"""LLMEngine: requests in, one scheduled step at a time, RequestOutputs out."""
from __future__ import annotations

import json
import logging
import os
import time
import weakref
from collections.abc import Callable
from itertools import count

import torch

from kvserve.attention import get_backend
from kvserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvserve.engine.cpu_memory import reuse_freed_memory
from kvserve.engine.detokenizer import Detokenizer
from kvserve.engine.evictor import Evictor
from kvserve.engine.executor import build_executors, native_decode_wanted
from kvserve.engine.gpu_memory import dummy_forward, profile_kv_memory
from kvserve.engine.runner import ModelRunner
from kvserve.engine.scheduler import Scheduler, SchedulerOutput
from kvserve.engine.sequence import Sequence
from kvserve.kernels import library
from kvserve.kv import KVCacheManager, KVSpec, KVStorage, LayerGroup, NoKVCache, NoKVStorage
from kvserve.kv.storage import block_spec
from kvserve.kv.eviction import EvictionPolicy, parse_eviction
from kvserve.kv.groups import is_hybrid, layer_groups
from kvserve.kv.tiers import (DEFAULT_KV_OFFLOAD_SIZE, KVConnector, NoConnector, OffloadingConnector, SwapCosts,
                              TierCompat, TierConfig, measure_prefill, model_identity, parse_kv_offload)
from kvserve.kv.quant import resolve_kv_cache_dtype
from kvserve.model.gemm_choice import GemmChoice, choose_gemm
from kvserve.model.loader import choose_dtype, load_model, load_tokenizer, resolve_model
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.parallel.connector import ForwardedConnector
from kvserve.parallel.sharding import check_tensor_parallel, shard_config
from kvserve.parallel.worker import WorkerArgs
from kvserve.parallel.workers import ForwardedStorage, Workers
from kvserve.sampling import Logprob, Sampler, SamplingParams, token_logprobs

log = logging.getLogger(__name__)
DEFAULT_KV_CACHE_MEMORY = 2 * 2**30


def _rank_threads(size: int) -> int:
    """The torch threads of one of `size` CPU ranks (rank 0's share of this process's cores)."""
    return min(torch.get_num_threads(), max(1, (os.cpu_count() or 1) // size))


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.model_path = resolve_model(config.model)
        self.model_config = mcfg = ModelConfig.from_path(self.model_path)
        self.device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if self.device.type == "cpu":
            if config.cpu_allocator_tuning:
                reuse_freed_memory()
            library()       # the C kernels: built (or found cached) as the engine starts, not in its first step
        self.dtype = choose_dtype(config.dtype, mcfg, self.device)
        config.kv_cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype)   # bfloat16 etc.: auto
        self.max_model_len = self._max_model_len(config, mcfg)
        # skip_tokenizer_init: token ids in and out, no text (vLLM's)
        self.tokenizer = None if config.skip_tokenizer_init else load_tokenizer(self.model_path)
        self.detokenize = Detokenizer(self.tokenizer)
        self.eos_token_ids = self._eos_ids()
        self.backend = get_backend(config.attention_backend, self.device)
        self.eviction = parse_eviction(config.eviction)
        if self.eviction is not None:
            self._check_eviction(self.eviction)
        self.layer_groups = self._layer_groups(config, mcfg)
        native = native_decode_wanted(config, self.device, self.dtype, self.backend)
        self.gemm = self._choose_gemm(config, mcfg, native)
        self._threads: int | None = None                # torch's threads before rank 0 took its share
        self.workers = self._start_workers(config, mcfg, native)
        try:
            self._load(config, mcfg, native)
        except BaseException:
            self.shutdown()       # no worker outlives an engine that could not start
            raise
        executors = build_executors(config, self.model, self.storage, self.kv_spec, self.backend, self.device,
                                    self.scheduler, self._final_only, self.max_model_len, len(self.layer_groups),
                                    self.workers)
        sliding = self._sliding_layers()
        # h2o and snapkv score tokens by the attention of the layers that see the whole context
        mass_layers = frozenset(range(mcfg.num_layers)) - sliding.keys() if sliding else None
        self.runner = ModelRunner(self.model, self.storage, self.kv, self.backend, self.device, executors, mass_layers)
        self.sampler = Sampler(torch.Generator(self.device).manual_seed(config.seed))
        # under tensor parallelism the evictor's changes to the pool are made on every rank
        self.evictor = Evictor(self.kv, self.storage if self.workers is None else ForwardedStorage(self.storage,
                               self.workers), self.model, whole_blocks=bool(sliding))
        self.requests: dict[str, list[Sequence]] = {}   # request id -> its n samples
        # called with (seqs, logits, spans) of each step's scored prompt tokens: for evaluations that
        # need whole distributions (KL divergence), not just the logprobs a request returns
        self.prompt_logits_hook: Callable[[list[Sequence], torch.Tensor, list], None] | None = None
        self._seq_ids = count()

    def _start_workers(self, config: EngineConfig, mcfg: ModelConfig, native: bool) -> Workers | None:
        """Under tensor parallelism, the other ranks, started (they load their shards while this process loads
        its own, and build the C decode step where `native`); else None."""
        size = config.tensor_parallel_size
        if size == 1:
            return None
        if self.device.type == "cuda" and config.num_kv_blocks is None and config.kv_cache_memory is None:
            raise ValueError(f"tensor_parallel_size {size} on CUDA needs kv_cache_memory (per rank) or "
                             f"num_kv_blocks: the KV pool is not sized by profiling one rank's step")
        if self.device.type == "cpu":     # this process is rank 0: its share of the cores, until shutdown
            self._threads = torch.get_num_threads()
            torch.set_num_threads(_rank_threads(size))
        log.info("tensor parallel: %d ranks (%s); decoding %s", size, "NCCL" if self.device.type == "cuda" else "gloo",
                 "by the C step on every rank (native_tp)" if native else "op by op (eager_tp)")
        args = WorkerArgs(self.model_path, mcfg, self.dtype, self.device.type, self.max_model_len,
                          config.attention_backend, config.cpu_allocator_tuning, self.gemm.weight_format,
                          self.gemm.amx_from, native, config.quantization)
        return Workers(size, args, self.device, config.step_timeout)

    def _choose_gemm(self, config: EngineConfig, mcfg: ModelConfig, native: bool) -> GemmChoice:
        """How the linear layers multiply (model/gemm_choice.py). Under tensor parallelism with the native step or
        quantized weights (csrc/gemm.c's alone), chosen as for one rank, on a rank's shapes and share of the cores;
        else unmeasured: oneDNN's packing on the CPU (torch's GEMMs on CUDA) on every rank. A model that does not
        split across the ranks is refused first (check_tensor_parallel)."""
        size = config.tensor_parallel_size
        if size > 1:
            check_tensor_parallel(mcfg, size, config.quantization)
        if size > 1 and (native or config.quantization is not None):
            threads = torch.get_num_threads()
            torch.set_num_threads(_rank_threads(size))        # as each rank will multiply
            try:
                return choose_gemm(shard_config(mcfg, size), self.dtype, self.device, native, config.quantization)
            finally:
                torch.set_num_threads(threads)
        if size > 1:
            cpu = self.device.type == "cpu"
            return GemmChoice("onednn" if cpu else "plain", f"tensor parallel, {size} ranks: "
                              f"{'oneDNN' if cpu else 'torch'}'s GEMMs on every rank, not measured")
        return choose_gemm(mcfg, self.dtype, self.device, native, config.quantization)   # measured, or cached

    def _load(self, config: EngineConfig, mcfg: ModelConfig, native: bool) -> None:
        """The model (this rank's shard), the scheduler and the KV cache; the workers build theirs."""
        self.model = load_model(self.model_path, mcfg, self.dtype, self.device, self.max_model_len,
                                self.gemm.weight_format, config.quantization, tp=self.workers and self.workers.tp)
        self.gemm.apply(self.model)
        batched = config.max_num_batched_tokens or max(8192, self.max_model_len)
        if config.cache_mode == "none":
            batched = max(batched, self.max_model_len)   # no cache: a sequence is computed whole
        self.scheduler_config = SchedulerConfig(config.max_num_seqs, batched, self.max_model_len,
                                                config.long_prefill_token_threshold)
        self.cache_config, self.kv, self.storage = self._init_cache(config)
        self.connector = self._init_connector(config)
        self.scheduler = Scheduler(self.scheduler_config, self.kv, self.cache_config.watermark,
                                   config.enable_prefix_caching and config.cache_mode == "paged", self.connector)
        self._final_only: set[str] = set()              # requests reported only when finished
        if self.workers is not None:
            self.workers.init_cache(self.model_kv_spec, self.cache_config.num_kv_blocks, self.layer_groups)

    def shutdown(self) -> None:
        """Stop the engine's worker processes (tensor parallel); none is left running. The engine cannot step
        after it."""
        if self.workers is not None:
            self.workers.close()
            if self._threads is not None:
                torch.set_num_threads(self._threads)
                self._threads = None

    @staticmethod
    def _max_model_len(config: EngineConfig, mcfg: ModelConfig) -> int:
        limit = mcfg.max_position_embeddings     # sliding-window layers included: they attend within their window
        if config.max_model_len is None:
            return limit
        if config.max_model_len > limit and not config.allow_long_max_model_len:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's limit of "
                             f"{limit} positions")
        return config.max_model_len

    def _layer_groups(self, config: EngineConfig, mcfg: ModelConfig) -> list[LayerGroup]:
        """The layer groups of the cache (kv/groups.py): a group per window kind where some layer's window binds
        within max_model_len and the cache is paged (the hybrid cache); else one group of every layer, whose
        windows the attention applies."""
        groups = layer_groups(mcfg.sliding_windows or (None,) * mcfg.num_layers, self.max_model_len)
        if config.cache_mode != "paged" or config.disable_hybrid_kv_cache_manager or not is_hybrid(groups):
            return [LayerGroup(None, tuple(range(mcfg.num_layers)))]
        return groups

    def _sliding_layers(self) -> dict[int, int]:
        """Each layer whose sliding window binds, and its window (one of max_model_len or more never binds: no
        cache holds more)."""
        windows = self.model_config.sliding_windows or ()
        return {i: w for i, w in enumerate(windows) if w is not None and w < self.max_model_len}

    def _check_eviction(self, policy: EvictionPolicy) -> None:
        """Refuse (ValueError naming the policy and the option) a policy that would cut a sliding-window layer's
        window: such a layer attends to the last W cached tokens, which must be the last W positions. Every policy
        keeps its most recent tokens (sink its `window`, h2o its `recent`, snapkv its `window`); with at least W of
        them, the full-attention layers see what the policy keeps and each sliding layer exactly its window, as
        without a policy. h2o and snapkv then score tokens by the full-attention layers' attention alone and evict
        whole blocks' worth (engine/evictor.py). With the hybrid cache, a policy evicts (sink pins, h2o and snapkv
        compact) in the full-attention layer groups; each sliding group keeps its window's blocks as they are."""
        sliding = self._sliding_layers()
        if not sliding:
            return
        widest, option = max(sliding.values()), policy.recent_option
        recent = getattr(policy, option)
        if recent < widest:
            raise ValueError(f"eviction {policy.spec()!r} with sliding-window layers (window {widest}): "
                             f"{policy.name}'s {option} ({recent}) must be at least {widest} tokens, to keep each "
                             f"such layer's window whole")

    def _init_cache(self, config: EngineConfig):
        # contiguous: the same pool, with one block holding a whole max_model_len context
        block_size = self.max_model_len if config.cache_mode == "contiguous" else config.block_size
        # each rank's pool holds its KV heads: kv_cache_memory and the blocks are per rank
        self.model_kv_spec = KVSpec.from_model(self.model.shard_config, self.dtype, block_size, config.kv_cache_dtype,
                                               config.kv_cache_dtype_skip_layers)   # every layer's: what workers build
        groups = self.layer_groups
        self.kv_spec = spec = block_spec(self.model_kv_spec, groups)       # a block holds one group's pages
        if config.cache_mode == "none":
            return CacheConfig(cache_mode="none"), NoKVCache(self.model_config.num_layers), NoKVStorage(spec.num_layers)
        cache = CacheConfig(block_size, config.num_kv_blocks, config.kv_cache_memory, config.cache_mode)
        reserved = int(is_hybrid(groups))      # the null block of the sliding groups' tables
        num_blocks = cache.num_kv_blocks
        if num_blocks is None:
            memory = cache.kv_cache_memory
            if memory is None:
                memory = self._gpu_kv_memory(config) if self.device.type == "cuda" else DEFAULT_KV_CACHE_MEMORY
            num_blocks = spec.num_blocks_for(memory)
            if cache.kv_cache_memory is None:   # a default need not exceed what could ever be used
                per_seq = -(-self.max_model_len // block_size) * len(groups)     # a table in each layer group
                num_blocks = min(num_blocks, config.max_num_seqs * per_seq)
            if num_blocks < 1:
                raise ValueError(f"kv_cache_memory of {memory} bytes holds no block of {block_size} tokens "
                                 f"({spec.bytes_per_block} bytes)")
        else:
            num_blocks += reserved      # beside those asked for (a memory budget holds it)
        cache.num_kv_blocks = num_blocks
        kv = KVCacheManager(num_blocks, block_size, groups)
        storage = KVStorage(self.model_kv_spec, num_blocks, self.device, groups)
        if len(groups) > 1:
            log.info("KV cache: %d layer groups (%s) of %d layers' pages per block", len(groups),
                     ", ".join(f"window {g.sliding_window}" if g.sliding_window else "full" for g in groups),
                     spec.num_layers)
        size = config.tensor_parallel_size
        ranks = f" per rank, {size * storage.nbytes / 2**20:.1f} MiB over {size} ranks" if size > 1 else ""
        log.info("KV cache: %d blocks of %d tokens (%d tokens, %s, %.1f MiB%s); maximum concurrency at "
                 "max_model_len %d: %.2fx", num_blocks, block_size, num_blocks * block_size, config.kv_cache_dtype,
                 storage.nbytes / 2**20, ranks, self.max_model_len, num_blocks / -(-self.max_model_len // block_size))
        return cache, kv, storage

    def _init_connector(self, config: EngineConfig) -> KVConnector:
        """The second tier of kv_offload, fed by the pool's evictions (under tensor parallelism, a tier on each rank
        for its pages: parallel/connector.py); closed (the pool's cached blocks written to it, its writer stopped)
        by close(), when the engine is collected, or at exit."""
        spec = parse_kv_offload(config.kv_offload)
        self._close_connector = lambda: None
        if spec is None:
            return NoConnector()
        size = config.kv_offload_size or DEFAULT_KV_OFFLOAD_SIZE
        kv_spec = self.kv_spec
        if spec.kind == "cpu" and self.device.type != "cuda":
            raise ValueError(f"kv_offload 'cpu' keeps blocks in host memory, where this engine's KV pool already "
                             f"is (device {self.device.type}): use kv_offload='disk:PATH' for a second tier")
        compat = TierCompat(model_identity(self.model_path), str(self.dtype).removeprefix("torch."),
                            kv_spec.kv_cache_dtype, kv_spec.block_size, kv_spec.num_layers, kv_spec.num_kv_heads,
                            kv_spec.head_dim, tuple(sorted(config.kv_cache_dtype_skip_layers)),
                            tp_size=config.tensor_parallel_size,
                            layer_groups=tuple((g.sliding_window, g.layers) for g in self.layer_groups
                                               if len(self.layer_groups) > 1))
        tiers = TierConfig(spec, size, compat, kv_spec.bytes_per_block)
        offload = OffloadingConnector(tiers.build(), self.kv.pool, self.storage.read_blocks, self.storage.write_blocks,
                                      self.device)
        offload.preemption_mode = config.preemption_mode
        if config.preemption_mode is None:
            offload.swap_costs = self._measure_swap_costs(offload)
        connector = offload if self.workers is None else ForwardedConnector(offload, self.workers, tiers)
        self.kv.pool.on_evict = connector.save
        self._close_connector = weakref.finalize(self, connector.close)
        log.info("KV offload: %s, %.2f GiB%s", config.kv_offload, size / 2**30,
                 f" on each of {config.tensor_parallel_size} ranks" if self.workers is not None else "")
        return connector

    def _measure_swap_costs(self, offload: OffloadingConnector) -> SwapCosts:
        """What a preempted sequence costs to recompute (prefills of the model, without a cache) and to swap
        (blocks of the pool through the tier), timed now, before any request."""
        def prefill(num_tokens: int) -> None:
            dummy_forward(self.model, self.backend, self.device, num_tokens, self.max_model_len, 1)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)

        tokens = max(1, min(128, self.max_model_len // 2, self.scheduler_config.max_num_batched_tokens // 2))
        costs = SwapCosts(*measure_prefill(prefill, tokens), *offload.measure_transfer())
        bs = self.kv.block_size
        log.info("KV offload: recomputing a block of %d tokens takes %.3g ms or more, swapping it out and in %.3g ms",
                 bs, 1e3 * costs.prefill_s_per_token * bs, 1e3 * (costs.write_s_per_block + costs.read_s_per_block))
        return costs

    def close(self) -> None:
        """Release what outlives a step: with kv_offload, the tier's reader stops (a read under way finishes,
        the requests of those not started compute their blocks instead), the pool's cached blocks go to the
        tier (a disk tier keeps them for the next engine) and its writer stops; the tier takes no block
        after (it still serves what it holds, read at once)."""
        self._close_connector()

    def _gpu_kv_memory(self, config: EngineConfig) -> int:
        """On a GPU with no size given: the KV pool's bytes, from one step of the largest batch."""
        sched = self.scheduler_config
        memory = profile_kv_memory(self.model, self.backend, self.device, sched.max_num_batched_tokens,
                                   self.max_model_len, min(sched.max_num_seqs, sched.max_num_batched_tokens),
                                   config.gpu_memory_utilization)
        if memory <= 0:
            raise ValueError(f"gpu_memory_utilization {config.gpu_memory_utilization} leaves no memory for the "
                             f"KV cache after the weights, what else is on the GPU and the activations of a "
                             f"{sched.max_num_batched_tokens}-token step; raise it or lower max_num_batched_tokens")
        log.info("KV cache: %.2f GiB of the GPU (gpu_memory_utilization %s)", memory / 2**30,
                 config.gpu_memory_utilization)
        return memory

    def kv_bytes_in_use(self) -> int:
        """Bytes of the blocks that running sequences hold."""
        return self.kv.blocks_held([s.seq_id for s in self.scheduler.running]) * self.kv_spec.bytes_per_block

    def _eos_ids(self) -> set[int]:
        ids = set(self.model_config.eos_token_ids)
        gen = self.model_path / "generation_config.json"
        if gen.exists():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            ids |= set([eos] if isinstance(eos, int) else eos or [])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    # ---- requests -------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int] | dict,
                    params: SamplingParams | None = None, cache_salt: str | None = None,
                    final_only: bool = False) -> Sequence:
        """Validate and queue one request; a bad request raises ValueError and changes nothing.

        Its n samples start as one sequence, forked into n once the prompt is computed. `final_only`:
        step() reports it once, finished (vLLM's FINAL_ONLY output kind, for offline batches), not at
        every step it gains tokens.
        """
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self._tokenize(prompt)
        self._check_params(params)
        if isinstance(prompt, dict) and cache_salt is None:
            cache_salt = prompt.get("cache_salt")
        policy = self.eviction if params.eviction is None else parse_eviction(params.eviction)
        if policy is not None and self.kv.recomputes:
            raise ValueError("eviction needs a paged KV cache (cache_mode 'paged')")
        if policy is not None:
            self._check_eviction(policy)
        max_tokens = params.max_tokens or self.max_model_len - len(ids)
        self._check_fits(len(ids), max_tokens, params.n, policy)
        seq = Sequence(next(self._seq_ids), request_id, text, ids, params, max_tokens, time.monotonic(),
                       self._generator(params, 0), cache_salt=cache_salt, eviction=policy)
        self.requests[request_id] = [seq]
        if final_only:
            self._final_only.add(request_id)
        self.scheduler.add(seq)
        return seq

    def _generator(self, params: SamplingParams, index: int) -> torch.Generator | None:
        """Sample i of a seeded request draws from seed + i: the same as a separate run with that seed."""
        if params.seed is None:
            return None
        return torch.Generator(self.device).manual_seed(params.seed + index)

    def _check_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: logit_bias ids in the vocabulary, text options with a tokenizer."""
        vocab = self.model_config.vocab_size
        if params.logit_bias and (bad := sorted(t for t in params.logit_bias if t >= vocab)):
            raise ValueError(f"logit_bias token ids out of the vocabulary [0, {vocab}): {bad[:5]}")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer (this engine has skip_tokenizer_init): use stop_token_ids")

    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = list(prompt["prompt_token_ids"])
                text = prompt.get("prompt")
            elif "prompt" in prompt:
                text, ids = prompt["prompt"], None
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        elif isinstance(prompt, str):
            text, ids = prompt, None
        elif isinstance(prompt, (list, tuple)):
            text, ids = None, list(prompt)
        else:
            raise ValueError(f"a prompt is a string, a list of token ids or a dict, got {type(prompt).__name__}")
        if ids is None:
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer (this engine has skip_tokenizer_init): pass "
                                 "prompt_token_ids")
            ids = self.tokenizer.encode(text)
        if not ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {self.model_config.vocab_size}): {bad[:5]}")
        return text, ids

    def _check_fits(self, prompt_len: int, max_tokens: int, n: int, policy: EvictionPolicy | None = None) -> None:
        total = prompt_len + max_tokens
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        cfg, bs = self.scheduler_config, self.kv.block_size
        chunk = cfg.long_prefill_token_threshold or cfg.max_num_batched_tokens
        held, pinned = total, 0
        if policy is not None and policy.bounds_context:
            prompt_chunk = min(prompt_len, chunk)
            held, pinned = policy.max_tokens_held(total, prompt_chunk, bs), policy.pinned_blocks(bs)
            if held > self.max_model_len:
                raise ValueError(f"{policy.spec()} with prompt chunks of {prompt_chunk} tokens holds up to {held} "
                                 f"tokens, more than max_model_len ({self.max_model_len}); use a smaller window or "
                                 f"long_prefill_token_threshold")
        elif total > self.max_model_len:
            raise ValueError(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = {total} "
                             f"exceeds max_model_len ({self.max_model_len})")
        blocks, pool = self.kv.max_blocks_held(held, chunk, pinned), self.kv.num_usable_blocks
        if blocks > pool:
            hint = ("; a smaller long_prefill_token_threshold lowers what the sliding-window layer groups hold while "
                    "a prompt chunk is written" if self.kv.max_blocks_held(held, 1, pinned) < blocks else "")
            raise ValueError(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) needs "
                             f"{blocks} KV blocks of {bs} tokens; the whole pool has {pool}{hint}")
        if n > self.scheduler_config.max_num_seqs:
            raise ValueError(f"n ({n}) exceeds max_num_seqs ({self.scheduler_config.max_num_seqs})")

    def abort_request(self, request_id: str) -> None:
        """Stop a request now; its blocks return to the pool at once."""
        self._final_only.discard(request_id)
        for seq in self.requests.pop(request_id, []):
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- one step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once (or, where nobody sees the steps between, several greedy decode steps
        at once: engine/executor.py), sample; returns the requests that gained tokens."""
        sched = self.scheduler.schedule()
        if sched.empty:
            return []
        try:
            out = self.runner.run(sched)
        except BaseException:
            self.scheduler.forget_uncomputed(sched)   # no later request may share blocks never written
            raise
        self.scheduler.commit(sched)
        if out.tokens is not None:
            return self._append_steps(sched, out.tokens)
        self.evictor.after_step(sched.seqs, out.attention_mass)
        try:
            if out.prompt_spans:
                self._score_prompts(sched.seqs, out.prompt_logits, out.prompt_spans)
            seqs = [sched.seqs[r] for r in out.sample_rows]
            logits = self._fork_samples(seqs, out.logits)
            result = self.sampler(logits, [s.params for s in seqs], [s.generator for s in seqs])
        except BaseException:
            # The step's sequences advanced without their tokens: they cannot go on.
            for request_id in {s.request_id for s in sched.seqs}:
                self.abort_request(request_id)
            raise
        for seq, token, lp in zip(seqs, result.token_ids, result.logprobs):
            self._append(seq, token, lp)
        return self._reports(seqs)

    def _reports(self, seqs: list[Sequence]) -> list[RequestOutput]:
        """The outputs of the requests that gained tokens: final-only ones once finished."""
        touched = dict.fromkeys(s.request_id for s in seqs)
        return [self._output(rid) for rid in touched
                if rid not in self._final_only or self._finished(self.requests[rid])]

    def _append_steps(self, sched: SchedulerOutput, tokens: list[list[int]]) -> list[RequestOutput]:
        """The tokens [steps][sequences] of several greedy decode steps run at once: each sequence takes them as
        one step at a time would, up to the one that ends it (a stop token or string); the rest are dropped with
        its blocks."""
        for i, row in enumerate(tokens):
            for seq, token in zip(sched.seqs, row):
                if not seq.is_finished:
                    if i:
                        self.scheduler.advance(seq)
                    self._append(seq, token, None)
        return self._reports(sched.seqs)

    def _fork_samples(self, seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        """Fork requests with n > 1 whose prompt is now computed: the n samples share its blocks.

        The children join `seqs`, with a copy of their parent's logits row to draw their first token.
        """
        rows = []
        for i, seq in enumerate(list(seqs)):
            if seq.params.n > 1 and seq.num_output_tokens == 0 and len(self.requests[seq.request_id]) == 1:
                for child in self._fork(seq):
                    seqs.append(child)
                    rows.append(i)
        return torch.cat((logits, logits[rows])) if rows else logits

    def _fork(self, parent: Sequence) -> list[Sequence]:
        group = self.requests[parent.request_id]
        for index in range(1, parent.params.n):
            child = parent.fork(next(self._seq_ids), self._generator(parent.params, index))
            self.scheduler.fork(parent, child)
            group.append(child)
        return group[1:]

    def _score_prompts(self, seqs: list[Sequence], logits: torch.Tensor, spans) -> None:
        """Append the logprobs of prompt tokens computed this step (prompt_logprobs)."""
        if self.prompt_logits_hook is not None:
            self.prompt_logits_hook(seqs, logits, spans)
        targets, ks = [], []
        for row, first, num in spans:
            targets += seqs[row].token_ids[first:first + num]
            ks += [seqs[row].params.prompt_logprobs] * num
        entries = iter(token_logprobs(logits, targets, ks))
        for row, _, num in spans:
            seqs[row].prompt_logprobs += [self._logprob_dict(next(entries)) for _ in range(num)]

    def _logprob_dict(self, entry: dict[int, tuple[float, int]]) -> dict[int, Logprob]:
        """Logprobs by token id, with each token's text (None without a tokenizer)."""
        tok = self.tokenizer
        return {t: Logprob(lp, rank, None if tok is None else tok.decode([t])) for t, (lp, rank) in entry.items()}

    def _append(self, seq: Sequence, token: int, logprobs) -> None:
        seq.token_ids.append(token)
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
        if logprobs is not None:
            seq.logprobs.append(self._logprob_dict(logprobs))
        p = seq.params
        if not p.ignore_eos and token in self.eos_token_ids:
            return self._finish(seq, "stop", token)
        if token in p.stop_token_ids:
            return self._finish(seq, "stop", token)
        if not self._text_deferred(seq):
            delta = self.detokenize(seq)
            if p.stop and delta and self._stop_string(seq, len(delta)):
                return None
        bounded = seq.eviction is not None and seq.eviction.bounds_context
        if seq.num_output_tokens >= seq.max_tokens or (seq.num_tokens >= self.max_model_len and not bounded):
            self._finish(seq, "length")

    def _stop_string(self, seq: Sequence, delta_len: int) -> bool:
        """Cut the text at the first stop string that the new text completes."""
        longest = max(len(s) for s in seq.params.stop)
        start = max(0, len(seq.output_text) - delta_len - longest + 1)
        hits = [(i, s) for s in seq.params.stop if (i := seq.output_text.find(s, start)) >= 0]
        if not hits:
            return False
        i, s = min(hits)
        seq.output_text = seq.output_text[:i]
        self._finish(seq, "stop", s)
        return True

    def _finish(self, seq: Sequence, reason: str, stop_reason=None) -> None:
        seq.stop_reason = stop_reason
        self.scheduler.finish(seq, reason)

    def _text_deferred(self, seq: Sequence) -> bool:
        """A request reported only when finished, with no stop strings to look for, needs its text only then
        (_output), where a DecodeStream catches it up at once."""
        return self.detokenize.deferrable and not seq.params.stop and seq.request_id in self._final_only

    @staticmethod
    def _finished(group: list[Sequence]) -> bool:
        return all(s.is_finished for s in group) and group[0].params.n == len(group)

    def _output(self, request_id: str) -> RequestOutput:
        """The request's state; a finished request is forgotten once reported."""
        group = self.requests[request_id]
        seq = group[0]
        for s in group:
            # text deferred: every token but one that stopped the sequence
            end = len(s.token_ids) - isinstance(s.stop_reason, int)
            if self._text_deferred(s) and s.read_offset < end:
                self.detokenize(s, end)
        completions = [CompletionOutput(i, s.output_text, s.output_token_ids, s.finish_reason, s.logprobs,
                                        s.stop_reason) for i, s in enumerate(group)]
        finished = self._finished(group)
        if finished:
            del self.requests[request_id]
            self._final_only.discard(request_id)
        metrics = {"arrival_time": seq.arrival_time}
        if seq.first_token_time is not None:
            metrics["first_token_time"] = seq.first_token_time
        return RequestOutput(request_id, seq.prompt, seq.prompt_token_ids, completions, finished,
                             seq.num_cached_tokens, metrics, seq.prompt_logprobs)

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
            "tensor_parallel_size": self.config.tensor_parallel_size,
            "kv_offload": self.config.kv_offload,
            **self.connector.stats(),
            "gemm": self.gemm.report(),           # how the linear layers multiply (model/gemm_choice.py)
        }
