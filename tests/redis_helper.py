"""A real redis-server on a free local port for the tests of the Redis tier (kvserve.bench.replicas.RedisServer),
or a skip with the reason where it is not installed."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kvserve.bench.replicas import RedisServer


def start_redis(workdir: Path, extra: list[str] | None = None) -> RedisServer:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (.ci/run installs it from the distribution's packages)")
    return RedisServer(workdir, extra)
