"""RoutingPolicy: the replica a request goes to (its session's, the one caching most of its prompt, the least loaded), pure."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

# Route reasons, also the `reason` label of tidal:router_decisions_total.
REASONS = ("session", "prefix", "load", "moved")


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """What the router knows of one replica when a request arrives."""

    up: bool  # its engine serves now (a down one keeps what it is sent until it restarts)
    num_requests: int  # running + waiting: requests in flight through this API process
    kv_usage: float  # fraction of its KV blocks held by requests, from its last step
    gone: bool = False  # it gave up for good (its restart budget is spent): never chosen


class Route(NamedTuple):
    replica: int
    reason: str  # one of REASONS


@dataclass(frozen=True, slots=True)
class RouterSettings:
    # A replica is overloaded when it holds more than `balance_abs` requests beyond the least
    # loaded one AND more than `balance_rel` times as many (SGLang's cache-aware router uses the
    # same two thresholds): affinity gives way to balance only past both.
    balance_abs: int = 8
    balance_rel: float = 1.5
    # ... or when its KV is this full while another replica's is not.
    kv_high: float = 0.95
    # A cached prefix decides only when it covers at least this share of the prompt's full
    # blocks: every chat prompt shares the template's first block, which says nothing.
    min_prefix_ratio: float = 0.5
    # Sessions remembered, least recently used dropped first (a dropped one is routed afresh).
    max_sessions: int = 65536

    def __post_init__(self) -> None:
        for name, value, ok, want in (
            ("balance_abs", self.balance_abs, self.balance_abs >= 0, "an integer >= 0"),
            ("balance_rel", self.balance_rel, self.balance_rel >= 1.0, "a number >= 1"),
            ("kv_high", self.kv_high, 0.0 < self.kv_high <= 1.0, "a fraction in (0, 1]"),
            (
                "min_prefix_ratio",
                self.min_prefix_ratio,
                0.0 < self.min_prefix_ratio <= 1.0,
                "a fraction in (0, 1]",
            ),
            ("max_sessions", self.max_sessions, self.max_sessions >= 1, "an integer >= 1"),
        ):
            if not ok:
                raise ValueError(f"{name}={value!r} is invalid: expected {want}")


class RoutingPolicy:
    """Chooses a replica per request and remembers each session's replica.

    The order: (1) a session goes to the replica that served it, unless that one is down or
    overloaded; (2) else the replica holding the longest cached prefix of the prompt, when it
    covers enough of it; (3) else the least loaded replica (fewest requests, then the emptiest
    KV, then round-robin). A session that had to leave its replica is "moved" and stays
    on the new one. With no replica up, requests go where they would have gone among all that
    have not given up (a supervised replica keeps them until its engine is back).
    """

    def __init__(self, num_replicas: int | None, settings: RouterSettings | None = None) -> None:
        """`num_replicas` None: the candidates may change from call to call (Ray Serve's
        replicas come and go); each call then names them with `keys`."""
        if num_replicas is not None and num_replicas < 1:
            raise ValueError(f"num_replicas={num_replicas!r} is invalid: expected >= 1")
        self.num_replicas = num_replicas
        self.settings = settings or RouterSettings()
        self._sessions: OrderedDict[str, Hashable] = OrderedDict()
        # Equal loads are broken round-robin from here, so a trickle of sequential requests
        # (every replica idle each time) still spreads instead of piling on replica 0.
        self._cursor = 0

    def session_replica(self, session_id: str) -> Hashable | None:
        return self._sessions.get(session_id)

    def choose(
        self,
        loads: Sequence[ReplicaLoad],
        matched_blocks: Sequence[int],
        num_prompt_blocks: int,
        session_id: str | None = None,
        keys: Sequence[Hashable] | None = None,
    ) -> Route:
        """The replica for one request, as a position in `loads`; `matched_blocks[i]` is how many
        leading full blocks of its prompt replica i caches (of `num_prompt_blocks`). `keys`
        name the replicas for the session table (default: their positions)."""
        n = len(loads)
        expected = self.num_replicas if self.num_replicas is not None else n
        if n != expected or len(matched_blocks) != n or (keys is not None and len(keys) != n):
            raise ValueError(
                f"expected {expected} replica loads, matches and keys, got {n}, "
                f"{len(matched_blocks)} and {'-' if keys is None else len(keys)}"
            )
        if n == 0:
            raise ValueError("loads=[] is invalid: expected at least one replica")
        names: list[Hashable] = list(range(n)) if keys is None else list(keys)
        alive = [i for i, load in enumerate(loads) if not load.gone] or list(range(n))
        pool = [i for i in alive if loads[i].up] or alive
        fit = [i for i in pool if not self._overloaded(i, loads, pool)] or pool
        home_key = self._sessions.get(session_id) if session_id is not None else None
        home = names.index(home_key) if home_key is not None and home_key in names else None
        if home is not None and home in fit:
            self._remember(session_id, home_key)
            return Route(home, "session")

        def lightness(i: int) -> tuple[int, float, int]:
            return (loads[i].num_requests, loads[i].kv_usage, (i - self._cursor) % n)

        route = Route(min(fit, key=lightness), "load")
        if num_prompt_blocks > 0:
            best = min(fit, key=lambda i: (-matched_blocks[i], *lightness(i)))
            share = matched_blocks[best] / num_prompt_blocks
            if matched_blocks[best] > 0 and share >= self.settings.min_prefix_ratio:
                route = Route(best, "prefix")
        if route.reason == "load":
            self._cursor = (route.replica + 1) % n
        if session_id is not None:
            if home_key is not None and home_key != names[route.replica]:
                route = Route(route.replica, "moved")
            self._remember(session_id, names[route.replica])
        return route

    def _overloaded(self, i: int, loads: Sequence[ReplicaLoad], pool: Sequence[int]) -> bool:
        s = self.settings
        least = min(loads[j].num_requests for j in pool)
        n = loads[i].num_requests
        if n - least > s.balance_abs and n > s.balance_rel * least:
            return True
        emptiest_kv = min(loads[j].kv_usage for j in pool)
        return loads[i].kv_usage >= s.kv_high > emptiest_kv

    def _remember(self, session_id: str, replica: Hashable) -> None:
        self._sessions[session_id] = replica
        self._sessions.move_to_end(session_id)
        while len(self._sessions) > self.settings.max_sessions:
            self._sessions.popitem(last=False)
