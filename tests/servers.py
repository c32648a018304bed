"""Servers for the tests: the app on a free loopback port in a thread, and the waits their tests share."""
from __future__ import annotations

import socket
import threading
import time

import uvicorn

from kvserve.server.app import ServerConfig
from kvserve.server.async_engine import SHUTDOWN_GRACE_S
from kvserve.server.http import uvicorn_config

MODEL = "tiny-llama"
KEY = "sk-test"
ENGINE_ARGS = dict(block_size=4, num_kv_blocks=256, max_model_len=128)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """The app served as `kvserve serve` serves it, on a free loopback port, in a thread."""

    def __init__(self, app, config: ServerConfig | None = None):
        config = config or ServerConfig()
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", self.port, config.request_read_timeout,
                                                    config.max_connections, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.05)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc):
        self.server.should_exit = True
        # the server's shutdown waits for its engine process, which a busy machine may take a while to stop
        self.thread.join(timeout=SHUTDOWN_GRACE_S + 60)
        assert not self.thread.is_alive(), "the server did not shut down"


def wait_for(condition, what: str, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.02)
