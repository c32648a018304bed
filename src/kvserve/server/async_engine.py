"""AsyncEngine: one background thread steps the LLMEngine; each request reads its own output queue."""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
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


@dataclass
class _Admission:
    """A request waiting for the next step boundary to enter the engine."""

    request_id: str
    prompt: object
    params: SamplingParams
    cache_salt: str | None
    stream: _Stream
    admitted: asyncio.Future


class AsyncEngine:
    """Thread-safe front of an LLMEngine for an asyncio server.

    The engine is only touched by the stepping thread (and under `_lock`): requests that arrive
    during a step queue up and all enter at the next step boundary, as do aborts, so a burst of new
    requests joins the batch at once instead of waiting for the lock one by one. A request whose
    consumer goes away (a client disconnect cancels its generator) is aborted and its blocks return
    to the pool at once.
    """

    def __init__(self, engine: LLMEngine, max_queue: int | None = None, metrics=None):
        self.engine = engine
        self.max_queue = max_queue
        self.metrics = metrics                # ServerMetrics: observe(output, arrival), forget(request_id)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._admissions: deque[_Admission] = deque()
        self._aborts: list[str] = []
        self._running = False
        self._thread: threading.Thread | None = None

    @property
    def num_in_flight(self) -> int:
        return len(self._streams) + len(self._admissions)

    def start(self) -> None:
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="kvserve-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        """Abort every request in flight and stop the stepping thread."""
        with self._lock:
            while self._admissions:
                a = self._admissions.popleft()
                a.stream.loop.call_soon_threadsafe(_settle, a.admitted, RuntimeError("the server is shutting down"))
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
        if self.max_queue is not None and self.num_in_flight >= self.max_queue:
            raise QueueFullError(f"the server has {self.num_in_flight} requests in flight, its limit (--max-queue)")
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue())
        admission = _Admission(request_id, prompt, params, cache_salt, stream, loop.create_future())
        self._admissions.append(admission)
        self._wake.set()
        try:
            await admission.admitted
        except asyncio.CancelledError:
            self.abort(request_id)       # after its admission, if it was admitted
            raise
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

    def _admit(self) -> None:
        """Add the queued requests to the engine; each caller learns whether its request is valid."""
        while self._admissions:
            a = self._admissions.popleft()
            try:
                self.engine.add_request(a.request_id, a.prompt, a.params, a.cache_salt)
            except Exception as e:  # noqa: BLE001  (ValueError: an invalid request, the caller's 400)
                a.stream.loop.call_soon_threadsafe(_settle, a.admitted, e)
                continue
            self._streams[a.request_id] = a.stream
            a.stream.loop.call_soon_threadsafe(_settle, a.admitted, None)

    def _abort_now(self, request_id: str) -> None:
        self.engine.abort_request(request_id)
        self._streams.pop(request_id, None)
        if self.metrics is not None:
            self.metrics.forget(request_id)

    def _loop(self) -> None:
        while self._running:
            with self._lock:
                self._admit()
                while self._aborts:
                    self._abort_now(self._aborts.pop())
                busy = self.engine.has_unfinished_requests()
                outputs = self._step() if busy else []
            if not busy:
                self._wake.wait(timeout=1.0)
                self._wake.clear()
            by_loop: dict[asyncio.AbstractEventLoop, list] = {}
            for out, stream in outputs:
                by_loop.setdefault(stream.loop, []).append((stream.queue, out))
            for loop, deliveries in by_loop.items():     # one wake-up of each loop per step, not one per output
                loop.call_soon_threadsafe(_deliver, deliveries)

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


def _deliver(deliveries: list[tuple[asyncio.Queue, object]]) -> None:
    for queue, item in deliveries:
        queue.put_nowait(item)


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():              # the caller gave up (cancelled) meanwhile
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
