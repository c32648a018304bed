"""AsyncEngine: the asyncio front of an EngineCore; each request reads its own output queue."""
from __future__ import annotations

import asyncio
import atexit
import logging
import multiprocessing
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from itertools import count
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path

from kvserve.config import EngineConfig, ModelConfig
from kvserve.engine.engine import LLMEngine
from kvserve.model.loader import load_tokenizer
from kvserve.outputs import RequestOutput
from kvserve.sampling import SamplingParams
from kvserve.server.engine_core import EngineCore, run_engine_process
from kvserve.server.output_deltas import apply_delta

log = logging.getLogger(__name__)

# How long a stopping engine process (and its tensor-parallel workers) may take to exit before it is killed: long
# enough for a loaded machine to tear down torch, short enough that a hung engine never outlives the server.
SHUTDOWN_GRACE_S = 60.0


class QueueFullError(RuntimeError):
    """More requests are in flight than the server accepts (--max-queue)."""


class EngineError(RuntimeError):
    """The engine failed while running a request (a step raised, or its process died)."""


class EngineUnavailableError(RuntimeError):
    """The engine is not running: restarting after it died, or stopped for good."""


@dataclass
class EngineInfo:
    """What the HTTP side needs of an engine that runs in another process."""

    tokenizer: object | None          # None: the engine runs without one (skip_tokenizer_init)
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
    engine steps without ever waiting for the HTTP side's hold on the GIL. Should that process die,
    the requests in flight fail (EngineError), the process is reaped and started again (up to
    `start_attempts` tries, each logged), and until it is ready new requests are refused
    (EngineUnavailableError). Given an LLMEngine, the core runs in a thread. Requests that arrive
    during a step all enter at the next step boundary, as do aborts and reads of the engine's state
    (`query`). A request whose consumer goes away (a client disconnect cancels its generator) is
    aborted and its blocks return to the pool at once.
    """

    def __init__(self, engine: LLMEngine | EngineConfig, max_queue: int | None = None, metrics=None,
                 start_attempts: int = 3):
        self.max_queue = max_queue
        self.metrics = metrics                # ServerMetrics: observe(delta, arrival), forget(request_id)
        self.start_attempts = start_attempts
        self._config = engine if isinstance(engine, EngineConfig) else None
        # what the writer thread sends, in order: (generation, message); a message of an engine
        # generation that has died is dropped, never sent to its successor
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._generation = 0
        self._streams: dict[str, _Stream] = {}
        self._queries: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._query_ids = count()
        self._closing = False
        self.dead: str | None = None          # why the engine takes no requests now; None: it does
        self._conn, self._core, ready = self._start_core(engine)
        self._stats: dict | None = ready.stats
        self.kv_pool_tokens = ready.kv_pool_tokens
        self.engine = engine if isinstance(engine, LLMEngine) else EngineInfo(
            load_tokenizer(ready.model_path) if ready.has_tokenizer else None, ModelConfig.from_path(ready.model_path),
            ready.max_model_len)
        self._threads: list[threading.Thread] = []

    @staticmethod
    def _start_core(engine: LLMEngine | EngineConfig) -> tuple[Connection, threading.Thread | BaseProcess, _Ready]:
        """Start an engine core and wait until it is ready; ValueError if it cannot start."""
        conn, core_conn = multiprocessing.Pipe()
        core: threading.Thread | BaseProcess
        if isinstance(engine, EngineConfig):
            # a daemon may start no process: a tensor-parallel engine's starts its workers (which exit with it)
            core = multiprocessing.get_context("spawn").Process(
                target=run_engine_process, args=(engine, core_conn), name="kvserve-engine",
                daemon=engine.tensor_parallel_size == 1)
            atexit.register(_kill_if_running, core)
            core.start()
            core_conn.close()                 # so that a child that dies reads as the pipe's end
        else:
            core = threading.Thread(target=EngineCore(engine, core_conn).run, name="kvserve-engine", daemon=True)
            core.start()
        try:
            ready = conn.recv()
        except EOFError:
            core.join()
            raise ValueError(f"the engine process exited (code {core.exitcode}) before it was ready") from None
        except BaseException:           # Ctrl+C while it starts, which it ignores: it is not wanted any more
            if isinstance(core, BaseProcess):
                _kill_if_running(core)
            raise
        if ready[0] == "error":
            core.join()
            raise ValueError(ready[1])
        return conn, core, _Ready(*ready[1:])

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def stats(self) -> dict | None:
        """The engine's stats (LLMEngine.stats) as of its latest step or idle moment; None while no
        engine runs."""
        return self._stats

    def start(self) -> None:
        self._threads = [threading.Thread(target=self._read, name="kvserve-outputs", daemon=True),
                         threading.Thread(target=self._write, name="kvserve-requests", daemon=True)]
        for thread in self._threads:
            thread.start()

    def shutdown(self) -> None:
        """Abort every request in flight and stop the engine: an engine process gets SHUTDOWN_GRACE_S to exit and
        is then killed, so none is left (blocks: call it off the event loop)."""
        self._closing = True
        error = EngineUnavailableError("the server is shutting down")
        for request_id, stream in list(self._streams.items()):
            self._streams.pop(request_id, None)
            stream.loop.call_soon_threadsafe(_fail, stream, error)
        self._fail_queries(error)
        self._outbox.put((None, ("shutdown",)))
        self._outbox.put(None)
        self._core.join(timeout=SHUTDOWN_GRACE_S)
        if isinstance(self._core, BaseProcess) and self._core.is_alive():
            log.error("the engine process did not exit within %.0f s of being told to stop: killed it",
                      SHUTDOWN_GRACE_S)
            self._core.kill()
            self._core.join()
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
        # read in this order (the reader thread writes them in the other): a request either goes to
        # the engine generation it was registered under, which fails it if it dies, or is refused
        generation = self._generation
        if self.dead is not None:
            self._streams.pop(request_id, None)
            raise EngineUnavailableError(f"the engine is not running: {self.dead}")
        self._outbox.put((generation, ("add", request_id, prompt, params, cache_salt)))
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

    async def query(self, name: str, *args):
        """The engine's answer to a read of its state (engine_core.QUERIES), given between two steps;
        ValueError if it refuses the arguments, EngineUnavailableError while no engine runs."""
        loop = asyncio.get_running_loop()
        query_id, future = next(self._query_ids), loop.create_future()
        self._queries[query_id] = (loop, future)
        generation = self._generation        # read before `dead`, as submit does
        try:
            if self.dead is not None:
                raise EngineUnavailableError(f"the engine is not running: {self.dead}")
            self._outbox.put((generation, ("query", query_id, name, args)))
            return await future
        finally:
            self._queries.pop(query_id, None)

    def abort(self, request_id: str) -> None:
        """Abort at the next step boundary (queued for the writer: never blocks the caller)."""
        if self._streams.pop(request_id, None) is not None and self.metrics is not None:
            self.metrics.forget(request_id)
        self._outbox.put((self._generation, ("abort", request_id)))

    def _write(self) -> None:
        """The writer thread: the requests and aborts, in order (a send may wait while the engine steps)."""
        while (item := self._outbox.get()) is not None:
            generation, message = item
            if generation is not None and generation != self._generation:
                continue                # for an engine that has died
            try:
                self._conn.send(message)
            except OSError:
                continue                # the engine is gone: the reader sees its pipe close
            except Exception as e:  # noqa: BLE001  (a request that cannot be pickled)
                if message[0] == "add":
                    self._admitted(message[1], ValueError(f"the request cannot be sent to the engine: {e}"))

    def _read(self) -> None:
        """The reader thread: every message of the core, until it stops (or dies for good)."""
        handlers: dict[str, Callable] = {"admitted": self._admitted, "outputs": self._route,
                                         "failed": self._failed, "stats": self._set_stats, "reply": self._reply}
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError) as e:
                if self._engine_lost(f"its pipe closed ({type(e).__name__})"):
                    continue
                return
            if message[0] == "stopped":
                return
            try:
                handlers[message[0]](*message[1:])
            except Exception:  # noqa: BLE001
                log.exception("could not handle the engine's %r message; serving on", message[0])

    def _engine_lost(self, reason: str) -> bool:
        """The engine is gone: fail what is in flight, refuse what comes, and start a new engine
        process if there is a config to build it from. True once a new one is ready."""
        self.dead = reason
        self._generation += 1
        self._stats = None
        self._failed(f"the engine stopped: {reason}", list(self._streams))
        self._fail_queries(EngineUnavailableError(f"the engine stopped: {reason}"))
        if self._closing or self._config is None:
            log.error("the engine has stopped: %s", reason)
            return False
        self._conn.close()
        self._core.join(timeout=10)    # reap the dead process (one whose pipe closed but hangs, by force)
        if self._core.is_alive():
            self._core.kill()
            self._core.join()
        log.error("the engine process exited (code %s): %s; failed the requests in flight, restarting it",
                  self._core.exitcode, reason)
        for attempt in range(1, self.start_attempts + 1):
            try:
                conn, core, ready = self._start_core(self._config)
            except ValueError as e:
                log.error("engine start %d of %d failed: %s", attempt, self.start_attempts, e)
                continue
            self._conn, self._core, self.kv_pool_tokens = conn, core, ready.kv_pool_tokens
            self._stats, self.dead = ready.stats, None
            log.warning("the engine process is running again (start %d of %d)", attempt, self.start_attempts)
            if self._closing:          # the server began to shut down meanwhile: the writer is gone
                conn.send(("shutdown",))
            return True
        self.dead = f"{reason}; it could not be started again ({self.start_attempts} tries)"
        log.error("the engine could not be started again after %d tries; the server refuses requests",
                  self.start_attempts)
        return False

    def _set_stats(self, stats: dict) -> None:
        self._stats = stats

    def _reply(self, query_id: int, result) -> None:
        loop, future = self._queries.get(query_id, (None, None))
        if future is not None:          # else its caller gave up
            loop.call_soon_threadsafe(_resolve, future, result)

    def _fail_queries(self, error: BaseException) -> None:
        for loop, future in list(self._queries.values()):
            loop.call_soon_threadsafe(_resolve, future, error)

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

    def _failed(self, message: str, request_ids: list[str], stats: dict | None = None, fatal: bool = False) -> None:
        """Fail the requests; `fatal`: the engine is stopping (its process exits, and a new one is started once its
        pipe closes), and takes no request from now on: /health says so before the requests' errors arrive."""
        if fatal:
            self.dead = message
        if stats is not None:
            self._stats = stats
        error = EngineError(message)
        for request_id in request_ids:
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                if self.metrics is not None:
                    self.metrics.forget(request_id)
                stream.loop.call_soon_threadsafe(_fail, stream, error)


@dataclass
class _Ready:
    """An engine core's ready message."""

    model_path: Path
    max_model_len: int
    stats: dict
    has_tokenizer: bool

    def __post_init__(self):
        self.model_path = Path(self.model_path)

    @property
    def kv_pool_tokens(self) -> int:
        """Tokens the whole KV cache holds (0 without a cache)."""
        return self.stats["kv_blocks_total"] * self.stats["kv_block_size"]


def _kill_if_running(core: BaseProcess) -> None:
    """Kill an engine process that is still running, and reap it: at the server's exit, one that was not told to
    stop (it ignores SIGTERM, all that multiprocessing sends its daemon processes before waiting for them)."""
    if core.is_alive():
        core.kill()
        core.join()


def _deliver(deliveries: list[tuple[asyncio.Queue, object]]) -> None:
    for target, item in deliveries:
        target.put_nowait(item)


def _fail(stream: _Stream, error: BaseException) -> None:
    """A request that cannot go on: its caller's wait for admission, or its stream, raises `error`."""
    if not stream.admitted.done():
        stream.admitted.set_exception(error)
    else:
        stream.queue.put_nowait(error)


def _resolve(future: asyncio.Future, result) -> None:
    """A query's answer: its result, or the exception it raises."""
    if future.done():
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():              # the caller gave up (cancelled) meanwhile
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
