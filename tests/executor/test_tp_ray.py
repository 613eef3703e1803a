"""The ray backend: ranks as Ray actors in a placement group on a local Ray cluster give the
same outputs as one process; a group the cluster cannot place fails with a clear error."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.executor.test_tp_engine import _generate

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_ray_ranks_match_one_process(cluster, gemma: Path, reference: list[tuple]) -> None:
    ref = reference
    got = _generate(gemma, tensor_parallel_size=2, distributed_executor_backend="ray")
    assert [ids for ids, _, _ in got] == [ids for ids, _, _ in ref]


def test_a_group_the_cluster_cannot_place_is_refused(cluster, gemma: Path) -> None:
    from tidal import LLM

    with pytest.raises(
        ValueError,
        match=r"^hardware\.tensor_parallel=4 with the ray backend: .*could not place 4 bundles",
    ):
        LLM(str(gemma), tensor_parallel_size=4, distributed_executor_backend="ray")
