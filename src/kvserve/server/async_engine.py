"""AsyncEngine: the asyncio front of an EngineCore; each request reads its own output queue."""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvserve.config import EngineConfig, ModelConfig
from kvserve.engine.engine import LLMEngine
from kvserve.model.loader import load_tokenizer
from kvserve.outputs import RequestOutput
from kvserve.sampling import SamplingParams
from kvserve.server.engine_core import EngineCore, run_engine_process
from kvserve.server.output_deltas import apply_delta

log = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """More requests are in flight than the server accepts (--max-queue)."""


@dataclass
class EngineInfo:
    """What the HTTP side needs of an engine that runs in another process."""

    tokenizer: object
    model_config: ModelConfig
    max_model_len: int


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    admitted: asyncio.Future
    arrival: float = field(default_factory=time.monotonic)


class AsyncEngine:
    """Requests go to an EngineCore through a pipe; a reader thread hands each step's outputs to the
    requests' queues, one wake-up of the event loop per step.

    Given an EngineConfig, the core runs in a process of its own (what `kvserve serve` does): the
    engine steps without ever waiting for the HTTP side's hold on the GIL. Given an LLMEngine, it
    runs in a thread. Requests that arrive during a step all enter at the next step boundary, as do
    aborts. A request whose consumer goes away (a client disconnect cancels its generator) is
    aborted and its blocks return to the pool at once.
    """

    def __init__(self, engine: LLMEngine | EngineConfig, max_queue: int | None = None, metrics=None):
        self.max_queue = max_queue
        self.metrics = metrics                # ServerMetrics: observe(delta, arrival), forget(request_id)
        self._conn, core_conn = multiprocessing.Pipe()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()     # what the writer thread sends, in order
        self._streams: dict[str, _Stream] = {}
        self.dead: str | None = None          # why the engine can take no more requests
        self._core: threading.Thread | multiprocessing.Process
        if isinstance(engine, EngineConfig):
            self._core = multiprocessing.get_context("spawn").Process(
                target=run_engine_process, args=(engine, core_conn), name="kvserve-engine", daemon=True)
            self._core.start()
            core_conn.close()                 # so that a child that dies reads as the pipe's end
        else:
            self._core = threading.Thread(target=EngineCore(engine, core_conn).run, name="kvserve-engine",
                                          daemon=True)
            self._core.start()
        try:
            ready = self._conn.recv()
        except EOFError:
            self._core.join()
            raise ValueError(f"the engine process exited (code {self._core.exitcode}) before it was ready") from None
        if ready[0] == "error":
            self._core.join()
            raise ValueError(ready[1])
        _, model_path, max_model_len, self._stats = ready
        self.engine = engine if isinstance(engine, LLMEngine) else EngineInfo(
            load_tokenizer(Path(model_path)), ModelConfig.from_path(Path(model_path)), max_model_len)
        self._threads: list[threading.Thread] = []

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def stats(self) -> dict:
        """The engine's stats (LLMEngine.stats) as of its latest step or idle moment."""
        return self._stats

    def start(self) -> None:
        self._threads = [threading.Thread(target=self._read, name="kvserve-outputs", daemon=True),
                         threading.Thread(target=self._write, name="kvserve-requests", daemon=True)]
        for thread in self._threads:
            thread.start()

    def shutdown(self) -> None:
        """Abort every request in flight and stop the engine (blocks: call it off the event loop)."""
        error = RuntimeError("the server is shutting down")
        for request_id, stream in list(self._streams.items()):
            self._streams.pop(request_id, None)
            stream.loop.call_soon_threadsafe(_fail, stream, error)
        self._send(("shutdown",))
        self._outbox.put(None)
        self._core.join(timeout=10)
        for thread in self._threads:
            thread.join(timeout=10)

    async def submit(self, request_id: str, prompt, params: SamplingParams,
                     cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Queue a request (ValueError if it is invalid) and return the stream of its outputs.

        The caller must iterate the stream to its end or abort the request.
        """
        if self.max_queue is not None and self.num_in_flight >= self.max_queue:
            raise QueueFullError(f"the server has {self.num_in_flight} requests in flight, its limit (--max-queue)")
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue(), loop.create_future())
        self._streams[request_id] = stream
        if self.dead is not None:       # checked once registered: a dying engine fails the streams it knows
            self._streams.pop(request_id, None)
            raise RuntimeError(f"the engine has stopped: {self.dead}")
        self._send(("add", request_id, prompt, params, cache_salt))
        try:
            await stream.admitted
        except asyncio.CancelledError:
            self.abort(request_id)       # after its admission, if it was admitted
            raise
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        return self._outputs(request_id, stream)

    async def _outputs(self, request_id: str, stream: _Stream) -> AsyncIterator[RequestOutput]:
        """The request's cumulative output after each step's delta; a consumer that fell behind gets
        every delta that has arrived at once, so a loaded server writes fewer, larger chunks."""
        state, finished = None, False
        try:
            while not finished:
                item = await stream.queue.get()
                while True:
                    if isinstance(item, BaseException):
                        raise item
                    state = apply_delta(state, item)
                    if state.finished or stream.queue.empty():
                        break
                    item = stream.queue.get_nowait()
                finished = state.finished
                yield state
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort at the next step boundary (queued for the writer: never blocks the caller)."""
        if self._streams.pop(request_id, None) is not None and self.metrics is not None:
            self.metrics.forget(request_id)
        self._send(("abort", request_id))

    def _send(self, message: tuple) -> None:
        self._outbox.put(message)

    def _write(self) -> None:
        """The writer thread: the requests and aborts, in order (a send may wait while the engine steps)."""
        while (message := self._outbox.get()) is not None:
            try:
                self._conn.send(message)
            except OSError as e:
                self._stop(f"{type(e).__name__}: {e}")
                return
            except Exception as e:  # noqa: BLE001  (a request that cannot be pickled)
                if message[0] == "add":
                    self._admitted(message[1], ValueError(f"the request cannot be sent to the engine: {e}"))

    def _read(self) -> None:
        """The reader thread: every message of the core, until it stops."""
        handlers: dict[str, Callable] = {"admitted": self._admitted, "outputs": self._route,
                                         "failed": self._failed, "stats": self._set_stats}
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError) as e:
                self._stop(f"its pipe closed ({type(e).__name__})")
                return
            if message[0] == "stopped":
                return
            try:
                handlers[message[0]](*message[1:])
            except Exception:  # noqa: BLE001
                log.exception("could not handle the engine's %r message; serving on", message[0])

    def _stop(self, reason: str) -> None:
        """The engine is gone: fail what is in flight, refuse what comes."""
        if self.dead is None:
            self.dead = reason
            log.error("the engine has stopped: %s", reason)
        self._failed(f"the engine has stopped: {reason}", list(self._streams), self._stats)

    def _set_stats(self, stats: dict) -> None:
        self._stats = stats

    def _admitted(self, request_id: str, error: BaseException | None) -> None:
        stream = self._streams.get(request_id)
        if stream is None:              # aborted meanwhile
            return
        if error is not None:
            self._streams.pop(request_id, None)
        stream.loop.call_soon_threadsafe(_settle, stream.admitted, error)

    def _route(self, outputs: list[RequestOutput], stats: dict) -> None:
        self._stats = stats
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if self.metrics is not None:
                try:
                    self.metrics.observe(out, stream.arrival)
                except Exception:  # noqa: BLE001
                    log.exception("metrics failed; serving on")   # never let metrics stop the server
            if out.finished:
                self._streams.pop(out.request_id, None)
            by_loop.setdefault(stream.loop, []).append((stream.queue, out))
        for loop, deliveries in by_loop.items():     # one wake-up of each loop per step, not one per output
            loop.call_soon_threadsafe(_deliver, deliveries)

    def _failed(self, message: str, request_ids: list[str], stats: dict) -> None:
        self._stats = stats
        error = RuntimeError(message)
        for request_id in request_ids:
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.loop.call_soon_threadsafe(_fail, stream, error)


def _deliver(deliveries: list[tuple[asyncio.Queue, object]]) -> None:
    for target, item in deliveries:
        target.put_nowait(item)


def _fail(stream: _Stream, error: BaseException) -> None:
    """A request that cannot go on: its caller's wait for admission, or its stream, raises `error`."""
    if not stream.admitted.done():
        stream.admitted.set_exception(error)
    else:
        stream.queue.put_nowait(error)


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():              # the caller gave up (cancelled) meanwhile
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
