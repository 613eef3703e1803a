"""RestartBudget, Watchdog and the fault-injection grammar, on a fake clock."""

from __future__ import annotations

import pytest

from tidal.engine.process import fault_for
from tidal.supervisor.restart_policy import RestartBudget, RestartPolicy
from tidal.supervisor.watchdog import Watchdog


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_backoff_doubles_then_the_budget_runs_out_and_recovers_after_the_window() -> None:
    clock = FakeClock()
    budget = RestartBudget(
        RestartPolicy(max_restarts=4, window_s=60.0, backoff_initial_s=0.5, backoff_max_s=1.5),
        clock,
    )
    delays = []
    for _ in range(4):
        delays.append(budget.next_delay_s())
        clock.now += 1.0
    assert delays == [0.5, 1.0, 1.5, 1.5]  # doubled, capped at backoff_max_s
    assert budget.next_delay_s() is None  # a 5th restart within 60 s: give up
    assert budget.num_recent == 4
    clock.now = 100.0 + 60.0  # the first restart (at t=100) leaves the window
    assert budget.num_recent == 3
    assert budget.next_delay_s() == 1.5  # 3 recent restarts: 0.5 * 2**3 capped


def test_zero_restarts_gives_up_at_once() -> None:
    assert RestartBudget(RestartPolicy(max_restarts=0), FakeClock()).next_delay_s() is None


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_restarts", -1), ("window_s", 0.0), ("backoff_initial_s", -0.1), ("backoff_max_s", 0.1)],
)
def test_bad_policy_names_the_field(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=f"{field}={value!r} is invalid"):
        RestartPolicy(**{field: value})


def test_watchdog_counts_only_busy_time_without_progress() -> None:
    clock = FakeClock()
    dog = Watchdog(2.0, clock)
    clock.now += 100.0
    assert not dog.expired(busy=False)  # idle for 100 s is fine
    assert dog.stalled_s(busy=True) == 0.0  # work just arrived: the clock starts now
    clock.now += 1.5
    dog.progress(num_steps=10)  # a heartbeat with a new step count
    clock.now += 1.5
    assert dog.stalled_s(busy=True) == 1.5
    dog.progress(num_steps=10)  # a heartbeat, but the step loop did not move
    clock.now += 1.0
    assert dog.stalled_s(busy=True) == 2.5 and dog.expired(busy=True)
    dog.progress()  # outputs arrived
    assert not dog.expired(busy=True)
    clock.now += 5.0
    assert not dog.expired(busy=False)  # the work finished: nothing is owed
    dog.reset()
    assert dog.stalled_s(busy=True) == 0.0
    with pytest.raises(ValueError, match="watchdog_timeout_s=0"):
        Watchdog(0, clock)


def test_fault_spec_picks_the_first_matching_rule_per_incarnation() -> None:
    spec = "0:hang_when_waiting=2, 2:exit_on_start, *:exit_when_ready"
    assert fault_for(spec, 0) == "hang_when_waiting=2"
    assert fault_for(spec, 1) == "exit_when_ready"
    assert fault_for(spec, 2) == "exit_on_start"
    assert fault_for(None, 0) is None and fault_for("1:exit_on_start", 0) is None
    with pytest.raises(ValueError, match="TIDAL_ENGINE_FAULT='0:explode' is invalid"):
        fault_for("0:explode", 0)
    with pytest.raises(ValueError, match="hang_when_waiting'"):
        fault_for("0:hang_when_waiting", 0)
