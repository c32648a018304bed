"""EngineCore: the loop that steps an LLMEngine, fed and read through a pipe (vLLM V1's engine core).

`kvserve serve` runs it in a process of its own, so that stepping never waits for the HTTP side's
hold on the interpreter (the GIL): the server only pickles requests in and outputs out. Given an
engine object instead (tests, embedding), it runs in a thread of the caller's process.

Messages in: ("add", request_id, prompt, params, cache_salt), ("abort", request_id), ("query", query_id,
name, args) (a read of the engine's state: QUERIES), ("shutdown",).
Messages out:
- ("ready", model_path, max_model_len, stats, has_tokenizer) once, or ("error", message) if the engine
  cannot be built;
- ("admitted", request_id, error or None) per add;
- ("outputs", [RequestOutput delta (output_deltas.py)], stats) per step;
- ("stats", stats) then ("reply", query_id, result or exception) per query, answered between two
  steps: what the server reports beside the result (/metrics) is of the same step;
- ("failed", message, [request_id], stats, fatal) when a step raises: its requests are aborted, and the
  engine serves on, or (fatal: a tensor-parallel rank died, failed or hung) the engine process exits;
- ("stats", stats) when idle, and again each IDLE_STATS_SECONDS while they change (a tier's writer stores blocks
  after the last step); ("stopped",) after a shutdown, which aborts whatever is left.
"""
from __future__ import annotations

import logging
import signal
from multiprocessing.connection import Connection

from kvserve.config import EngineConfig
from kvserve.engine import kv_state
from kvserve.engine.engine import LLMEngine
from kvserve.parallel.workers import WorkerFailure
from kvserve.server.output_deltas import DeltaEncoder

log = logging.getLogger(__name__)

# what a ("query", ...) message may ask: reads of the engine that change nothing
QUERIES = {"kv_state": kv_state.snapshot, "kv_block": kv_state.block_detail, "sparse_reads": kv_state.sparse_reads}
IDLE_STATS_SECONDS = 1.0


class EngineCore:
    def __init__(self, engine: LLMEngine, conn: Connection):
        self.engine, self.conn = engine, conn
        self.deltas = DeltaEncoder()

    def run(self) -> None:
        """Take every message that has arrived, step once, report; block while there is nothing to do."""
        engine, conn = self.engine, self.conn
        try:
            conn.send(("ready", str(engine.model_path), engine.max_model_len, engine.stats(),
                       engine.tokenizer is not None))
            while True:
                if not engine.has_unfinished_requests():
                    self._idle()
                while conn.poll():
                    if not self._handle(conn.recv()):
                        self._abort_all()
                        conn.send(("stopped",))
                        return
                if engine.has_unfinished_requests():
                    self._step()
                else:
                    conn.send(("stats", engine.stats()))
        except (EOFError, OSError):     # the server went away without a word: so does the engine
            self._abort_all()

    def _idle(self) -> None:
        """Wait for a message; meanwhile report the stats again whenever they change (background writes)."""
        last = None
        while not self.conn.poll(IDLE_STATS_SECONDS):
            stats = self.engine.stats()
            if stats != last:
                self.conn.send(("stats", stats))
                last = stats

    def _handle(self, message: tuple) -> bool:
        """Apply one message; False on shutdown."""
        kind = message[0]
        if kind == "add":
            request_id = message[1]
            try:
                self.engine.add_request(*message[1:])
            except Exception as e:  # noqa: BLE001  (ValueError: an invalid request, the caller's 400)
                error = e if isinstance(e, ValueError) else RuntimeError(f"{type(e).__name__}: {e}")
                self.conn.send(("admitted", request_id, error))
            else:
                self.conn.send(("admitted", request_id, None))
        elif kind == "abort":
            self.engine.abort_request(message[1])
            self.deltas.forget(message[1])
        elif kind == "query":
            self._query(*message[1:])
        return kind != "shutdown"

    def _query(self, query_id: int, name: str, args: tuple) -> None:
        try:
            result = QUERIES[name](self.engine, *args)
        except Exception as e:  # noqa: BLE001  (ValueError: the caller asked for something that is not there)
            result = e if isinstance(e, ValueError) else RuntimeError(f"{type(e).__name__}: {e}")
        self.conn.send(("stats", self.engine.stats()))
        self.conn.send(("reply", query_id, result))

    def _step(self) -> None:
        in_flight = list(self.engine.requests)
        try:
            outputs = self.engine.step()
        except Exception as e:  # noqa: BLE001
            # fail the requests in flight (the step may have aborted some already), keep serving new ones
            log.exception("engine step failed; aborting the requests in flight")
            self._abort_all()
            fatal = isinstance(e, WorkerFailure)      # a rank is gone: this engine is done, the server starts a new one
            self.conn.send(("failed", f"the engine failed: {type(e).__name__}: {e}", in_flight, self.engine.stats(),
                            fatal))
            if fatal:
                raise
            return
        if outputs:
            self.conn.send(("outputs", [self.deltas.encode(o) for o in outputs], self.engine.stats()))

    def _abort_all(self) -> list[str]:
        request_ids = list(self.engine.requests)
        for request_id in request_ids:
            self.engine.abort_request(request_id)
            self.deltas.forget(request_id)
        return request_ids


def run_engine_process(config: EngineConfig, conn: Connection) -> None:
    """A spawned process's entry: build the engine, then serve the pipe until told to stop."""
    # Ctrl+C, and systemd's SIGTERM, reach the whole process group (this process's tensor-parallel workers, which
    # inherit these, too): the server handles them and tells the engine to stop, after the requests in flight.
    # An engine that died of them would be restarted in the middle of the server's shutdown.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        engine = LLMEngine(config)
    except Exception as e:  # noqa: BLE001  (a bad model or option: the server reports it and exits)
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    try:
        EngineCore(engine, conn).run()
    finally:
        engine.shutdown()         # its tensor-parallel workers, if any
