"""AsyncEngine: one background thread steps the LLMEngine; each request reads its own output queue."""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from kvserve.engine.engine import LLMEngine
from kvserve.outputs import RequestOutput
from kvserve.sampling import SamplingParams

log = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """More requests are in flight than the server accepts (--max-queue)."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival: float = field(default_factory=time.monotonic)


class AsyncEngine:
    """Thread-safe front of an LLMEngine for an asyncio server.

    The engine is only touched under `_lock`; the stepping thread releases it between steps, so
    requests are added and aborted at step boundaries. A request whose consumer goes away (a client
    disconnect cancels its generator) is aborted and its blocks return to the pool at once.
    """

    def __init__(self, engine: LLMEngine, max_queue: int | None = None, metrics=None):
        self.engine = engine
        self.max_queue = max_queue
        self.metrics = metrics                # ServerMetrics: observe(output, arrival), forget(request_id)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._aborts: list[str] = []
        self._running = False
        self._thread: threading.Thread | None = None

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def start(self) -> None:
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="kvserve-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        """Abort every request in flight and stop the stepping thread."""
        with self._lock:
            for request_id, stream in list(self._streams.items()):
                self._abort_now(request_id)
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, RuntimeError("the server is shutting down"))
        self._running = False
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    async def submit(self, request_id: str, prompt, params: SamplingParams,
                     cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Queue a request (ValueError if it is invalid) and return the stream of its outputs.

        The caller must iterate the stream to its end or abort the request.
        """
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        await asyncio.to_thread(self._add, request_id, prompt, params, cache_salt, stream)
        return self._outputs(request_id, stream)

    async def _outputs(self, request_id: str, stream: _Stream) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                # outputs are cumulative: a consumer that fell behind the engine takes the newest one
                # only, so a loaded server writes fewer, larger chunks instead of falling further behind
                while isinstance(item, RequestOutput) and not item.finished and not stream.queue.empty():
                    item = stream.queue.get_nowait()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort at the next step boundary (never blocks the caller)."""
        self._aborts.append(request_id)
        self._wake.set()

    def _add(self, request_id, prompt, params, cache_salt, stream: _Stream) -> None:
        with self._lock:
            if self.max_queue is not None and len(self._streams) >= self.max_queue:
                raise QueueFullError(f"the server has {len(self._streams)} requests in flight, "
                                     f"its limit (--max-queue)")
            self.engine.add_request(request_id, prompt, params, cache_salt)
            self._streams[request_id] = stream
        self._wake.set()

    def _abort_now(self, request_id: str) -> None:
        self.engine.abort_request(request_id)
        self._streams.pop(request_id, None)
        if self.metrics is not None:
            self.metrics.forget(request_id)

    def _loop(self) -> None:
        while self._running:
            with self._lock:
                while self._aborts:
                    self._abort_now(self._aborts.pop())
                busy = self.engine.has_unfinished_requests()
                outputs = self._step() if busy else []
            if not busy:
                self._wake.wait(timeout=1.0)
                self._wake.clear()
            for out, stream in outputs:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)

    def _step(self) -> list[tuple[RequestOutput | BaseException, _Stream]]:
        try:
            outputs = self.engine.step()
        except Exception as e:  # noqa: BLE001
            # fail the requests in flight, keep serving new ones
            log.exception("engine step failed; aborting the requests in flight")
            failed = [(e, s) for s in self._streams.values()]
            for request_id in list(self._streams):
                self._abort_now(request_id)
            return failed
        routed = []
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if self.metrics is not None:
                try:
                    self.metrics.observe(out, stream.arrival)
                except Exception:  # noqa: BLE001
                    log.exception("metrics failed; serving on")   # never let metrics stop the engine
            if out.finished:
                del self._streams[out.request_id]
            routed.append((out, stream))
        return routed
