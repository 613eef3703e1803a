"""RayGroup: ranks 1..N-1 as Ray actors in a placement group (one bundle per rank), so a model
can span machines; rank 0 stays the engine process and holds bundle 0's resources.

The cluster is the one `ray.init` finds: an existing one (RAY_ADDRESS, or `ray start --head` on
this machine), else a local one started here. Ray is the optional `ray` extra.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from tidal.executor.group import RankGroup, free_port
from tidal.executor.rank import RankSpec

log = logging.getLogger(__name__)

# How long the cluster gets to find room for every rank's bundle before the start fails.
PLACEMENT_TIMEOUT_S = 20.0


def _import_ray():
    try:
        import ray
    except ImportError:
        raise ValueError(
            "hardware.distributed_executor_backend='ray' needs Ray: pip install 'tidal[ray]', "
            "or use distributed_executor_backend 'mp' (local processes)"
        ) from None
    return ray


class _RankActor:
    """One worker rank inside a Ray actor: the same start and step loop as a local worker."""

    def run(self, spec: RankSpec) -> int:
        import torch
        import torch.distributed as dist

        from tidal.executor.rank import join_group, leave_group, load_rank
        from tidal.executor.worker import serve_steps
        from tidal.worker.model_runner import ModelRunner

        groups = join_group(spec)
        try:
            loaded = load_rank(spec, groups)
            sizing: list = [None]
            dist.broadcast_object_list(sizing, src=0, group=groups.control)
            layout, num_blocks, kv_dtype = sizing[0]
            runner = ModelRunner(loaded, layout, num_blocks, getattr(torch, kv_dtype))
            serve_steps(runner, groups, spec)
        finally:
            leave_group()
        return spec.rank


class RayGroup(RankGroup):
    def __init__(self, spec: RankSpec, on_lost: Callable[[str], None] | None = None) -> None:
        ray = _import_ray()
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        # Workers import tidal from where this process does (a source checkout included).
        root = str(Path(__file__).resolve().parents[2])
        env = {
            "env_vars": {
                "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
            }
        }
        if not ray.is_initialized():
            address = "auto" if os.environ.get("RAY_ADDRESS") or _local_cluster_running() else None
            ray.init(address=address, runtime_env=env, include_dashboard=False, log_to_driver=True)
        bundles = [{"CPU": float(spec.threads)} for _ in range(spec.world_size)]
        if spec.device == "cuda":
            bundles = [{**b, "GPU": 1.0} for b in bundles]
        total = ray.cluster_resources()
        short = [k for k in bundles[0] if sum(b[k] for b in bundles) > total.get(k, 0.0)]
        self._pg = None if short else placement_group(bundles, strategy="PACK")
        if self._pg is None or not _wait(ray, self._pg.ready(), PLACEMENT_TIMEOUT_S):
            if self._pg is not None:
                remove_placement_group(self._pg)
            raise ValueError(
                f"hardware.tensor_parallel={spec.world_size} with the ray backend: the Ray cluster "
                f"could not place {spec.world_size} bundles of {bundles[0]} within "
                f"{PLACEMENT_TIMEOUT_S:.0f} s (cluster resources: {ray.cluster_resources()}); "
                "add nodes or lower tensor_parallel"
            )
        host = ray.util.get_node_ip_address()
        nodes = _bundle_nodes(ray, self._pg)
        here = ray.get_runtime_context().get_node_id()
        # All ranks on this node: rendezvous on the loopback; else on this node's address.
        addr = "127.0.0.1" if all(n == here for n in nodes) else host
        spec = replace(spec, master_addr=addr, master_port=free_port(addr))
        super().__init__(spec, on_lost)
        actor_cls = ray.remote(num_cpus=0)(_RankActor)
        self._ray = ray
        self.actors = []
        self._runs = []
        for rank in range(1, spec.world_size):
            strategy = PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=rank)
            options = {"scheduling_strategy": strategy, "num_cpus": bundles[rank]["CPU"],
                       "runtime_env": env}  # fmt: skip
            if spec.device == "cuda":
                options["num_gpus"] = 1
            actor = actor_cls.options(**options).remote()
            self.actors.append(actor)
            self._runs.append(actor.run.remote(spec.for_rank(rank)))
            log.info("tensor-parallel rank %d/%d placed as a Ray actor", rank, spec.world_size)
        threading.Thread(target=self._watch, name="tidal-ray-ranks", daemon=True).start()
        try:
            self._join()
        except BaseException:
            self._stop_ranks()
            raise

    def _watch(self) -> None:
        ready, _ = self._ray.wait(self._runs, num_returns=1, timeout=None)
        try:
            self._ray.get(ready[0])
            detail = "returned"
        except Exception as e:  # the actor died or its rank raised
            detail = f"failed: {type(e).__name__}: {e}"
        self._lose(f"a tensor-parallel Ray actor {detail}")

    def _stop_ranks(self) -> None:
        from ray.util.placement_group import remove_placement_group

        self._closing = True
        try:
            self._ray.wait(self._runs, num_returns=len(self._runs), timeout=10)
        finally:
            for actor in self.actors:
                self._ray.kill(actor)
            remove_placement_group(self._pg)


def _wait(ray, ref, timeout_s: float) -> bool:
    ready, _ = ray.wait([ref], timeout=timeout_s)
    return bool(ready)


def _bundle_nodes(ray, pg) -> list[str]:
    from ray.util.placement_group import placement_group_table

    table = placement_group_table(pg)
    return list(table.get("bundles_to_node_id", {}).values())


def _local_cluster_running() -> bool:
    """A `ray start --head` on this machine leaves its address here."""
    return Path("/tmp/ray/ray_current_cluster").exists()
