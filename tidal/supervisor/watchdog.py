"""Watchdog: declares the engine hung when work is pending and nothing has progressed for too long."""

from __future__ import annotations

import time
from collections.abc import Callable


class Watchdog:
    """Progress is a step counter that moved (heartbeats carry it) or any output arriving.

    Time only counts while the API process has work in the engine: an idle engine may sit still
    forever. A heartbeat whose step counter did not move is no progress: the heartbeat thread
    keeps beating while a step is stuck, so "no heartbeat" and "no new step" are the same verdict.
    """

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not timeout_s > 0:
            raise ValueError(
                f"watchdog_timeout_s={timeout_s!r} is invalid: expected a positive number of seconds"
            )
        self.timeout_s = timeout_s
        self.clock = clock
        self._num_steps = -1
        self._last_progress_s = clock()
        self._busy = False

    def reset(self) -> None:
        """A new engine: nothing is owed yet."""
        self._num_steps = -1
        self._last_progress_s = self.clock()
        self._busy = False

    def progress(self, num_steps: int | None = None) -> None:
        """Outputs arrived (num_steps None) or a heartbeat reported `num_steps`."""
        if num_steps is None or num_steps != self._num_steps:
            self._last_progress_s = self.clock()
        if num_steps is not None:
            self._num_steps = num_steps

    def stalled_s(self, busy: bool) -> float:
        """Seconds without progress while busy (0 when idle)."""
        now = self.clock()
        if not busy or not self._busy:  # work just arrived: the clock starts now
            self._busy = busy
            self._last_progress_s = now
            return 0.0
        return now - self._last_progress_s

    def expired(self, busy: bool) -> bool:
        return self.stalled_s(busy) > self.timeout_s
