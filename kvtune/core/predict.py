"""The tuner's predictive move, pure: from a fitted workload to the one value to jump to, and the verdict on
the evaluation window after the jump.

The tuner used to guess a step and wait a window to see it (eight windows on a workload it had not seen,
issue 28). Here it simulates every candidate over the live workload first (`kvtune.core.whatif`), jumps
straight to the objective's pick, and watches one window: a prediction that the window contradicts on
zero vs nonzero preemptions is a miss. After `MISSES_BEFORE_STEPPING` misses the caller goes back to
measured stepping, because a model wrong twice on this workload is not one to act on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from kvtune.core.objectives import Pick, goodput, no_preemption
from kvtune.core.whatif import (
    DEFAULT_RISK_MARGIN,
    EDGE_SEEDS,
    Candidate,
    Prediction,
    decision_table,
    predictions_for,
    what_if,
)
from kvtune.core.workload_fit import FittedWorkload

NO_PREEMPTION = "NoPreemption"
GOODPUT = "Goodput"
OBJECTIVES = (NO_PREEMPTION, GOODPUT)
MISSES_BEFORE_STEPPING = 2
# NoPreemption's margin covers the fit's error: requests this many standard errors of the fitted mean
# footprint longer than fitted still fit (two: one-sided, about 98% sure)
FIT_SIGMAS = 2.0
# a window expected to hold this many preemptions and holding none contradicts the prediction (the chance
# of none at a Poisson mean of 3 is 5%); fewer expected, an empty window is no evidence either way
EXPECTED_FOR_A_MISS = 3.0
# preemptions beyond this many times the expectation (and beyond EXPECTED_FOR_A_MISS) are a miss too
OVER_FOR_A_MISS = 4.0


@dataclass(frozen=True)
class Objective:
    """What the pick maximises. NoPreemption: the largest value predicted never to preempt, within the risk
    margin. Goodput: the highest predicted goodput whose p95 queue wait stays within the stated bound."""

    name: str = NO_PREEMPTION
    p95_wait_bound_s: float | None = None
    risk_margin: float = DEFAULT_RISK_MARGIN
    round_to: int = 1

    def __post_init__(self) -> None:
        if self.name not in OBJECTIVES:
            raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}, got {self.name!r}")
        if self.name == GOODPUT and (self.p95_wait_bound_s is None or self.p95_wait_bound_s <= 0):
            raise ValueError("the Goodput objective needs a positive p95 latency bound")
        if self.round_to < 1:
            raise ValueError(f"round_to must be at least 1, got {self.round_to}")

    def for_fit(self, fit: FittedWorkload) -> Objective:
        """The objective over this fit: the risk margin grows to cover the fit's error of the mean
        footprint (`FIT_SIGMAS` standard errors), so a pick from a small sample keeps more headroom than one
        from thousands of requests; the policy's margin is the least."""
        margin = max(self.risk_margin, min(0.5, FIT_SIGMAS * fit.footprint_relative_error))
        return self if margin == self.risk_margin else replace(self, risk_margin=round(margin, 4))

    def describe(self) -> str:
        if self.name == GOODPUT:
            return f"Goodput (p95 queue wait ≤ {self.p95_wait_bound_s:g} s)"
        return f"NoPreemption (risk margin {self.risk_margin:.0%})"

    def pick(self, rows: Sequence[Prediction]) -> Pick:
        if self.name == GOODPUT:
            assert self.p95_wait_bound_s is not None
            return goodput(rows, self.p95_wait_bound_s, self.round_to)
        return no_preemption(rows, self.risk_margin, self.round_to)


@dataclass(frozen=True)
class Forecast:
    """A prediction the tuner acts on: the value, what it predicts there and at the value in force, why."""

    value: int
    preemptions_per_min: float
    goodput: float
    p95_wait_s: float
    current: int
    current_preemptions_per_min: float
    current_goodput: float
    objective: str
    reason: str
    workload: str  # the fitted workload in one line

    def describe(self) -> str:
        return (
            f"predicted at {self.value}: {self.preemptions_per_min:.1f} preemptions/min, goodput "
            f"{self.goodput:.0f} tokens/s, p95 queue wait {self.p95_wait_s:.2f} s (at {self.current}: "
            f"{self.current_preemptions_per_min:.1f}/min, {self.current_goodput:.0f} tokens/s); {self.reason}"
        )


@dataclass(frozen=True)
class NoForecast:
    """No value could be predicted: why (an insufficient fit, or no candidate meets the objective)."""

    reason: str


@dataclass(frozen=True)
class Plan:
    """The table the forecast came from (16-bit rows within the bounds), and the forecast or why none."""

    table: tuple[Prediction, ...]
    current: Prediction
    outcome: Forecast | NoForecast
    objective: Objective  # as applied: its risk margin over this fit (`Objective.for_fit`)


def plan(
    fit: FittedWorkload,
    current: int,
    objective: Objective,
    low: int = 1,
    high: int = 1 << 20,
    edge_seeds: int = EDGE_SEEDS,
) -> Plan:
    """Simulate the candidates (multiples of `objective.round_to`, refined to one step at the edge) and pick
    by the objective among values in [low, high]; the value in force is simulated too, for comparison. The
    risk margin is the objective's over this fit (`Objective.for_fit`)."""
    objective = objective.for_fit(fit)
    table = decision_table(
        fit,
        round_to=objective.round_to,
        risk_margin=objective.risk_margin,
        edge_seeds=edge_seeds,
        with_fp8=False,
    )
    rows = tuple(p for p in predictions_for(table, fp8=False) if low <= p.candidate.max_num_seqs <= high)
    known = {p.candidate.max_num_seqs: p for p in predictions_for(table, fp8=False)}
    now = known.get(current) or what_if(fit, [Candidate(current)])[0]
    picked = objective.pick(rows)
    if picked.prediction is None:
        return Plan(rows, now, NoForecast(f"{objective.describe()}: {picked.reason}"), objective)
    p = picked.prediction
    forecast = Forecast(
        value=p.candidate.max_num_seqs,
        preemptions_per_min=p.preemptions_per_min,
        goodput=p.goodput,
        p95_wait_s=p.p95_queue_wait_s,
        current=current,
        current_preemptions_per_min=now.preemptions_per_min,
        current_goodput=now.goodput,
        objective=objective.name,
        reason=picked.reason,
        workload=fit.summary(),
    )
    return Plan(rows, now, forecast, objective)


def judge(forecast: Forecast, observed_preemptions: float, seconds: float) -> str | None:
    """Why the window after the jump contradicts the forecast, or None when it bears it out: preemptions
    where none were predicted; none where at least `EXPECTED_FOR_A_MISS` were expected; or more than
    `OVER_FOR_A_MISS` times the expectation."""
    expected = forecast.preemptions_per_min * seconds / 60
    if expected == 0 and observed_preemptions > 0:
        return (
            f"{observed_preemptions:.0f} preemptions in {seconds:.0f} s at {forecast.value}, none predicted"
        )
    if expected >= EXPECTED_FOR_A_MISS and observed_preemptions == 0:
        return f"no preemption in {seconds:.0f} s at {forecast.value}, {expected:.1f} expected"
    if observed_preemptions > max(EXPECTED_FOR_A_MISS, OVER_FOR_A_MISS * expected):
        return (
            f"{observed_preemptions:.0f} preemptions in {seconds:.0f} s at {forecast.value}, "
            f"{expected:.1f} expected"
        )
    return None


def table_lines(rows: Sequence[Prediction], current: int, marks: dict[int, str]) -> list[str]:
    """The what-if table as text: value, preemptions/min, goodput, p95 queue wait and peak KV share, each
    row marked with what it is (`marks`: the objectives' picks) and the value in force."""
    lines = [
        f"{'max_num_seqs':>12}  {'preemptions/min':>15}  {'goodput tok/s':>13}  {'p95 wait s':>10}  "
        f"{'peak KV':>7}"
    ]
    for p in rows:
        value = p.candidate.max_num_seqs
        notes = [marks[value]] if value in marks else []
        if value == current:
            notes.append("in force")
        lines.append(
            f"{value:>12}  {p.preemptions_per_min:>15.1f}  {p.goodput:>13.0f}  {p.p95_queue_wait_s:>10.2f}  "
            f"{p.peak_kv_usage:>7.0%}" + (f"  <- {', '.join(notes)}" if notes else "")
        )
    return lines
