"""StepCostModel: step time predicted from a step's shape, fitted online to the steps this engine ran."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

# Coefficient names, in the order of StepShape.features(): what each one second-count multiplies.
TERMS = ("base", "per_prefill_token", "per_decode_seq", "per_1k_attended_keys")
# Before any step is measured: the bundled Gemma 3 270M on a 2-core AVX2 CPU (a decode step of one
# sequence ~23 ms, a 512-token prefill ~0.85 s). Only the first steps see these; a GPU or another
# model replaces them within a few steps.
PRIOR_S = (0.015, 0.0015, 0.004, 0.0005)
# How much a prior coefficient weighs in the fit, in steps of typical size (ridge regression):
# enough to keep terms the recent steps do not vary (all decode-only, say) near the prior.
PRIOR_WEIGHT_STEPS = 0.1
# The typical size of each feature, which puts the prior's weight on the features' own scale.
_TYPICAL = (1.0, 256.0, 8.0, 64.0)
_UNBOUNDED = 1 << 30  # "no limit from time": the token ceiling decides
# A measured step enters the fit clipped to [prediction / CLIP, prediction x CLIP]: one step
# stalled by a page fault, a first-call compile or a descheduled thread must not drag every
# coefficient with it, while a real shift (another process taking half the CPU) still moves the
# fit within a step or two, and a prior that is far off (a GPU) is left in a few steps.
OUTLIER_CLIP = 4.0


@dataclass(frozen=True, slots=True)
class StepShape:
    """What a step computes, in the units the cost model fits."""

    num_prefill_tokens: int  # tokens of prefill chunks (not decodes)
    # Sequences computing one token from existing KV, plus the draft tokens they check (a draft
    # row costs what a decode row does: the model, the LM head, the sampler).
    num_decode_seqs: int
    attended_keys: int  # sum over every computed query of the keys it attends to

    def features(self) -> tuple[float, float, float, float]:
        p, d = float(self.num_prefill_tokens), float(self.num_decode_seqs)
        return (1.0, p, d, self.attended_keys / 1000)


def chunk_attended_keys(start: int, num_tokens: int) -> int:
    """Keys attended by queries start .. start + num_tokens - 1 under a causal mask.

    Query at position q attends q + 1 keys, so the chunk attends
        sum_{q=start}^{start+n-1} (q + 1) = n * start + n * (n + 1) / 2
    (sliding-window layers attend fewer; the fit absorbs that into the coefficient).
    """
    return num_tokens * start + num_tokens * (num_tokens + 1) // 2


class StepCostModel:
    """Least squares over a sliding window of recent steps, newer steps weighing more.

        step_s ~= base + per_prefill_token * P + per_decode_seq * D + per_1k_attended_keys * A/1000

    Each step's weight is decay ** age (age 0 for the newest), so after a shift in step cost
    (another process on the CPU) the new steps outweigh the old ones within a few steps; a ridge
    term pulls each coefficient toward the prior so a window that never varies a feature still
    gives that feature a sane cost. Coefficients are kept >= 0 (a negative cost per token would
    make "more tokens" look free). Deterministic: the same observations give the same fit.
    """

    def __init__(
        self,
        prior_s: tuple[float, float, float, float] = PRIOR_S,
        window: int = 64,
        decay: float = 0.9,
    ) -> None:
        if window < 1 or not 0.0 < decay <= 1.0:
            raise ValueError(f"window={window}, decay={decay} is invalid: expected >= 1 and (0, 1]")
        self.prior_s = prior_s
        self.decay = decay
        self._steps: deque[tuple[tuple[float, ...], float]] = deque(maxlen=window)
        # The window's weighted normal equations (X^T W X, X^T W y), updated step by step and
        # recomputed exactly once a window so that rounding cannot add up: refitting from the
        # whole window every step cost ~0.15 ms of a ~7 ms single-stream decode step.
        self._ata, self._aty = self._normal_equations()
        self._updates = 0
        self.coefficients: tuple[float, ...] = prior_s
        self.num_observed = 0

    def observe(self, shape: StepShape, step_s: float) -> None:
        """Add one measured step and refit (a 4x4 solve: microseconds)."""
        if not (step_s >= 0.0 and math.isfinite(step_s)):
            return  # a clock glitch must not poison the fit
        predicted_s = self.predict_s(shape)
        if predicted_s > 0:
            step_s = min(max(step_s, predicted_s / OUTLIER_CLIP), predicted_s * OUTLIER_CLIP)
        self._add(shape.features(), step_s)
        self.num_observed += 1
        self.coefficients = self._fit()

    def predict_s(self, shape: StepShape) -> float:
        return sum(c * x for c, x in zip(self.coefficients, shape.features()))

    def prefill_tokens_within(
        self, seconds: float, num_decode_seqs: int, decode_keys: int, prefix_tokens: int = 0
    ) -> int:
        """The most prefill tokens a step with these decodes can add and stay within `seconds`.

        A chunk of n tokens after `prefix_tokens` cached ones attends n * prefix + n^2 / 2 keys
        (chunk_attended_keys), so the cost is quadratic in n: solve a n^2 + b n + c <= 0.
        """
        base = self.predict_s(StepShape(0, num_decode_seqs, decode_keys))
        room = seconds - base
        per_token = self.coefficients[1] + self.coefficients[3] * (prefix_tokens + 0.5) / 1000
        quad = self.coefficients[3] / 2000
        if room <= 0:
            return 0
        if quad <= 0:
            return _UNBOUNDED if per_token <= 0 else min(_UNBOUNDED, int(room / per_token))
        return int((-per_token + math.sqrt(per_token * per_token + 4 * quad * room)) / (2 * quad))

    # ---- the fit ------------------------------------------------------------------------------

    def _add(self, x: tuple[float, ...], y: float) -> None:
        """Append a step to the window: every weight times decay, the new step's 1, and the
        step that leaves the window (its weight then decay ** window) taken out."""
        steps = self._steps
        leaving = steps[0] if len(steps) == steps.maxlen else None
        steps.append((x, y))
        self._updates += 1
        if self._updates >= len(steps):
            self._ata, self._aty = self._normal_equations()
            self._updates = 0
            return
        d = self.decay
        ata, aty = self._ata, self._aty
        for i, xi in enumerate(x):
            row = ata[i]
            for j, xj in enumerate(x):
                row[j] = d * row[j] + xi * xj
            aty[i] = d * aty[i] + xi * y
        if leaving is not None:
            (xo, yo), gone = leaving, d ** len(steps)
            for i, xi in enumerate(xo):
                row = ata[i]
                for j, xj in enumerate(xo):
                    row[j] -= gone * xi * xj
                aty[i] -= gone * xi * yo

    def _fit(self) -> tuple[float, ...]:
        n = len(TERMS)
        active = list(range(n))
        while True:
            coef = self._solve(active)
            negative = [i for i in active if coef[i] < 0]
            if not negative:
                return tuple(coef)
            # Drop the most negative term (cost 0) and refit the rest: a tiny active-set NNLS.
            active.remove(min(negative, key=lambda i: coef[i]))

    def _normal_equations(self) -> tuple[list[list[float]], list[float]]:
        """Weighted X^T X and X^T y over the window, newest step weight 1, from scratch."""
        n = len(TERMS)
        ata = [[0.0] * n for _ in range(n)]
        aty = [0.0] * n
        w = 1.0
        for x, y in reversed(self._steps):  # newest first
            for i, xi in enumerate(x):
                row = ata[i]
                for j, xj in enumerate(x):
                    row[j] += w * xi * xj
                aty[i] += w * xi * y
            w *= self.decay
        return ata, aty

    def _solve(self, active: list[int]) -> list[float]:
        """Weighted ridge normal equations over the active terms; inactive terms are 0."""
        ata = [[self._ata[i][j] for j in active] for i in active]
        aty = [self._aty[i] for i in active]
        for a, i in enumerate(active):
            ridge = PRIOR_WEIGHT_STEPS * _TYPICAL[i] ** 2
            ata[a][a] += ridge
            aty[a] += ridge * self.prior_s[i]
        solved = _gauss(ata, aty)
        coef = [0.0] * len(TERMS)
        for a, i in enumerate(active):
            coef[i] = solved[a]
        return coef


def _gauss(a: list[list[float]], b: list[float]) -> list[float]:
    """Solve a x = b (a symmetric positive definite: the ridge term guarantees it)."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x
