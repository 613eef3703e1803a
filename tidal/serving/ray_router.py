"""TidalRequestRouter: Ray Serve's custom request router running tidal's RoutingPolicy (session, cached prefix, load)."""

from __future__ import annotations

from ray.serve.request_router import (
    FIFOMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from tidal.engine.messages import AddRequest
from tidal.router.policy import ReplicaLoad, RouterSettings, RoutingPolicy
from tidal.router.prefix_index import PrefixIndex, prompt_block_hashes


class TidalRequestRouter(FIFOMixin, RequestRouter):
    """Routes `TidalEngine.generate(AddRequest)` calls like `tidal serve --data-parallel`.

    One instance lives in each process holding a handle to the engine deployment (the ingress
    replicas). The replicas are named by their ReplicaID, so the session table and the prefix
    index survive replicas coming and going; a replica that died is forgotten. Load is Serve's
    queue length for the replica, else the one it reported; KV usage comes from each replica's
    `record_routing_stats`. The chosen replica is ranked first and the others after it, so a
    replica that refuses (its max_ongoing_requests is reached) passes the request on.
    Calls that carry no AddRequest (info, stats) go to any replica.
    """

    def initialize_state(self, block_size: int = 16, **settings: object) -> None:
        self.block_size = block_size
        self.policy = RoutingPolicy(None, RouterSettings(**settings))  # type: ignore[arg-type]
        self.index = PrefixIndex()

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        add = _add_request(pending_request)
        if add is None or not candidate_replicas:
            return [candidate_replicas]
        keys = [r.replica_id for r in candidate_replicas]
        hashes = prompt_block_hashes(add.prompt_token_ids, self.block_size)
        loads = [self._load(r) for r in candidate_replicas]
        route = self.policy.choose(
            loads, self.index.match(keys, hashes), len(hashes), add.session_id, keys
        )
        chosen = candidate_replicas[route.replica]
        self.index.add(chosen.replica_id, hashes)
        rest = [r for r in candidate_replicas if r is not chosen]
        return [[chosen], rest] if rest else [[chosen]]

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.index.forget(replica_id)

    def _load(self, replica: RunningReplica) -> ReplicaLoad:
        stats = replica.routing_stats or {}
        queued = self.replica_queue_len_cache.get(replica.replica_id)
        num = queued if queued is not None else int(stats.get("num_requests", 0))
        return ReplicaLoad(up=True, num_requests=num, kv_usage=float(stats.get("kv_usage", 0.0)))


def _add_request(pending: PendingRequest | None) -> AddRequest | None:
    if pending is None or not pending.args:
        return None
    first = pending.args[0]
    return first if isinstance(first, AddRequest) else None
