"""RoutingPolicy and PrefixIndex, pure: session affinity, cached-prefix routing, least load, when sessions move."""

from __future__ import annotations

import pytest

from tidal.config.engine import EngineConfig
from tidal.config.hardware import HardwareConfig
from tidal.router.policy import ReplicaLoad, RouterSettings, RoutingPolicy
from tidal.router.prefix_index import PrefixIndex, prompt_block_hashes
from tidal.router.replica_config import replica_engine_config

BS = 16


def idle(n: int) -> list[ReplicaLoad]:
    return [ReplicaLoad(up=True, num_requests=0, kv_usage=0.0) for _ in range(n)]


def test_least_loaded_spreads_new_requests() -> None:
    policy = RoutingPolicy(3)
    loads = [ReplicaLoad(True, 2, 0.1), ReplicaLoad(True, 1, 0.5), ReplicaLoad(True, 1, 0.2)]
    assert policy.choose(loads, [0, 0, 0], 4) == (2, "load")  # fewest, then emptiest KV
    # Then round-robin: sequential requests on idle replicas still spread.
    assert [policy.choose(idle(3), [0, 0, 0], 4).replica for _ in range(4)] == [0, 1, 2, 0]


def test_session_sticks_to_its_replica_until_overloaded() -> None:
    policy = RoutingPolicy(2, RouterSettings(balance_abs=4, balance_rel=2.0))
    assert policy.choose(idle(2), [0, 0], 2, "s") == (0, "load")
    # The other replica is now emptier and even caches more of this prompt: the session stays.
    loads = [ReplicaLoad(True, 3, 0.5), ReplicaLoad(True, 0, 0.0)]
    assert policy.choose(loads, [0, 2], 2, "s") == (0, "session")
    # 5 more than the least loaded and more than twice as many: both thresholds passed.
    loads = [ReplicaLoad(True, 6, 0.5), ReplicaLoad(True, 1, 0.0)]
    assert policy.choose(loads, [2, 0], 2, "s") == (1, "moved")
    assert policy.session_replica("s") == 1
    assert policy.choose(idle(2), [2, 0], 2, "s") == (1, "session")  # it stays where it moved


def test_session_moves_when_its_replica_is_down_and_never_to_a_gone_one() -> None:
    policy = RoutingPolicy(3)
    policy.choose(idle(3), [0, 0, 0], 1, "s")
    down = [
        ReplicaLoad(False, 0, 0.0),
        ReplicaLoad(True, 0, 0.0, gone=True),
        ReplicaLoad(True, 3, 0),
    ]
    assert policy.choose(down, [1, 1, 0], 1, "s") == (2, "moved")
    # Nothing up: it waits on a replica that will restart, not on the one that gave up.
    none_up = [ReplicaLoad(False, 0, 0.0), ReplicaLoad(False, 0, 0.0, gone=True)]
    assert RoutingPolicy(2).choose(none_up, [0, 0], 1) == (0, "load")


def test_kv_nearly_full_counts_as_overloaded() -> None:
    policy = RoutingPolicy(2, RouterSettings(kv_high=0.9))
    policy.choose(idle(2), [0, 0], 1, "s")
    loads = [ReplicaLoad(True, 1, 0.95), ReplicaLoad(True, 1, 0.3)]
    assert policy.choose(loads, [1, 0], 1, "s") == (1, "moved")


def test_longest_cached_prefix_wins_when_it_covers_enough_of_the_prompt() -> None:
    policy = RoutingPolicy(3, RouterSettings(min_prefix_ratio=0.5))
    loads = [ReplicaLoad(True, 0, 0.0), ReplicaLoad(True, 2, 0.0), ReplicaLoad(True, 1, 0.0)]
    assert policy.choose(loads, [0, 3, 2], 4) == (1, "prefix")
    assert policy.choose(loads, [0, 2, 2], 4) == (2, "prefix")  # a tie: the less loaded
    # One block of ten (a chat template's first block) says nothing: least load decides.
    assert policy.choose(loads, [0, 1, 0], 10) == (0, "load")
    # A new session is placed by its prefix too, and then sticks there.
    assert policy.choose(loads, [0, 3, 0], 4, "new") == (1, "prefix")
    assert policy.choose(loads, [4, 0, 0], 4, "new") == (1, "session")


def test_sessions_are_bounded_least_recently_used_first() -> None:
    policy = RoutingPolicy(2, RouterSettings(max_sessions=2))
    for s in ("a", "b"):
        policy.choose(idle(2), [0, 0], 1, s)
    policy.choose(idle(2), [0, 0], 1, "a")  # refresh a
    policy.choose(idle(2), [0, 0], 1, "c")
    assert policy.session_replica("b") is None
    assert policy.session_replica("a") == 0 and policy.session_replica("c") == 0


@pytest.mark.parametrize(
    "kwargs",
    [{"balance_abs": -1}, {"balance_rel": 0.5}, {"kv_high": 0.0}, {"min_prefix_ratio": 1.5}],
)
def test_bad_settings_are_refused(kwargs: dict) -> None:
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=name):
        RouterSettings(**kwargs)


def test_prefix_index_matches_the_leading_chain_and_evicts_least_recently_used() -> None:
    system = list(range(40))  # two full blocks and 8 tokens
    a = prompt_block_hashes(system + [100] * 24, BS)  # 4 blocks
    b = prompt_block_hashes(system + [200] * 24, BS)
    assert len(a) == 4 and a[:2] == b[:2] and a[2] != b[2]
    index = PrefixIndex()
    index.set_capacity(0, 6)
    index.add(0, a)
    assert index.match([0, 1], a) == [4, 0]
    assert index.match([0, 1], b) == [2, 0]  # the shared system prompt's blocks only
    index.add(0, b)  # 6 distinct blocks: full; the shared two were refreshed
    index.add(0, prompt_block_hashes([7] * 16, BS))  # evicts a's third block, the oldest
    assert index.match([0, 1], a) == [2, 0]  # a chain stops at its first miss
    assert index.match([1, 0], b) == [0, 4]
    index.forget(0)
    assert index.match([0, 1], b) == [0, 0] and index.num_blocks(0) == 0


def test_replica_config_splits_threads_and_kv_memory() -> None:
    cfg = EngineConfig()
    one = replica_engine_config(cfg, 2, num_cores=8)
    assert one.hardware.threads == 4 and one.hardware.data_parallel == 1
    assert one.cache.memory_fraction == pytest.approx(cfg.cache.memory_fraction / 2)
    assert replica_engine_config(cfg, 4, num_cores=2).hardware.threads == 1
    pinned = EngineConfig(hardware=HardwareConfig(threads=3, data_parallel=2))
    assert replica_engine_config(pinned, 2, num_cores=8).hardware.threads == 3
    with pytest.raises(ValueError, match="data_parallel"):
        HardwareConfig(data_parallel=0)


def test_replicas_named_by_keys_may_come_and_go() -> None:
    """Ray Serve's candidates change between calls: sessions follow replica ids, not positions."""
    policy = RoutingPolicy(None)
    assert policy.choose(idle(2), [0, 0], 1, "s", keys=["a", "b"]) == (0, "load")
    assert policy.choose(idle(3), [0, 0, 0], 1, "s", keys=["c", "b", "a"]) == (2, "session")
    # Its replica is gone from the candidates: the session moves and stays on the new one.
    assert policy.choose(idle(2), [0, 0], 1, "s", keys=["c", "b"]).reason == "moved"
    assert policy.session_replica("s") in ("b", "c")
    with pytest.raises(ValueError, match="keys"):
        policy.choose(idle(2), [0, 0], 1, keys=["x"])
