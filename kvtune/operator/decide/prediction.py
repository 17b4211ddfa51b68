"""What the tuner remembers of its predictions: the forecast in force, the verdict of the window after it,
the misses, and whether it fell back to measured stepping (the pure logic is `kvtune.core.predict`)."""

from __future__ import annotations

from dataclasses import dataclass

from kvtune.core.predict import MISSES_BEFORE_STEPPING, Forecast, Objective
from kvtune.core.step_time import OperatingPoint
from kvtune.core.workload_fit import FitLimits
from kvtune.operator.decide.policy import TuningPolicy

POINTS_KEPT = 4  # operating points of earlier windows, which pin the step-time split for a refit


@dataclass(frozen=True)
class PredictionState:
    forecast: Forecast | None = None  # acted on (or held, when the value in force is the pick)
    verdict: str | None = None  # what the last window said of it, or why there is none
    misses: int = 0
    stepping: bool = False  # MISSES_BEFORE_STEPPING misses: measured stepping from then on
    points: tuple[OperatingPoint, ...] = ()
    since: float | None = None  # where the forecast's own evidence starts (verified, or held from)
    planned_at: float | None = None  # when the forecast was planned (memory only: a restart plans again)
    planned_for: int | None = None  # the max_num_seqs in force when a plan found nothing to forecast

    def plan_stands(self, now: float, window_s: float) -> bool:
        """Whether a plan nobody applied still stands: for `window_s`, stretched by up to half of it by its
        own time, so a fleet's policies started together spread their re-plans apart."""
        if self.planned_at is None:
            return False
        spread = 1.0 + (int(self.planned_at * 1000) % 500) / 1000
        return now - self.planned_at < window_s * spread

    def with_point(self, point: OperatingPoint) -> tuple[OperatingPoint, ...]:
        return (*self.points, point)[-POINTS_KEPT:]

    def missed(self, why: str) -> PredictionState:
        misses = self.misses + 1
        stepping = misses >= MISSES_BEFORE_STEPPING
        then = "falling back to measured stepping" if stepping else "refitting from what the window showed"
        return PredictionState(
            None, f"missed ({misses} of {MISSES_BEFORE_STEPPING}): {why}; {then}", misses, stepping,
            self.points,
        )  # fmt: skip


def objective_of(policy: TuningPolicy) -> Objective:
    return Objective(policy.objective, policy.p95_wait_bound_s, policy.risk_margin, policy.round_to)


def fit_limits(policy: TuningPolicy) -> FitLimits:
    """A fit may span one evaluation window when that is shorter than the fit's default 5 s."""
    return FitLimits(min_seconds=min(FitLimits.min_seconds, policy.evaluation_window_s))
