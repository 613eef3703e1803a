"""WaitingQueue: the order in which waiting and preempted requests are admitted."""

from __future__ import annotations

import math
from dataclasses import dataclass

from tidal.config.scheduler import SchedulerConfig
from tidal.request import Request


@dataclass(slots=True)
class _Entry:
    request: Request
    # Clock time of the first enqueue (kept across preemptions, so waiting keeps aging).
    enqueued_s: float
    # Arrival order; FCFS tie-break and "newest" for preemption.
    seq: int
    # Prompt tokens not in the prefix cache, estimated when (re)enqueued.
    uncached_tokens: int
    preempted: bool = False


class WaitingQueue:
    """Requests waiting for admission, ordered by this key (smallest first):

        waited_s = now - enqueued_s
        level    = request.priority + floor(waited_s / priority_aging_s)      # aging by level
        length   = uncached_tokens - length_aging_tokens_per_s * waited_s     # aging by length
        key      = (-level, 0 if preempted else 1, 0 if preempted else length, seq)

    Higher (aged) priority first; within a level preempted requests go first (they already
    waited and their KV is partly cached), oldest first; then shorter uncached work first,
    where a second of waiting is worth length_aging_tokens_per_s tokens; ties in arrival order.
    """

    def __init__(self, config: SchedulerConfig) -> None:
        self._config = config
        self._entries: dict[str, _Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._entries

    def add(self, request: Request, now_s: float, seq: int, uncached_tokens: int) -> None:
        self._entries[request.request_id] = _Entry(request, now_s, seq, uncached_tokens)

    def add_preempted(self, request: Request, enqueued_s: float, seq: int) -> None:
        self._entries[request.request_id] = _Entry(
            request, enqueued_s, seq, request.num_tokens, True
        )

    def remove(self, request_id: str) -> Request | None:
        entry = self._entries.pop(request_id, None)
        return entry.request if entry is not None else None

    def enqueued_s(self, request_id: str) -> float:
        return self._entries[request_id].enqueued_s

    def seq(self, request_id: str) -> int:
        return self._entries[request_id].seq

    def requests(self) -> list[Request]:
        """Waiting requests in insertion order (for deadline sweeps)."""
        return [e.request for e in self._entries.values()]

    def uncached(self, request_id: str) -> int:
        return self._entries[request_id].uncached_tokens

    def head_outranks(
        self, request: Request, enqueued_s: float, seq: int, uncached_tokens: int, now_s: float
    ) -> bool:
        """Whether some waiting request comes before `request` were it waiting with these
        figures (its remaining prefill as its length)."""
        if not self._entries:
            return False
        mine = self.key(_Entry(request, enqueued_s, seq, uncached_tokens), now_s)
        return any(self.key(e, now_s) < mine for e in self._entries.values())

    def uncached_tokens(self) -> int:
        return sum(e.uncached_tokens for e in self._entries.values())

    def oldest_enqueued_s(self) -> float | None:
        return min((e.enqueued_s for e in self._entries.values()), default=None)

    def ordered(self, now_s: float) -> list[Request]:
        """Requests in admission order at time now_s (the key in the class docstring)."""
        return [e.request for e in sorted(self._entries.values(), key=lambda e: self.key(e, now_s))]

    def key(self, entry: _Entry, now_s: float) -> tuple[int, int, float, int]:
        waited_s = max(0.0, now_s - entry.enqueued_s)
        level = entry.request.priority + math.floor(waited_s / self._config.priority_aging_s)
        if entry.preempted:
            return (-level, 0, 0.0, entry.seq)
        length = entry.uncached_tokens - self._config.length_aging_tokens_per_s * waited_s
        return (-level, 1, length, entry.seq)
