"""Helpers for engine feature tests: build an EngineCore on the tiny model with a fake clock, run it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.kv.pool_check import FakeClock
from tidal.engine.builder import build_engine
from tidal.engine.core import EngineCore
from tidal.engine.llm import engine_config_from_kwargs
from tidal.engine.output import RequestOutput
from tidal.engine.stats import StepStats

# 8 MiB holds hundreds of 8-token blocks of the tiny model: nothing is evicted unless a test
# shrinks it on purpose.
DEFAULT_KV_BYTES = 8 << 20


def make_engine(
    model_dir: Path,
    clock: FakeClock | None = None,
    on_step: Callable[[StepStats], None] | None = None,
    **kwargs: Any,
) -> EngineCore:
    kwargs.setdefault("kv_cache_bytes", DEFAULT_KV_BYTES)
    kwargs.setdefault("block_size", 8)
    config = engine_config_from_kwargs(str(model_dir), **kwargs)
    return build_engine(config, clock=clock or FakeClock(1000.0), on_step=on_step)


def run_to_completion(engine: EngineCore, max_steps: int = 10_000) -> dict[str, RequestOutput]:
    """Step until nothing is unfinished; returns the final output of every request that finished."""
    final: dict[str, RequestOutput] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return final
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    raise AssertionError(f"engine still has unfinished requests after {max_steps} steps")


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Run the tiny model on one thread, restored afterwards.

    Its ops are far too small to gain from threads, and on a shared 2-core machine OpenMP
    threads spinning against each other made a 40-step run 20x slower (27 s vs 1.4 s).
    Import this fixture into a test module to apply it there.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
