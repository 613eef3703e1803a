"""The standby engine process: a restart uses it (same greedy tokens), it holds no weights while
idle, and one that dies idle is replaced (or the restart goes cold without it)."""

from __future__ import annotations

import asyncio
import os
import pickle
import signal
from collections import defaultdict
from pathlib import Path

import pytest

from tidal.config.cache import CacheConfig
from tidal.config.engine import EngineConfig
from tidal.config.model import ModelConfig
from tidal.engine.messages import AddRequest, EngineReady, StepOutputs
from tidal.sampling_params import SamplingParams
from tidal.supervisor.handle import EngineHandle
from tidal.supervisor.restart_policy import RestartPolicy
from tidal.supervisor.standby import StartEngine
from tidal.supervisor.supervisor import _STANDBY_RETRY_S, Supervisor

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPT = [2, 10, 20, 30]
# A bound that turns a hang into a failure on a loaded 2-core box; nothing asserts durations.
DEADLINE_S = 180.0


class _Recorder:
    """The supervisor's listener: what it heard, and each request's tokens."""

    def __init__(self) -> None:
        self.events: list[tuple[str, object]] = []
        self.tokens: dict[str, list[int]] = defaultdict(list)
        self.finished: set[str] = set()

    def engine_message(self, msg: object) -> None:
        if isinstance(msg, StepOutputs):
            for out in msg.outputs:
                self.tokens[out.request_id] += out.outputs[0].token_ids
                if out.finished:
                    self.finished.add(out.request_id)

    def engine_down(self, reason: str, detail: str) -> None:
        self.events.append(("down", reason))

    def engine_up(self, ready: EngineReady, restarted: bool) -> None:
        self.events.append(("up", ready.pid))

    def engine_fatal(self, detail: str) -> None:
        self.events.append(("fatal", detail))

    def has_work(self) -> bool:
        return False


async def _until(check, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE_S
    while not check():
        if loop.time() > deadline:
            raise AssertionError(f"{what} never happened")
        await asyncio.sleep(0.05)


async def _greedy(sup: Supervisor, rec: _Recorder, request_id: str) -> list[int]:
    assert sup.send(AddRequest(request_id, PROMPT, GREEDY))
    await _until(lambda: request_id in rec.finished, f"request {request_id} finishing")
    return rec.tokens[request_id]


def _standby_pid(sup: Supervisor) -> int | None:
    s = sup._standby
    return s.pid if s is not None and s.is_alive() else None


def _maps(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


def _config(checkpoint: Path) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(path=str(checkpoint)), cache=CacheConfig(kv_cache_bytes=2 << 20)
    )


def _supervisor(checkpoint: Path, rec: _Recorder, clock=None, backoff_s: float = 0.0) -> Supervisor:
    """A supervisor that keeps a standby from the start (server.standby true)."""
    policy = RestartPolicy(backoff_initial_s=backoff_s, backoff_max_s=max(10.0, backoff_s))
    if clock is None:
        return Supervisor(_config(checkpoint), rec, policy=policy, standby=True)
    return Supervisor(_config(checkpoint), rec, policy=policy, standby=True, clock=clock)


def test_a_killed_engine_restarts_from_the_standby_with_the_same_tokens(
    tiny_checkpoint: Path,
) -> None:
    async def main() -> None:
        rec = _Recorder()
        # A live standby takes over without the backoff (an hour here: waiting it would hang).
        sup = _supervisor(tiny_checkpoint, rec, backoff_s=3600.0)
        first = await asyncio.to_thread(sup.launch)
        sup.start()
        try:
            before = await _greedy(sup, rec, "a")
            await _until(lambda: _standby_pid(sup) is not None, "a standby")
            standby = _standby_pid(sup)
            assert standby is not None and standby != first.pid
            assert sup.standby_live() and not sup.last_from_standby
            # Idle, it has imported torch but maps no weights.
            await _until(lambda: "libtorch" in _maps(standby), "the standby importing torch")
            assert "model.safetensors" not in _maps(standby)
            assert "model.safetensors" in _maps(first.pid)  # the engine does map them
            os.kill(first.pid, signal.SIGKILL)
            await _until(lambda: len(rec.events) >= 2, "the restart")
            assert rec.events == [("down", "died"), ("up", standby)]
            assert sup.pid == standby and sup.num_restarts == 1 and sup.last_from_standby
            # Its imports ran at a lower priority in a thread; the engine runs at ours.
            assert os.getpriority(os.PRIO_PROCESS, standby) == os.getpriority(os.PRIO_PROCESS, 0)
            assert await _greedy(sup, rec, "b") == before
            # A new standby takes the used one's place.
            await _until(lambda: _standby_pid(sup) not in (None, standby), "a new standby")
        finally:
            spare = sup._standby
            await sup.stop()
        assert spare is not None and not spare.is_alive()

    asyncio.run(main())


def test_a_standby_that_dies_idle_is_replaced_later_and_restarts_go_cold_meanwhile(
    tiny_checkpoint: Path,
) -> None:
    now = [0.0]

    async def main() -> None:
        rec = _Recorder()
        sup = _supervisor(tiny_checkpoint, rec, clock=lambda: now[0])
        first = await asyncio.to_thread(sup.launch)
        sup.start()
        try:
            await _until(lambda: _standby_pid(sup) is not None, "a standby")
            dead = _standby_pid(sup)
            assert dead is not None
            os.kill(dead, signal.SIGKILL)
            await _until(lambda: sup._standby is None, "the dead standby noticed")
            os.kill(first.pid, signal.SIGKILL)
            await _until(lambda: len(rec.events) >= 2, "the restart")
            cold = rec.events[1][1]
            assert rec.events[0] == ("down", "died") and cold not in (first.pid, dead)
            assert not sup.last_from_standby and not sup.standby_live()
            assert _standby_pid(sup) is None  # not before the retry time
            now[0] += _STANDBY_RETRY_S
            await _until(lambda: _standby_pid(sup) is not None, "a replacement standby")
            assert await _greedy(sup, rec, "c") != []
        finally:
            await sup.stop()

    asyncio.run(main())


def test_activate_reports_a_dead_standby_and_needs_one(tmp_path: Path) -> None:
    config = _config(tmp_path / "missing")  # the standby only warns: the start would fail
    standby = EngineHandle(config, None)
    assert standby.is_standby
    standby.kill()
    assert standby.activate(1, warmup=False, fault=None) is False
    assert standby.is_standby  # still not an engine
    engine = EngineHandle(config, 0, fault="exit_on_start")  # exits before importing torch
    try:
        with pytest.raises(ValueError, match="needs a standby handle, not incarnation 0"):
            engine.activate(1, warmup=False, fault=None)
    finally:
        engine.kill()


def test_start_engine_round_trips() -> None:
    msg = StartEngine(incarnation=2, warmup=True, fault="exit_when_ready")
    assert pickle.loads(pickle.dumps(msg)) == msg


def test_the_standby_imports_what_the_engine_imports_and_no_more() -> None:
    """The standby's pre-import builds the model on meta as the loader does: without torch's
    weight init, whose first call on meta imports torch._dynamo and sympy (~800 modules, ~65 MB
    of a process that is only waiting). A subprocess, so the test session's imports do not
    count; the bundled model's header is what it reads."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from tidal.config.engine import EngineConfig\n"
        "from tidal.supervisor.standby import _preimport\n"
        "_preimport(EngineConfig())\n"
        "print('torch' in sys.modules, 'tidal.models.gemma3' in sys.modules,\n"
        "      sorted(m for m in ('torch._dynamo', 'sympy') if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert out.stdout.strip() == "True True []", out.stdout + out.stderr
