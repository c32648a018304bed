"""Building an engine from its EngineConfig: the model (this rank's shard), tensor-parallel workers, the KV cache
and its pages, the second tier, the scheduler, the executors and the runner (vLLM v1 builds its EngineCore so)."""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from kvserve.attention import AttentionBackend, get_backend
from kvserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, resolve_device
from kvserve.engine.cpu_memory import reuse_freed_memory
from kvserve.engine.evictor import Evictor
from kvserve.engine.executor import build_executors, native_decode_wanted
from kvserve.engine.gpu_memory import dummy_forward, profile_kv_memory
from kvserve.engine.runner import ModelRunner
from kvserve.engine.scheduler import Scheduler
from kvserve.engine.speculative import NgramProposer, NoSpeculation, SpeculativeConfig, SpeculativeDecoding
from kvserve.kernels import library
from kvserve.kv import KVCache, KVCacheManager, KVSpec, KVStorage, LayerGroup, NoKVCache, NoKVStorage
from kvserve.kv.events import KVEventPublisher, create_publisher
from kvserve.kv.eviction import EvictionPolicy, parse_eviction
from kvserve.kv.groups import is_hybrid, layer_groups
from kvserve.kv.quant import resolve_kv_cache_dtype
from kvserve.kv.sparse import SparseAttention, parse_sparse_attention
from kvserve.kv.storage import block_spec
from kvserve.kv.tiers import (DEFAULT_KV_OFFLOAD_SIZE, KVConnector, NoConnector, OffloadingConnector, SwapCosts,
                              TierCompat, TierConfig, measure_prefill, model_identity, parse_kv_offload)
from kvserve.model.decoder import CausalLM
from kvserve.model.gemm_choice import GemmChoice, choose_gemm
from kvserve.model.loader import choose_dtype, load_model, load_tokenizer, resolve_model
from kvserve.parallel.connector import ForwardedConnector
from kvserve.parallel.sharding import check_tensor_parallel, shard_config
from kvserve.parallel.worker import WorkerArgs
from kvserve.parallel.workers import ForwardedStorage, Workers
from kvserve.sampling import Sampler

log = logging.getLogger(__name__)
DEFAULT_KV_CACHE_MEMORY = 2 * 2**30


@dataclass
class EngineParts:
    """What an engine is made of: its attributes (LLMEngine.kv, .scheduler, .runner, ...)."""

    config: EngineConfig
    model_path: Path
    model_config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    tokenizer: Any                      # None with skip_tokenizer_init
    eos_token_ids: set[int]
    backend: AttentionBackend
    eviction: EvictionPolicy | None     # the default policy of requests that ask for none of their own
    sparse: SparseAttention | None      # the default sparse attention of requests (the cache keeps summaries)
    sliding_layers: dict[int, int]      # each layer whose window binds, and its window
    layer_groups: list[LayerGroup]
    gemm: GemmChoice
    workers: Workers | None             # the other ranks, under tensor parallelism
    rank_threads: int | None            # torch's threads before rank 0 took its share of the cores
    model: CausalLM
    scheduler_config: SchedulerConfig
    cache_config: CacheConfig
    model_kv_spec: KVSpec               # every layer's pages: what the workers build theirs from
    kv_spec: KVSpec                     # a block's: one layer group's pages
    kv: KVCache
    storage: KVStorage | NoKVStorage
    kv_events: KVEventPublisher         # the KV cache events of kv_events_endpoint (a publisher of none without)
    connector: KVConnector
    scheduler: Scheduler
    final_only: set[str]                # requests reported only once finished (the executors read it too)
    runner: ModelRunner
    sampler: Sampler
    evictor: Evictor
    speculator: SpeculativeDecoding | NoSpeculation    # drafts proposed and verified (speculative_config)


def _rank_threads(size: int) -> int:
    """The torch threads of one of `size` CPU ranks (rank 0's share of this process's cores)."""
    return min(torch.get_num_threads(), max(1, (os.cpu_count() or 1) // size))


class EngineBuilder:
    """Builds an engine's parts (build) step by step, each from those before it. No worker outlives a build that
    fails."""

    def __init__(self, config: EngineConfig):
        self.config = config

    def build(self) -> EngineParts:
        config = self.config
        self._model_setup(config)
        native = native_decode_wanted(config, self.device, self.dtype, self.backend)
        self.gemm = self._choose_gemm(config, native)
        self.rank_threads = None
        self.workers = self._start_workers(config, native)
        try:
            self._load(config)
        except BaseException:
            if self.workers is not None:
                self.workers.close()
            raise
        executors = build_executors(config, self.model, self.storage, self.kv_spec, self.backend, self.device,
                                    self.scheduler, self.final_only, self.max_model_len, len(self.layer_groups),
                                    self.workers)
        # h2o and snapkv score tokens by the attention of the layers that see the whole context
        sliding = self.sliding_layers
        mass_layers = frozenset(range(self.model_config.num_layers)) - sliding.keys() if sliding else None
        self.runner = ModelRunner(self.model, self.storage, self.kv, self.backend, self.device, executors, mass_layers)
        self.sampler = Sampler(torch.Generator(self.device).manual_seed(config.seed), self.eos_token_ids)
        # under tensor parallelism the evictor's changes to the pool are made on every rank
        storage = self.storage if self.workers is None else ForwardedStorage(self.storage, self.workers)
        self.evictor = Evictor(self.kv, storage, self.model, whole_blocks=bool(sliding))
        self.speculator = self._speculator(config, storage)
        return EngineParts(**{f.name: getattr(self, f.name) for f in fields(EngineParts)})

    def _speculator(self, config: EngineConfig, storage) -> SpeculativeDecoding | NoSpeculation:
        """Speculative decoding by the proposer of speculative_config (NoSpeculation without one)."""
        spec = SpeculativeConfig.parse(config.speculative_config)
        if spec is None:
            return NoSpeculation()
        if spec.method == "ngram":
            proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
        else:
            from kvserve.engine.draft_model import DraftModelProposer
            proposer = DraftModelProposer(spec, config, self.model_config, self.dtype, self.device, self.max_model_len,
                                          self.cache_config.num_kv_blocks, self.scheduler_config.max_num_seqs)
        log.info("speculative decoding: %s, %d tokens a step (none past %d running sequences)",
                 spec.method if spec.model is None else f"draft model {spec.model}", spec.num_speculative_tokens,
                 spec.disable_by_batch_size)
        return SpeculativeDecoding(spec, proposer, self.sampler, self.scheduler, storage, self.max_model_len,
                                   self.kv.block_size)

    # ---- the model and what it decides ------------------------------------------------------

    def _model_setup(self, config: EngineConfig) -> None:
        """The checkpoint, device, dtype, context length, tokenizer, attention backend, default eviction policy and
        sparse attention, and layer groups: what the rest is built for."""
        self.model_path = resolve_model(config.model)
        self.model_config = mcfg = ModelConfig.from_path(self.model_path)
        self.device = resolve_device(config.device)
        if self.device.type == "cpu":
            if config.cpu_allocator_tuning:
                reuse_freed_memory()
            library()       # the C kernels: built (or found cached) as the engine starts, not in its first step
        self.dtype = choose_dtype(config.dtype, mcfg, self.device)
        config.kv_cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype)   # bfloat16 etc.: auto
        self.max_model_len = self._max_model_len(config, mcfg)
        # skip_tokenizer_init: token ids in and out, no text (vLLM's)
        self.tokenizer = None if config.skip_tokenizer_init else load_tokenizer(self.model_path)
        self.eos_token_ids = self._eos_ids()
        self.backend = get_backend(config.attention_backend, self.device)
        windows = mcfg.sliding_windows or ()
        # a window of max_model_len or more never binds: no cache holds more
        self.sliding_layers = {i: w for i, w in enumerate(windows) if w is not None and w < self.max_model_len}
        self.eviction = parse_eviction(config.eviction)
        if self.eviction is not None and self.sliding_layers:
            self.eviction.check_covers(max(self.sliding_layers.values()))
        self.sparse = parse_sparse_attention(config.sparse_attention)
        if self.sparse is not None and not self.backend.supports_sparse:
            raise ValueError(f"sparse_attention: the {self.backend.name} attention backend reads every block; use "
                             f"native (CPU) or triton (CUDA)")
        self.layer_groups = self._layer_groups(config, mcfg)

    @staticmethod
    def _max_model_len(config: EngineConfig, mcfg: ModelConfig) -> int:
        limit = mcfg.max_position_embeddings     # sliding-window layers included: they attend within their window
        if config.max_model_len is None:
            return limit
        if config.max_model_len > limit and not config.allow_long_max_model_len:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's limit of "
                             f"{limit} positions")
        return config.max_model_len

    def _eos_ids(self) -> set[int]:
        ids = set(self.model_config.eos_token_ids)
        gen = self.model_path / "generation_config.json"
        if gen.exists():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            ids |= set([eos] if isinstance(eos, int) else eos or [])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def _layer_groups(self, config: EngineConfig, mcfg: ModelConfig) -> list[LayerGroup]:
        """The layer groups of the cache (kv/groups.py): a group per window kind where some layer's window binds
        within max_model_len and the cache is paged (the hybrid cache); else one group of every layer, whose
        windows the attention applies."""
        groups = layer_groups(mcfg.sliding_windows or (None,) * mcfg.num_layers, self.max_model_len)
        if config.cache_mode != "paged" or config.disable_hybrid_kv_cache_manager or not is_hybrid(groups):
            return [LayerGroup(None, tuple(range(mcfg.num_layers)))]
        return groups

    # ---- the ranks and the weights ----------------------------------------------------------

    def _choose_gemm(self, config: EngineConfig, native: bool) -> GemmChoice:
        """How the linear layers multiply (model/gemm_choice.py). Under tensor parallelism with the native step or
        quantized weights (csrc/gemm.c's alone), chosen as for one rank, on a rank's shapes and share of the cores;
        else unmeasured: oneDNN's packing on the CPU (torch's GEMMs on CUDA) on every rank. A model that does not
        split across the ranks is refused first (check_tensor_parallel)."""
        size, mcfg = config.tensor_parallel_size, self.model_config
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

    def _start_workers(self, config: EngineConfig, native: bool) -> Workers | None:
        """Under tensor parallelism, the other ranks, started (they load their shards while this process loads
        its own, and build the C decode step where `native`); else None."""
        size = config.tensor_parallel_size
        if size == 1:
            return None
        if self.device.type == "cuda" and config.num_kv_blocks is None and config.kv_cache_memory is None:
            raise ValueError(f"tensor_parallel_size {size} on CUDA needs kv_cache_memory (per rank) or "
                             f"num_kv_blocks: the KV pool is not sized by profiling one rank's step")
        if self.device.type == "cpu":     # this process is rank 0: its share of the cores, until shutdown
            self.rank_threads = torch.get_num_threads()
            torch.set_num_threads(_rank_threads(size))
        log.info("tensor parallel: %d ranks (%s); decoding %s", size, "NCCL" if self.device.type == "cuda" else "gloo",
                 "by the C step on every rank (native_tp)" if native else "op by op (eager_tp)")
        args = WorkerArgs(self.model_path, self.model_config, self.dtype, self.device.type, self.max_model_len,
                          config.attention_backend, config.cpu_allocator_tuning, self.gemm.weight_format,
                          self.gemm.amx_from, native, config.quantization, widen_from=self.gemm.widen_from,
                          vnni_from=self.gemm.vnni_from)
        return Workers(size, args, self.device, config.step_timeout)

    def _load(self, config: EngineConfig) -> None:
        """The model (this rank's shard), the scheduler and the KV cache; the workers build theirs."""
        self.model = load_model(self.model_path, self.model_config, self.dtype, self.device, self.max_model_len,
                                self.gemm.weight_format, config.quantization, tp=self.workers and self.workers.tp)
        self.gemm.apply(self.model)
        batched = config.max_num_batched_tokens or max(8192, self.max_model_len)
        if config.cache_mode == "none":
            batched = max(batched, self.max_model_len)   # no cache: a sequence is computed whole
        self.scheduler_config = SchedulerConfig(config.max_num_seqs, batched, self.max_model_len,
                                                config.long_prefill_token_threshold)
        self.cache_config, self.kv, self.storage = self._init_cache(config)
        self.kv_events = create_publisher(config.kv_events_config())
        self.kv.record_events(self.kv_events.sink("GPU" if self.device.type == "cuda" else "CPU", self.kv.block_size))
        self.connector = self._init_connector(config)
        self.scheduler = Scheduler(self.scheduler_config, self.kv, self.cache_config.watermark,
                                   config.enable_prefix_caching and config.cache_mode == "paged", self.connector)
        self.final_only = set()
        if self.workers is not None:
            self.workers.init_cache(self.model_kv_spec, self.cache_config.num_kv_blocks, self.layer_groups)

    # ---- the KV cache -----------------------------------------------------------------------

    def _init_cache(self, config: EngineConfig) -> tuple[CacheConfig, KVCache, KVStorage | NoKVStorage]:
        # contiguous: the same pool, with one block holding a whole max_model_len context
        block_size = self.max_model_len if config.cache_mode == "contiguous" else config.block_size
        # each rank's pool holds its KV heads: kv_cache_memory and the blocks are per rank
        self.model_kv_spec = KVSpec.from_model(self.model.shard_config, self.dtype, block_size, config.kv_cache_dtype,
                                               config.kv_cache_dtype_skip_layers, summaries=self.sparse is not None)
        groups = self.layer_groups
        self.kv_spec = spec = block_spec(self.model_kv_spec, groups)       # a block holds one group's pages
        if config.cache_mode == "none":
            return CacheConfig(cache_mode="none"), NoKVCache(self.model_config.num_layers), NoKVStorage(spec.num_layers)
        cache = CacheConfig(block_size, config.num_kv_blocks, config.kv_cache_memory, config.cache_mode)
        cache.num_kv_blocks = num_blocks = self._num_blocks(config, cache, spec)
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

    def _num_blocks(self, config: EngineConfig, cache: CacheConfig, spec: KVSpec) -> int:
        """The pool's blocks: num_kv_blocks (and the null block of sliding groups' tables beside them: a memory
        budget holds it), or as many as kv_cache_memory holds (default: on the CPU DEFAULT_KV_CACHE_MEMORY, at
        most what max_num_seqs sequences of max_model_len take; on a GPU what a step's profile leaves)."""
        if cache.num_kv_blocks is not None:
            return cache.num_kv_blocks + int(is_hybrid(self.layer_groups))
        memory = cache.kv_cache_memory
        if memory is None:
            memory = self._gpu_kv_memory(config) if self.device.type == "cuda" else DEFAULT_KV_CACHE_MEMORY
        num_blocks = spec.num_blocks_for(memory)
        if cache.kv_cache_memory is None:   # a default need not exceed what could ever be used
            per_seq = -(-self.max_model_len // cache.block_size) * len(self.layer_groups)   # a table in each group
            num_blocks = min(num_blocks, config.max_num_seqs * per_seq)
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory of {memory} bytes holds no block of {cache.block_size} tokens "
                             f"({spec.bytes_per_block} bytes)")
        return num_blocks

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

    # ---- the second tier --------------------------------------------------------------------

    def _init_connector(self, config: EngineConfig) -> KVConnector:
        """The second tier of kv_offload, fed by the pool's evictions, its blocks announced to the KV events'
        subscribers (NoConnector without one); under tensor parallelism a tier on each rank for its pages
        (parallel/connector.py). Without preemption_mode, a preemption swaps or recomputes as a prefill and a
        transfer timed now say costs less; under tensor parallelism, whose prefill no rank times alone, it
        recomputes (vLLM's default)."""
        spec = parse_kv_offload(config.kv_offload)
        if spec is None:
            return NoConnector()
        size = config.kv_offload_size or DEFAULT_KV_OFFLOAD_SIZE
        kv_spec, groups = self.kv_spec, self.layer_groups
        compat = TierCompat(model_identity(self.model_path), str(self.dtype).removeprefix("torch."),
                            kv_spec.kv_cache_dtype, kv_spec.block_size, kv_spec.num_layers, kv_spec.num_kv_heads,
                            kv_spec.head_dim, tuple(sorted(config.kv_cache_dtype_skip_layers)),
                            layer_groups=tuple((g.sliding_window, g.layers) for g in groups if len(groups) > 1),
                            tp_size=config.tensor_parallel_size)
        tiers = TierConfig(spec, size, compat, kv_spec.page_bytes_per_block)   # summaries are made again from pages
        tiers.check(self.device)
        tier = tiers.build(events=self.kv_events.sink(tiers.medium, kv_spec.block_size))
        offload = OffloadingConnector(tier, self.kv.pool, self.storage.read_blocks, self.storage.write_blocks,
                                      self.device)
        offload.preemption_mode = config.preemption_mode
        if config.preemption_mode is None and self.workers is not None:
            offload.preemption_mode = "recompute"
        elif config.preemption_mode is None:
            offload.swap_costs = self._measure_swap_costs(offload)
        connector = offload if self.workers is None else ForwardedConnector(offload, self.workers, tiers)
        self.kv.pool.on_evict = connector.save
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

