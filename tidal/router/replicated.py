"""ReplicatedEngineClient: N engine clients behind the one EngineClient interface, each request routed by the RoutingPolicy."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from tidal.client.engine_client import EngineClient, EngineInterrupted, Item
from tidal.engine.errors import EngineError
from tidal.engine.stats import StepStats
from tidal.router.policy import ReplicaLoad, Route, RouterSettings, RoutingPolicy
from tidal.router.prefix_index import PrefixIndex, prompt_block_hashes
from tidal.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class ReplicatedEngineClient(EngineClient):
    """Data parallel (`hardware.data_parallel` > 1): the server holds this like any EngineClient.

    Each `submit` computes the prompt's block hashes (kv/hashing.py's chain), asks the policy for
    a replica (session, cached prefix, load) and submits there; the replica's output handler
    then feeds the caller's queue directly, as with one engine. Each replica is restarted by its
    own supervisor; when one goes down, its requests that produced no output yet run on the
    others (`take_unstarted` / `adopt`), and its prefix index is cleared (its cache died with
    it). `alive` holds while any replica serves; `fatal` only once every replica gave up.

    Hooks: the per-replica metrics hooks (on_step, on_up, ...) are set on `replicas[i]`; this
    client owns each replica's `on_down` and `on_fatal`, and calls its own `on_fatal` when the
    last replica gives up and `on_route(replica, reason)` for every decision.
    """

    def __init__(
        self,
        replicas: Sequence[EngineClient],
        block_size: int,
        settings: RouterSettings | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(clock)
        if not replicas:
            raise ValueError("replicas=[] is invalid: expected at least one engine client")
        self._replicas = tuple(replicas)
        self.block_size = block_size
        self.policy = RoutingPolicy(len(replicas), settings)
        # Capacities are set from each engine's KV pool at launch (EngineReady.num_blocks).
        self.index = PrefixIndex()
        self.on_route: Callable[[int, str], None] | None = None
        self.info = None  # the first replica's EngineReady, after launch
        for i, replica in enumerate(self._replicas):
            replica.on_down = lambda i=i: self._replica_down(i)  # type: ignore[attr-defined]
            replica.on_fatal = self._replica_fatal

    # ---- lifecycle ----------------------------------------------------------------------------

    def launch(self):  # -> EngineReady of the first replica
        """Start every replica's engine process at once; blocks until all are ready. Raises like
        SupervisedEngineClient.launch (the first failure)."""
        with ThreadPoolExecutor(max_workers=len(self._replicas)) as pool:
            infos = list(pool.map(lambda r: r.launch(), self._replicas))
        for i, info in enumerate(infos):
            self.index.set_capacity(i, info.num_blocks)
        self.tokenizer = self._replicas[0].tokenizer
        self.info = infos[0]
        return infos[0]

    def start(self) -> None:
        for replica in self._replicas:
            replica.start()

    async def shutdown(self) -> None:
        await asyncio.gather(*(r.shutdown() for r in self._replicas))

    @property
    def replicas(self) -> tuple[EngineClient, ...]:
        return self._replicas

    @property
    def alive(self) -> bool:
        return any(r.alive for r in self._replicas)

    @property
    def fatal(self) -> str | None:
        reasons = [r.fatal for r in self._replicas]
        if all(reasons):
            return f"every engine replica gave up: {reasons[0]}"
        return None

    def _check_can_generate(self) -> None:
        fatal = self.fatal
        if fatal is not None:
            raise EngineInterrupted(fatal, "gave_up", None)

    # ---- state --------------------------------------------------------------------------------

    @property
    def stats(self) -> StepStats | None:
        """The latest replica statistics with the queues summed and the KV usage averaged (what
        admission and Retry-After read); per replica, see `replicas[i].stats`."""
        stats = [r.stats for r in self._replicas if r.stats is not None]
        if not stats:
            return None
        return dataclasses.replace(
            stats[-1],
            num_running=sum(s.num_running for s in stats),
            num_waiting=sum(s.num_waiting for s in stats),
            kv_usage=sum(s.kv_usage for s in stats) / len(stats),
        )

    @property
    def num_in_flight(self) -> int:
        return sum(r.num_in_flight for r in self._replicas)

    def holds(self, request_id: str) -> bool:
        return any(r.holds(request_id) for r in self._replicas)

    def completions_per_s(self) -> float | None:
        rates = [r.completions_per_s() for r in self._replicas]
        known = [x for x in rates if x is not None]
        return sum(known) if known else None

    # ---- requests -----------------------------------------------------------------------------

    def route(self, prompt_token_ids: Sequence[int], session_id: str | None) -> Route:
        """Choose the replica for a prompt and record that it will cache the prompt's blocks."""
        hashes = prompt_block_hashes(prompt_token_ids, self.block_size)
        loads = [
            ReplicaLoad(
                up=r.alive,
                num_requests=r.num_in_flight,
                kv_usage=r.stats.kv_usage if r.stats is not None else 0.0,
                gone=r.fatal is not None,
            )
            for r in self._replicas
        ]
        matched = self.index.match(range(len(loads)), hashes)
        route = self.policy.choose(loads, matched, len(hashes), session_id)
        self.index.add(route.replica, hashes)
        if self.on_route is not None:
            try:
                self.on_route(route.replica, route.reason)
            except Exception:  # metrics must never break serving
                log.exception("router hook failed")
        return route

    def submit(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        queue: asyncio.Queue[Item],
        *,
        session_id: str | None = None,
        **kwargs: object,
    ) -> None:
        """EngineClient.submit on the replica the policy chooses."""
        self._check_can_generate()
        if self.holds(request_id):
            raise ValueError(f"request_id={request_id!r} is invalid: it is already in use")
        route = self.route(prompt_token_ids, session_id)
        self._replicas[route.replica].submit(
            prompt_token_ids,
            params,
            request_id,
            queue,
            session_id=session_id,
            **kwargs,  # type: ignore[arg-type]
        )

    def cancel(self, request_id: str) -> None:
        for r in self._replicas:
            if r.holds(request_id):
                r.cancel(request_id)
                return

    async def abort(self, request_id: str) -> None:
        for r in self._replicas:
            if r.holds(request_id):
                await r.abort(request_id)
                return

    def interrupt_all(self, detail: str) -> int:
        return sum(r.interrupt_all(detail) for r in self._replicas)

    # ---- replica events (event loop) ----------------------------------------------------------

    def _replica_down(self, i: int) -> None:
        self.index.forget(i)
        if not any(r.alive for j, r in enumerate(self._replicas) if j != i):
            return  # nowhere else to go: they wait for this replica's restart
        moved = 0
        for stream in self._replicas[i].take_unstarted():
            add = stream.add
            route = self.route(add.prompt_token_ids, add.session_id)
            target = self._replicas[route.replica]
            if route.replica == i or not target.alive:  # cannot happen while another is up
                target = next(r for r in self._replicas if r.alive)
            try:
                target.adopt(stream)
            except (ValueError, EngineError) as e:
                stream.queue.put_nowait((stream.tag, e))
                continue
            moved += 1
        if moved:
            log.warning("engine replica %d down: %d waiting requests moved to the others", i, moved)

    def _replica_fatal(self) -> None:
        if self.fatal is not None and self.on_fatal is not None:
            self.on_fatal()
