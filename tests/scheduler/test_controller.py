"""Step cost model and batch controller on synthetic step costs: fit, convergence, hysteresis,
re-convergence after a cost shift, TTFT, seat cap, determinism (no clock, no torch)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tidal.config.scheduler import SchedulerConfig
from tidal.scheduler.controller import BatchController, StepLoad, StepPlan
from tidal.scheduler.cost_model import StepCostModel, StepShape, chunk_attended_keys

TRUE = (0.02, 0.002, 0.005, 0.0003)  # base, per prefill token, per decode seq, per 1k keys


def true_cost(shape: StepShape, coef: tuple[float, ...] = TRUE) -> float:
    x = shape.features()
    return sum(c * v for c, v in zip(coef, x))


def simulate(
    controller: BatchController,
    cost: Callable[[StepShape, int], float],
    steps: int,
    num_decodes: int = 4,
    context: int = 500,
) -> list[tuple[StepPlan, float]]:
    """A queue that never empties: every step prefills what the plan allows beside the decodes."""
    trace = []
    for i in range(steps):
        keys = num_decodes * (context + 1)
        plan = controller.plan(StepLoad(num_decodes, keys, num_decodes))
        shape = StepShape(
            plan.prefill_tokens,
            num_decodes,
            keys + chunk_attended_keys(context, plan.prefill_tokens),
        )
        step_s = cost(shape, i)
        controller.observe(shape, step_s, plan, filled=True)
        trace.append((plan, step_s))
    return trace


def test_chunk_attended_keys_counts_the_causal_triangle() -> None:
    assert chunk_attended_keys(0, 1) == 1
    assert chunk_attended_keys(0, 4) == 1 + 2 + 3 + 4
    assert chunk_attended_keys(10, 3) == 11 + 12 + 13


def test_cost_model_recovers_the_true_coefficients() -> None:
    model = StepCostModel(decay=1.0)
    for i in range(40):
        shape = StepShape((i * 37) % 300, (i * 5) % 17, (i * 7919) % 200_000)
        model.observe(shape, true_cost(shape))
    for fitted, true in zip(model.coefficients, TRUE):
        assert fitted == pytest.approx(true, rel=0.1)  # the weak prior pulls a little
    probe = StepShape(128, 8, 50_000)
    assert model.predict_s(probe) == pytest.approx(true_cost(probe), rel=0.01)


@pytest.mark.parametrize("window,decay", [(64, 0.9), (5, 0.5), (7, 1.0)])
def test_cost_model_updates_the_fit_as_a_refit_of_its_window_would(
    window: int, decay: float
) -> None:
    """The normal equations are updated step by step (steps leaving the window taken out): they
    stay the window's own, and the coefficients a refit of that window gives."""
    model = StepCostModel(window=window, decay=decay)
    for i in range(3 * window + 2):  # a window refilled twice, and not at a full-window point
        shape = StepShape((i * 37) % 300, (i * 5) % 17, (i * 7919) % 200_000)
        model.observe(shape, true_cost(shape) * (1.0 + 0.2 * ((i * 13) % 7 - 3) / 3))
        ata, aty = model._normal_equations()
        assert model._aty == pytest.approx(aty, rel=1e-9, abs=1e-12)
        for row, exact in zip(model._ata, ata, strict=True):
            assert row == pytest.approx(exact, rel=1e-9, abs=1e-12)
    updated = model.coefficients
    model._ata, model._aty = model._normal_equations()
    assert updated == pytest.approx(model._fit(), rel=1e-9, abs=1e-12)


def test_cost_model_keeps_costs_non_negative_and_ignores_bad_times() -> None:
    model = StepCostModel()
    for i in range(20):  # time falls with prefill tokens: a negative slope is refused
        shape = StepShape(i * 10, 2, 1000)
        model.observe(shape, 0.1 - i * 0.001)
    model.observe(StepShape(10, 1, 10), float("nan"))
    model.observe(StepShape(10, 1, 10), -1.0)
    assert all(c >= 0 for c in model.coefficients)
    assert model.num_observed == 20


def test_one_stalled_step_does_not_wreck_the_fit() -> None:
    model = StepCostModel(prior_s=TRUE)
    stalled = StepShape(16, 0, 136)
    model.observe(stalled, 30 * true_cost(stalled))  # a first-call compile, a page-fault storm
    assert model.coefficients[0] < 0.2  # clipped at 4x the prediction: far from its 1.6 s
    for i in range(10):
        shape = StepShape(32 + i, 4, 4000)
        model.observe(shape, true_cost(shape))
    probe = StepShape(64, 4, 8000)
    assert model.predict_s(probe) == pytest.approx(true_cost(probe), rel=0.1)


def test_prefill_tokens_within_inverts_the_prediction() -> None:
    model = StepCostModel(prior_s=TRUE)
    n = model.prefill_tokens_within(0.15, 4, 2000, prefix_tokens=0)
    at_n = StepShape(n, 4, 2000 + chunk_attended_keys(0, n))
    above = StepShape(n + 1, 4, 2000 + chunk_attended_keys(0, n + 1))
    assert model.predict_s(at_n) <= 0.15 < model.predict_s(above)
    assert model.prefill_tokens_within(0.01, 4, 2000) == 0  # the decodes alone take longer


def test_converges_to_the_tpot_target() -> None:
    controller = BatchController(SchedulerConfig(target_tpot_ms=150, max_num_batched_tokens=4096))
    trace = simulate(controller, lambda s, i: true_cost(s), 40)
    late = [step_s for _, step_s in trace[10:]]
    assert all(0.8 * 0.150 <= t <= 1.2 * 0.150 for t in late), late
    assert trace[-1][0].reason == "tpot"


def test_hysteresis_holds_the_target_when_the_model_is_wrong() -> None:
    class Frozen(StepCostModel):
        def observe(self, shape: StepShape, step_s: float) -> None:
            pass  # never learns: only the measured-latency hysteresis can correct it

    # The model believes steps cost 55% of what they do.
    wrong = Frozen(prior_s=tuple(c * 0.55 for c in TRUE))
    controller = BatchController(
        SchedulerConfig(target_tpot_ms=150, max_num_batched_tokens=4096), model=wrong
    )
    trace = simulate(controller, lambda s, i: true_cost(s), 80)
    assert trace[0][1] > 1.5 * 0.150  # it starts far over the target
    late = [step_s for _, step_s in trace[40:]]
    assert all(t <= 1.2 * 0.150 for t in late), late
    assert controller.headroom < 1.0


def test_reconverges_within_20_steps_after_a_cost_shift() -> None:
    controller = BatchController(SchedulerConfig(target_tpot_ms=150, max_num_batched_tokens=4096))
    shift_at = 60  # a second process takes half the CPU: every step costs 1.6x from here

    def cost(shape: StepShape, i: int) -> float:
        return true_cost(shape) * (1.6 if i >= shift_at else 1.0)

    trace = simulate(controller, cost, shift_at + 60)
    assert all(t <= 1.2 * 0.150 for _, t in trace[20:shift_at])
    after = [t for _, t in trace[shift_at + 20 :]]
    assert all(0.8 * 0.150 <= t <= 1.2 * 0.150 for t in after), after
    # ...and back when the other process leaves.
    trace2 = simulate(controller, lambda s, i: true_cost(s), 60)
    assert all(0.8 * 0.150 <= t <= 1.2 * 0.150 for _, t in trace2[20:])


def test_decisions_are_deterministic() -> None:
    config = SchedulerConfig(target_tpot_ms=100, target_ttft_ms=2000)

    def noisy(shape: StepShape, i: int) -> float:
        return true_cost(shape) * (1.0 + 0.2 * ((i * 7) % 5 - 2) / 2)

    runs = [simulate(BatchController(config), noisy, 50) for _ in range(2)]
    assert runs[0] == runs[1]


def test_seat_cap_follows_decode_cost_within_min_and_max() -> None:
    config = SchedulerConfig(
        target_tpot_ms=100, min_num_seqs=2, max_num_seqs=64, max_num_batched_tokens=4096
    )
    cheap = BatchController(config, model=StepCostModel(prior_s=(0.01, 0.001, 0.0005, 0.0)))
    assert cheap.plan(StepLoad(4, 4000, 4)).max_num_seqs == 64
    costly = BatchController(config, model=StepCostModel(prior_s=(0.01, 0.001, 0.01, 0.0)))
    # (0.100 - 0.010 - 32 * 0.001) / 0.01 = 5.8 seats
    assert costly.plan(StepLoad(4, 4000, 4)).max_num_seqs == 5
    hopeless = BatchController(config, model=StepCostModel(prior_s=(0.2, 0.001, 0.02, 0.0)))
    assert hopeless.plan(StepLoad(4, 4000, 4)).max_num_seqs == 2  # min_num_seqs
    narrow = BatchController(SchedulerConfig(target_tpot_ms=100, max_num_seqs=2))  # min 4 > max
    assert narrow.plan(StepLoad(0, 0, 0)).max_num_seqs == 2
    fixed = BatchController(SchedulerConfig(max_num_seqs=7), on_cpu=False)
    assert fixed.plan(StepLoad(4, 4000, 4)) == StepPlan(1024, 7, 1020, "fixed")


def test_ttft_target_raises_the_prefill_share_only_for_requests_that_can_still_make_it() -> None:
    config = SchedulerConfig(target_tpot_ms=100, target_ttft_ms=1000, max_num_batched_tokens=4096)
    controller = BatchController(config, model=StepCostModel(prior_s=(0.01, 0.001, 0.005, 0.0)))
    calm = controller.plan(StepLoad(2, 200, 2))
    assert calm.reason == "tpot" and calm.prefill_tokens == 80  # (0.1 - 0.01 - 0.01) / 0.001
    # 900 tokens queued, 0.6 s left: 6 steps of 0.1 s need 150 tokens each.
    urgent = controller.plan(StepLoad(2, 200, 2, pending_first_tokens=((0.4, 900),)))
    assert urgent.reason == "ttft" and urgent.prefill_tokens == 150
    # Two in line: the second needs both prompts done in its 0.2 s (2 steps).
    both = controller.plan(StepLoad(2, 200, 2, pending_first_tokens=((0.1, 100), (0.8, 100))))
    assert both.prefill_tokens == 100
    # Past its target already: no raise, TPOT is not spent on a lost cause.
    missed = controller.plan(StepLoad(2, 200, 2, pending_first_tokens=((1.5, 900),)))
    assert missed.reason == "tpot" and missed.prefill_tokens == 80


def test_with_nothing_decoding_the_step_is_not_held_to_the_tpot_target() -> None:
    controller = BatchController(SchedulerConfig(target_tpot_ms=150, max_num_batched_tokens=2048))
    idle = controller.plan(StepLoad(0, 0, 0))
    assert (idle.reason, idle.token_budget, idle.prefill_tokens) == ("no-decodes", 2048, 2048)
    busy = controller.plan(StepLoad(1, 300, 1))
    assert busy.reason == "tpot" and busy.token_budget < 200


def test_decodes_that_banked_slack_allow_a_longer_step() -> None:
    config = SchedulerConfig(target_tpot_ms=100, max_num_batched_tokens=4096)
    model = StepCostModel(prior_s=(0.01, 0.001, 0.005, 0.0))
    controller = BatchController(config, model=model)
    # One request, 20 tokens after its first in 0.4 s (20 ms each), 30 left: its TPOT stays
    # within 100 ms if this step takes up to 0.1 * 28 - 0.4 - 7 * 0.015 = 2.295 s.
    fresh = controller.plan(StepLoad(1, 600, 1, decoding=((20, 0.4, 30),)))
    assert fresh.reason == "tpot-slack" and fresh.planned_s == pytest.approx(2.295)
    assert fresh.prefill_tokens == 2280  # (2.295 - 0.015) / 0.001
    # Two decoders: the one that is behind (its tokens came at 140 ms) decides.
    behind = controller.plan(StepLoad(2, 1200, 2, decoding=((20, 0.4, 30), (20, 2.8, 30))))
    assert behind.reason == "tpot" and behind.planned_s == pytest.approx(0.1)


def test_decodes_bank_slack_instead_of_an_inefficient_chunk() -> None:
    config = SchedulerConfig(target_tpot_ms=100, target_ttft_ms=5000, max_num_batched_tokens=4096)
    model = StepCostModel(prior_s=(0.01, 0.002, 0.005, 0.0))
    controller = BatchController(config, model=model)
    # Slack used up (k=8 tokens in 1.4 s): only (0.1 - 0.02) / 0.002 = 40 tokens fit, below an
    # efficient chunk, and decodes alone take 20 ms: decode only, bank 80 ms.
    tight = StepLoad(2, 1200, 2, decoding=((8, 1.4, 30), (8, 1.4, 30)))
    plan = controller.plan(tight)
    assert (plan.reason, plan.prefill_tokens, plan.token_budget) == ("tpot-bank", 0, 2)
    # Without decoding figures there is no bank to grow: the minimum chunk, as before.
    assert controller.plan(StepLoad(2, 1200, 2)).prefill_tokens == 40
    # A request about to miss its TTFT is not made to wait for the bank.
    urgent = StepLoad(2, 1200, 2, decoding=tight.decoding, pending_first_tokens=((4.5, 300),))
    assert controller.plan(urgent).reason == "ttft"


def test_auto_budget_on_cpu_without_target_and_fixed_elsewhere() -> None:
    model = StepCostModel(prior_s=(0.01, 0.002, 0.005, 0.0))
    controller = BatchController(SchedulerConfig(cpu_budget_step_ms=300), on_cpu=True, model=model)
    auto = controller.plan(StepLoad(2, 100, 2))
    # Two decodes, then the prefill that fits 300 ms: (0.3 - 0.01 - 2 * 0.005) / 0.002.
    assert auto.reason == "auto" and auto.prefill_tokens == 139 and auto.token_budget == 141
    assert auto.max_num_seqs == 32  # no target: the seats stay as configured
    # Nothing decoding: no TPOT to protect, so the prompt prefills in the biggest chunks.
    alone = controller.plan(StepLoad(0, 0, 0))
    assert (alone.reason, alone.token_budget) == ("no-decodes", 1024)
    off = SchedulerConfig(cpu_budget_step_ms=None)
    assert BatchController(off, on_cpu=True).plan(StepLoad(0, 0, 0)).reason == "fixed"
    # The default: the fixed budget, decodes or not
    default = BatchController(SchedulerConfig(), on_cpu=True).plan(StepLoad(2, 100, 2))
    assert (default.reason, default.token_budget) == ("fixed", 1024)
    unchunked = SchedulerConfig(cpu_budget_step_ms=300, enable_chunked_prefill=False)
    assert BatchController(unchunked, on_cpu=True).plan(StepLoad(0, 0, 0)).reason == "fixed"


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(target_tpot_ms=0), r"^target_tpot_ms=0 is invalid: expected a positive number"),
        (dict(target_ttft_ms=float("nan")), r"^target_ttft_ms=nan is invalid"),
        (
            dict(min_num_seqs=0),
            r"^min_num_seqs=0 is invalid: expected an integer >= 1",
        ),
        (dict(cpu_budget_step_ms=-1.0), r"^cpu_budget_step_ms=-1.0 is invalid"),
    ],
)
def test_bad_targets_are_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(**kwargs)  # type: ignore[arg-type]
