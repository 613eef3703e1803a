"""replica_engine_config: the EngineConfig one of N data-parallel replicas runs with (threads and KV memory split N ways)."""

from __future__ import annotations

import dataclasses
import os

from tidal.config.engine import EngineConfig


def available_cores() -> int:
    """CPU cores this process may run on (a container's or taskset's share, not the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def replica_engine_config(config: EngineConfig, num_replicas: int, num_cores: int) -> EngineConfig:
    """One replica's config: data_parallel 1 (it is one engine), `hardware.threads` cores / N
    when unset (N replicas each taking every core would oversubscribe the CPU), and a KV pool
    sized from memory_fraction / N when no kv_cache_bytes is set (an explicit size is per
    replica). On CUDA every replica shares the named device.
    """
    if num_replicas < 1:
        raise ValueError(f"num_replicas={num_replicas!r} is invalid: expected >= 1")
    hw = config.hardware
    threads = hw.threads if hw.threads is not None else max(1, num_cores // num_replicas)
    cache = config.cache
    if cache.kv_cache_bytes is None and num_replicas > 1:
        cache = dataclasses.replace(cache, memory_fraction=cache.memory_fraction / num_replicas)
    return dataclasses.replace(
        config,
        hardware=dataclasses.replace(hw, data_parallel=1, threads=threads),
        cache=cache,
    )
