"""Prometheus metrics under vLLM's names, with a `kvserve:` prefix."""
from __future__ import annotations

import threading
import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from collections.abc import Callable

from kvserve.outputs import RequestOutput

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)


class EngineCollector:
    """Reads the engine's gauges and counters (LLMEngine.stats) at scrape time; none while no engine
    runs (stats() is None), rather than a dead engine's last values."""

    def __init__(self, stats: Callable[[], dict | None], model_name: str):
        self.stats = stats
        self.labels = {"model_name": model_name}

    def collect(self):
        stats = self.stats()
        if stats is None:
            return
        total = stats["kv_blocks_total"]
        in_use = total - stats["kv_blocks_free"]
        yield self._gauge("kv_cache_usage_perc", "Fraction of KV blocks held by requests (0-1).",
                          in_use / total if total else 0.0)
        yield self._gauge("num_requests_running", "Requests in the running batch.", stats["num_running"])
        yield self._gauge("num_requests_waiting", "Requests waiting to be admitted.", stats["num_waiting"])
        for name, key, doc in (("num_preemptions", "num_preemptions", "Preemptions (recompute)."),
                               ("prefix_cache_queries", "prefix_cache_queries", "Prompt tokens looked up."),
                               ("prefix_cache_hits", "prefix_cache_hits", "Prompt tokens found cached."),
                               ("sparse_blocks_read", "sparse_blocks_read", "KV blocks that decode steps under sparse "
                                "attention read, per layer and KV head."),
                               ("sparse_blocks_context", "sparse_blocks_total", "KV blocks of those decode steps' "
                                "contexts, per layer and KV head (what dense attention reads).")):
            family = CounterMetricFamily(f"kvserve:{name}", doc, labels=list(self.labels))
            family.add_metric(list(self.labels.values()), stats[key])
            yield family
        steps = CounterMetricFamily("kvserve:steps", "Engine steps by the executor that ran them (a multi-step "
                                    "call counts its decode steps).", labels=[*self.labels, "executor"])
        for executor, count in stats["steps"].items():
            steps.add_metric([*self.labels.values(), executor], count)
        yield steps
        if "kv_offload_blocks" in stats:
            yield from self._offload(stats)
        if "kv_events_published" in stats:
            yield from self._events(stats)

    def _events(self, stats: dict):
        """The KV events publisher's counters (an engine with kv_events_endpoint)."""
        yield self._gauge("kv_events_queued", "KV events waiting for the publisher thread.", stats["kv_events_queued"])
        for name, doc in (("published", "KV events sent on the events socket."),
                          ("batches", "KV event batches (messages) sent."),
                          ("dropped", "KV events dropped: the publisher's queue was full.")):
            family = CounterMetricFamily(f"kvserve:kv_events_{name}", doc, labels=list(self.labels))
            family.add_metric(list(self.labels.values()), stats[f"kv_events_{name}"])
            yield family

    def _offload(self, stats: dict):
        """The second KV tier's gauges and counters (an engine with kv_offload)."""
        for name, doc in (("blocks", "KV blocks held by the offload tier."),
                          ("bytes", "Bytes held by the offload tier."),
                          ("capacity_bytes", "The offload tier's size (kv_offload_size)."),
                          ("loads_in_flight", "KV blocks being read from the offload tier for waiting requests.")):
            yield self._gauge(f"kv_offload_{name}", doc, stats[f"kv_offload_{name}"])
        for name, doc in (("blocks_stored", "KV blocks written to the offload tier."),
                          ("bytes_written", "Bytes written to the offload tier."),
                          ("bytes_read", "Bytes read from the offload tier."),
                          ("hit_tokens", "Prompt tokens found in the offload tier past the pool's prefix hits."),
                          ("miss_tokens", "Tokens of full prompt blocks found in neither the pool nor the tier."),
                          ("loads", "KV blocks loaded from the offload tier into the pool."),
                          ("skipped", "Evicted KV blocks not stored: the tier's writer queue was full."),
                          ("evictions", "KV blocks the offload tier dropped to make room."),
                          ("errors", "Offload tier reads and writes that failed (corrupt files included)."),
                          ("swap_outs", "Preemptions that wrote the sequence's full KV blocks to the offload tier."),
                          ("swap_out_blocks", "KV blocks written to the offload tier by preemptions."),
                          ("swap_ins", "Resumptions of sequences swapped out to the offload tier."),
                          ("swap_in_blocks", "KV blocks those resumptions loaded from the offload tier."),
                          ("recomputes", "Preemptions left to recompute the sequence (with an offload tier).")):
            family = CounterMetricFamily(f"kvserve:kv_offload_{name}", doc, labels=list(self.labels))
            family.add_metric(list(self.labels.values()), stats[f"kv_offload_{name}"])
            yield family

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(f"kvserve:{name}", doc, labels=list(self.labels))
        family.add_metric(list(self.labels.values()), value)
        return family


class ServerMetrics:
    """Per-request counters and latency histograms, fed with every output the engine streams."""

    def __init__(self, stats: Callable[[], dict | None], model_name: str):
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(stats, model_name))
        labels = ["model_name"]
        self.model_name = model_name
        self.prompt_tokens = Counter("kvserve:prompt_tokens", "Prefilled prompt tokens.", labels,
                                     registry=self.registry)
        self.generation_tokens = Counter("kvserve:generation_tokens", "Generated tokens.", labels,
                                         registry=self.registry)
        self.request_success = Counter("kvserve:request_success", "Finished requests.",
                                       labels + ["finished_reason"], registry=self.registry)
        self.ttft = Histogram("kvserve:time_to_first_token_seconds", "Time to first token.", labels,
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("kvserve:inter_token_latency_seconds", "Time between output tokens.", labels,
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("kvserve:e2e_request_latency_seconds", "Arrival to last token.", labels,
                             buckets=_LATENCY_BUCKETS + (160.0, 320.0), registry=self.registry)
        self._last: dict[str, float] = {}                 # request id -> time of its last output
        self._lock = threading.Lock()                     # observe and forget come from two threads
        # this model's series, looked up once rather than for every output
        self._generation_tokens, self._prompt_tokens, self._ttft, self._itl, self._e2e = (
            m.labels(model_name) for m in (self.generation_tokens, self.prompt_tokens, self.ttft, self.itl, self.e2e))

    def observe(self, delta: RequestOutput, arrival: float) -> None:
        """Called for each step's delta of a request (output_deltas.py), in the thread that reads them."""
        with self._lock:
            self._observe(delta, arrival)

    def _observe(self, delta: RequestOutput, arrival: float) -> None:
        now = time.monotonic()
        new = sum(len(c.token_ids) for c in delta.outputs)
        last_time = self._last.get(delta.request_id)
        if new > 0:
            self._generation_tokens.inc(new)
            if last_time is None:
                self._ttft.observe(now - arrival)
                self._prompt_tokens.inc(len(delta.prompt_token_ids))
            else:
                self._itl.observe(now - last_time)
        self._last[delta.request_id] = now
        if delta.finished:
            del self._last[delta.request_id]
            self._e2e.observe(now - arrival)
            reason = delta.outputs[0].finish_reason or "abort"
            self.request_success.labels(self.model_name, reason).inc()

    def forget(self, request_id: str) -> None:
        """An aborted request (in the event loop's thread): it will not finish."""
        with self._lock:
            if self._last.pop(request_id, None) is not None:
                self.request_success.labels(self.model_name, "abort").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
