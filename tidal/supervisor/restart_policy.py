"""RestartPolicy and RestartBudget: how soon to restart a failed engine, and when to give up."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from tidal.config._check import check


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """At most `max_restarts` restarts within any `window_s`; the k-th recent one waits
    `backoff_initial_s * 2**k` seconds (capped at `backoff_max_s`) before starting."""

    max_restarts: int = 5
    window_s: float = 300.0
    backoff_initial_s: float = 0.25
    backoff_max_s: float = 10.0

    def __post_init__(self) -> None:
        check(self.max_restarts >= 0, "max_restarts", self.max_restarts, "an integer >= 0")
        check(self.window_s > 0, "window_s", self.window_s, "a positive number of seconds")
        check(
            self.backoff_initial_s >= 0,
            "backoff_initial_s",
            self.backoff_initial_s,
            "a number of seconds >= 0",
        )
        check(
            self.backoff_max_s >= self.backoff_initial_s,
            "backoff_max_s",
            self.backoff_max_s,
            f"a number of seconds >= backoff_initial_s ({self.backoff_initial_s})",
        )


class RestartBudget:
    """Remembers when restarts happened (injected clock) and answers "may I restart, after how long?"."""

    def __init__(self, policy: RestartPolicy, clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self.clock = clock
        self._restarts_s: deque[float] = deque()  # start times of restarts inside the window

    @property
    def num_recent(self) -> int:
        self._forget_old(self.clock())
        return len(self._restarts_s)

    def next_delay_s(self) -> float | None:
        """Claim one restart: the backoff to wait before it, or None when the budget is spent."""
        now = self.clock()
        self._forget_old(now)
        p = self.policy
        n = len(self._restarts_s)
        if n >= p.max_restarts:
            return None
        self._restarts_s.append(now)
        return min(p.backoff_max_s, p.backoff_initial_s * 2**n)

    def _forget_old(self, now: float) -> None:
        while self._restarts_s and now - self._restarts_s[0] >= self.policy.window_s:
            self._restarts_s.popleft()
