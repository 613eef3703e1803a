"""InThreadEngineClient on a real tiny EngineCore: streamed deltas, queue-full, aborts, and engine failures that never hang."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tidal.client.in_thread import InThreadEngineClient
from tidal.config.cache import CacheConfig
from tidal.config.engine import EngineConfig
from tidal.config.model import ModelConfig
from tidal.config.scheduler import SchedulerConfig
from tidal.engine.builder import build_engine
from tidal.engine.errors import EngineError, QueueFullError
from tidal.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _engine(path: Path, **sched) -> InThreadEngineClient:
    config = EngineConfig(
        model=ModelConfig(path=str(path)),
        cache=CacheConfig(kv_cache_bytes=2 << 20),
        scheduler=SchedulerConfig(**sched),
    )
    return InThreadEngineClient(build_engine(config))


async def _collect(
    engine: InThreadEngineClient, ids: list[int], rid: str, params=GREEDY
) -> list[int]:
    tokens: list[int] = []
    async for out in engine.generate(ids, params, rid):
        tokens += out.outputs[0].token_ids
    assert out.finished
    return tokens


def test_concurrent_requests_match_the_sync_engine(tiny_checkpoint: Path) -> None:
    engine = _engine(tiny_checkpoint)
    prompts = [[2, 10 + i, 20 + i, 30] for i in range(4)]
    core = engine.core
    for i, p in enumerate(prompts):  # reference: the synchronous EngineCore alone
        core.add_request(f"sync{i}", p, GREEDY)
    expected: dict[str, list[int]] = {}
    while core.has_unfinished():
        for out in core.step():
            if out.finished:
                expected[out.request_id] = out.outputs[0].token_ids

    async def main() -> list[list[int]]:
        engine.start()
        try:
            return await asyncio.gather(
                *(_collect(engine, p, f"a{i}") for i, p in enumerate(prompts))
            )
        finally:
            await engine.shutdown()

    assert asyncio.run(main()) == [expected[f"sync{i}"] for i in range(4)]


def test_queue_full_abort_and_step_failure(tiny_checkpoint: Path) -> None:
    engine = _engine(tiny_checkpoint, max_num_seqs=1, max_queue=1)
    long = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)

    async def main() -> None:
        engine.start()
        try:
            # Three at once: one waiting seat, so the first waits and the next two are refused.
            gens = [engine.generate([2, 10, 11], long, f"q{i}") for i in range(3)]
            firsts = await asyncio.gather(*(anext(g) for g in gens), return_exceptions=True)
            assert [type(f) for f in firsts[1:]] == [QueueFullError, QueueFullError]
            await gens[0].aclose()  # abort mid-stream: the engine frees its KV
            while engine.core.has_unfinished():
                await asyncio.sleep(0.01)
            assert engine.core.kv.usage == 0.0
            with pytest.raises(ValueError, match="prompt"):
                await _collect(engine, [], "empty")

            # A step that raises fails the request in flight with EngineError, then serving resumes.
            real_execute = engine.core.runner.execute

            def broken(sched):
                if sched.is_empty:  # an idle bookkeeping step may still be under way
                    return real_execute(sched)
                engine.core.runner.execute = real_execute
                raise RuntimeError("injected fault")

            engine.core.runner.execute = broken
            with pytest.raises(EngineError, match="injected fault"):
                await _collect(engine, [2, 12], "boom")
            assert engine.num_step_errors == 1 and engine.alive
            assert len(await _collect(engine, [2, 12], "after")) == 6
        finally:
            await engine.shutdown()
        assert not engine.alive

    asyncio.run(main())


async def _until(cond, timeout_s: float = 30.0) -> None:
    """The loop thread reaches `cond` soon after the last output; bounded, not timed."""
    for _ in range(int(timeout_s / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


def test_the_loop_returns_free_heap_each_time_it_goes_idle(
    tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the last request finishes, the loop publishes idle stats and then hands the C heap's
    free pages back (malloc_trim): once per busy -> idle, never while anything runs."""
    import tidal.engine.loop as loop_module

    engine = _engine(tiny_checkpoint)
    busy_at_trim: list[bool] = []

    def trim() -> bool:
        busy_at_trim.append(engine.core.has_unfinished())
        return True

    monkeypatch.setattr(loop_module, "release_free_heap", trim)

    async def main() -> None:
        engine.start()
        try:
            burst = (_collect(engine, [2, 10 + i, 20, 30], f"r{i}") for i in range(3))
            await asyncio.gather(*burst)
            await _until(lambda: len(busy_at_trim) >= 1)
            assert busy_at_trim == [False]
            await _collect(engine, [2, 11, 21, 31], "again")
            await _until(lambda: len(busy_at_trim) >= 2)
        finally:
            await engine.shutdown()

    asyncio.run(main())
    assert busy_at_trim == [False, False]  # one per burst, with nothing left to run
