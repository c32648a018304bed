"""How long a tensor-parallel step may take, and the watch that acts when one takes longer.

A rank that hangs (stopped, or stuck in a driver) neither dies nor answers: rank 0 would wait in the step's
collectives, or for the workers to take the next step, for as long as they wait. A step that runs past its
bound (StepBound) is taken for a hang: the watchdog kills the ranks it can (the workers rank 0 spawned), which
fails rank 0's waits at once, and the engine then fails as for a dead rank (parallel/workers.py).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

# the default bound: never less than STEP_TIMEOUT_FLOOR seconds (what the first steps get, before any is measured),
# else STEP_TIMEOUT_FACTOR times the slowest step measured, or times the slowest measured time per token for the
# step's tokens, whichever is longer: a step many times larger than any before still gets its share
STEP_TIMEOUT_FLOOR = 120.0
STEP_TIMEOUT_FACTOR = 20.0
WATCH_PERIOD = 0.25          # seconds between the watchdog's looks at the step it watches


@dataclass
class StepBound:
    """How long a step of a given number of tokens may take: `step_timeout` seconds where given (EngineConfig),
    else derived from the steps measured so far (see STEP_TIMEOUT_FLOOR)."""

    step_timeout: float | None = None
    slowest_s: float = 0.0
    slowest_s_per_token: float = 0.0

    def seconds(self, num_tokens: int) -> float:
        """The bound of a step of num_tokens tokens."""
        if self.step_timeout is not None:
            return self.step_timeout
        return max(STEP_TIMEOUT_FLOOR,
                   STEP_TIMEOUT_FACTOR * max(self.slowest_s, self.slowest_s_per_token * num_tokens))

    def observe(self, seconds: float, num_tokens: int) -> None:
        """A step of num_tokens tokens that completed in `seconds`."""
        self.slowest_s = max(self.slowest_s, seconds)
        self.slowest_s_per_token = max(self.slowest_s_per_token, seconds / max(1, num_tokens))


class StepWatchdog:
    """A thread that calls `on_hang` once a step it was armed for runs past its bound; `hung_after` is then that
    bound (seconds), else None. arm and disarm cost the step two attribute writes: the thread looks every
    WATCH_PERIOD seconds."""

    def __init__(self, on_hang: Callable[[], None]):
        self.on_hang = on_hang
        self.hung_after: float | None = None
        self._deadline: float | None = None
        self._bound = 0.0
        self._closed = threading.Event()
        threading.Thread(target=self._watch, name="kvserve-step-watchdog", daemon=True).start()

    def arm(self, seconds: float) -> None:
        """Watch a step that starts now and must end within `seconds`."""
        self._bound = seconds
        self._deadline = time.monotonic() + seconds

    def disarm(self) -> None:
        """The step ended."""
        self._deadline = None

    def close(self) -> None:
        """Stop the thread."""
        self._closed.set()

    def _watch(self) -> None:
        while not self._closed.wait(WATCH_PERIOD):
            deadline = self._deadline
            if deadline is not None and time.monotonic() > deadline:
                self._deadline = None
                self.hung_after = self._bound
                self.on_hang()
