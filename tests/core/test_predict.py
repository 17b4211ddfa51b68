"""The predictive move: one jump to the objective's pick, and a verdict that a window contradicting the
prediction is a miss."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtune.core.predict import (
    GOODPUT,
    NO_PREEMPTION,
    Forecast,
    NoForecast,
    Objective,
    judge,
    plan,
    table_lines,
)
from tests.core.workloads import fitted

DEFAULT = fitted()  # the tuner benchmark's default workload: 8 and below clean, 10 and above preempting


def test_no_preemption_jumps_from_a_preempting_start_to_the_measured_edge_in_one_move() -> None:
    result = plan(DEFAULT, current=64, objective=Objective())
    forecast = result.outcome
    assert isinstance(forecast, Forecast)
    assert forecast.objective == NO_PREEMPTION
    assert 7 <= forecast.value <= 9  # the tuner benchmark's sweep-best for this workload is 8
    assert forecast.preemptions_per_min == 0
    assert forecast.current == 64 and forecast.current_preemptions_per_min > 0
    assert "closed loop, 16 clients" in forecast.workload
    values = [p.candidate.max_num_seqs for p in result.table]
    assert values == sorted(values) and all(not p.candidate.fp8 for p in result.table)


def test_bounds_and_rounding_hold_the_pick() -> None:
    capped = plan(DEFAULT, 64, Objective(), low=1, high=6).outcome
    assert isinstance(capped, Forecast) and capped.value == 6
    large = fitted(pool_tokens=16384, in_system=(64,) * 13)  # about 36 such requests fit the pool
    rounded = plan(large, 64, Objective(round_to=8)).outcome
    assert isinstance(rounded, Forecast) and rounded.value % 8 == 0 and rounded.value >= 16
    # at the default pool 16 preempts: no multiple of 16 is safe, and the plan says so
    none = plan(DEFAULT, 64, Objective(round_to=16)).outcome
    assert isinstance(none, NoForecast) and "no candidate" in none.reason


def test_the_risk_margin_covers_the_fits_error_a_small_sample_keeps_more_headroom() -> None:
    few, many = fitted(count=25), fitted(count=3000)
    assert few.footprint_relative_error > 5 * many.footprint_relative_error
    policy = Objective(risk_margin=0.02)
    assert policy.for_fit(many).risk_margin == 0.02  # thousands of requests: the policy's margin holds
    wide = policy.for_fit(few)
    assert wide.risk_margin > 0.02
    assert wide.risk_margin == pytest.approx(2 * few.footprint_relative_error, abs=1e-4)
    assert Objective(risk_margin=0.3).for_fit(few).risk_margin == 0.3  # the policy's is the least
    # the same lengths: the pick from 25 requests is never above the pick from 3,000
    small, large = plan(few, 64, policy).outcome, plan(many, 64, policy).outcome
    assert isinstance(small, Forecast) and isinstance(large, Forecast)
    assert small.value <= large.value
    assert f"margin {wide.risk_margin:.0%}" in small.reason


def test_goodput_takes_the_best_predicted_goodput_within_its_wait_bound() -> None:
    result = plan(DEFAULT, 64, Objective(GOODPUT, p95_wait_bound_s=1000.0))
    forecast = result.outcome
    assert isinstance(forecast, Forecast)
    assert forecast.goodput == max(p.goodput for p in result.table)
    none = plan(DEFAULT, 64, Objective(GOODPUT, p95_wait_bound_s=1e-9)).outcome
    assert isinstance(none, NoForecast) and "p95 queue wait" in none.reason


def test_an_objective_is_checked_when_it_is_stated() -> None:
    with pytest.raises(ValueError, match="objective must be one of"):
        Objective("Throughput")
    with pytest.raises(ValueError, match="p95 latency bound"):
        Objective(GOODPUT)
    with pytest.raises(ValueError, match="round_to"):
        Objective(round_to=0)


def _forecast(rate: float) -> Forecast:
    return Forecast(8, rate, 500.0, 0.1, 64, 40.0, 450.0, NO_PREEMPTION, "test", "w")


def test_the_window_after_a_jump_is_judged_on_zero_versus_nonzero() -> None:
    assert judge(_forecast(0.0), 0, 60) is None
    assert "none predicted" in (judge(_forecast(0.0), 1, 60) or "")
    assert judge(_forecast(1.0), 0, 60) is None  # one expected: an empty window is no evidence
    assert "expected" in (judge(_forecast(6.0), 0, 60) or "")  # six expected and none seen
    assert judge(_forecast(6.0), 9, 60) is None
    assert "expected" in (judge(_forecast(6.0), 30, 60) or "")


@settings(max_examples=40, deadline=None)
@given(rate=st.floats(0, 1000), observed=st.integers(0, 10_000), seconds=st.floats(1, 3600))
def test_a_verdict_never_calls_a_window_that_matches_its_expectation_a_miss(
    rate: float, observed: int, seconds: float
) -> None:
    expected = rate * seconds / 60
    verdict = judge(_forecast(rate), observed, seconds)
    if (expected == 0) == (observed == 0) and observed <= max(3.0, 4 * expected):
        assert verdict is None or (observed == 0 and expected >= 3)
    if expected == 0 and observed > 0:
        assert verdict is not None


def test_the_table_marks_the_picks_and_the_value_in_force() -> None:
    result = plan(DEFAULT, 64, Objective())
    assert isinstance(result.outcome, Forecast)
    pick = result.outcome.value
    lines = table_lines(result.table, pick, {pick: "NoPreemption pick"})
    assert "max_num_seqs" in lines[0]
    marked = [line for line in lines if "NoPreemption pick" in line]
    assert len(marked) == 1 and "in force" in marked[0]
