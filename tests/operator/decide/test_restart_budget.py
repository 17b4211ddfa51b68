"""The restart budget (issue 37): never more than maxRestarts changes that restart the pods in any period,
none outside the maintenance window, a change refused only for one of those reasons, and the first
allowed time said exactly. Checked on the pure budget, then through the loop that applies the tuner's
changes, on an engine that keeps preempting (so the tuner keeps asking for changes)."""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtune.contract.knobs import KNOB_MAX_NUM_SEQS, KNOB_MAX_TOKENS_CAP
from kvtune.operator.decide.loop import step
from kvtune.operator.decide.policy import Mode, TuningPolicy
from kvtune.operator.decide.ports import ActuatorResult
from kvtune.operator.decide.restart_budget import (
    BUDGET_SPENT,
    DAY_S,
    OUTSIDE_WINDOW,
    WITHIN_BUDGET,
    MaintenanceWindow,
    RestartBudget,
    clock_of,
)
from kvtune.operator.decide.sample import Sample, SampleResult
from kvtune.operator.decide.tuner import TunerState
from tests.operator.helpers import synthetic

EPOCH = 1_800_000_000.0  # a time of day like any other: 2027-01-15T08:00:00Z

budgets = st.builds(
    RestartBudget,
    st.integers(1, 4),
    st.integers(1, 3 * DAY_S).map(float),
    st.none()
    | st.tuples(st.integers(0, DAY_S - 60), st.integers(60, DAY_S - 60)).map(
        lambda t: MaintenanceWindow(t[0], (t[0] + t[1]) % DAY_S)
    ),
)
offsets = st.lists(st.integers(0, 4 * DAY_S), min_size=1, max_size=60).map(sorted)


def accepted_times(budget: RestartBudget, attempts: list[float]) -> tuple[list[float], list[float]]:
    """Every attempt made through the budget: the ones it allowed (each then recorded) and those it held."""
    changes: tuple[float, ...] = ()
    allowed, held = [], []
    for at in attempts:
        if budget.verdict(changes, at).allowed:
            allowed.append(at)
            changes = budget.record(changes, at)
        else:
            held.append(at)
    return allowed, held


def most_in_any_period(times: list[float], period: float) -> int:
    """The most of `times` inside one span [t, t + period), over every start t (a span holding the most
    starts at one of the times)."""
    return max((sum(1 for u in times if t <= u < t + period) for t in times), default=0)


@settings(max_examples=300)
@given(budgets, offsets)
def test_never_more_than_max_restarts_in_any_period_and_none_outside_the_window(
    budget: RestartBudget, offsets: list[int]
) -> None:
    allowed, _ = accepted_times(budget, [EPOCH + o for o in offsets])
    assert most_in_any_period(allowed, budget.period_s) <= budget.max_restarts
    if budget.window is not None:
        assert all(budget.window.contains(at) for at in allowed)


@settings(max_examples=300)
@given(budgets, offsets)
def test_a_change_is_held_only_when_the_budget_is_spent_or_the_window_shut(
    budget: RestartBudget, offsets: list[int]
) -> None:
    attempts = [EPOCH + o for o in offsets]
    changes: tuple[float, ...] = ()
    allowed: list[float] = []
    for at in attempts:
        verdict = budget.verdict(changes, at)
        recent = [t for t in allowed if at - budget.period_s < t <= at]
        outside = budget.window is not None and not budget.window.contains(at)
        spent = len(recent) >= budget.max_restarts
        assert verdict.allowed == (not outside and not spent)
        assert verdict.reason == (OUTSIDE_WINDOW if outside else BUDGET_SPENT if spent else WITHIN_BUDGET)
        if verdict.allowed:
            allowed.append(at)
            changes = budget.record(changes, at)
        assert len(changes) <= budget.max_restarts  # status keeps a bounded list


@settings(max_examples=300)
@given(budgets, offsets, st.integers(0, 4 * DAY_S))
def test_the_next_allowed_time_is_the_first_one(
    budget: RestartBudget, offsets: list[int], probe: int
) -> None:
    allowed, _ = accepted_times(budget, [EPOCH + o for o in offsets])
    changes = tuple(allowed)
    now = EPOCH + offsets[-1]
    verdict = budget.verdict(changes, now)
    assert verdict.next_at >= now
    assert budget.verdict(changes, verdict.next_at).allowed
    before = now + probe
    if before < verdict.next_at:
        assert not budget.verdict(changes, before).allowed, (before, verdict)


@settings(max_examples=300)
@given(st.integers(0, DAY_S - 1), st.integers(1, DAY_S - 1), st.integers(0, 3 * DAY_S), st.integers(0, DAY_S))
def test_a_maintenance_window_opens_at_its_start_and_not_before(
    start: int, length: int, at: int, probe: int
) -> None:
    window = MaintenanceWindow(start, (start + length) % DAY_S)
    now = EPOCH + at
    opens = window.opens_after(now)
    assert now <= opens < now + DAY_S and window.contains(opens)
    if opens > now:
        assert opens % DAY_S == start  # it opens at its start, in UTC
        assert not window.contains(min(now + probe, opens - 1))


def test_a_window_over_midnight_and_the_clock_format() -> None:
    night = MaintenanceWindow.of("22:30", "01:15")
    day = EPOCH - EPOCH % DAY_S
    assert night.contains(day + clock_of("23:00")) and night.contains(day + clock_of("00:10"))
    assert not night.contains(day + clock_of("01:15")) and not night.contains(day + clock_of("12:00"))
    assert night.describe() == "22:30-01:15 UTC"
    for bad in ("2:30", "24:00", "12:60", "noon"):
        with pytest.raises(ValueError):
            clock_of(bad)
    with pytest.raises(ValueError):
        MaintenanceWindow.of("02:00", "02:00")


def test_the_verdict_says_when_and_how_much_is_used() -> None:
    budget = RestartBudget(2, DAY_S)
    changes = budget.record(budget.record((), EPOCH), EPOCH + 600)
    held = budget.verdict(changes, EPOCH + 3600)
    assert not held.allowed and held.reason == BUDGET_SPENT and held.next_at == EPOCH + DAY_S
    assert "2 of 2 restarts used in the last 24h" in held.message and "2027-01-16T08:00:00Z" in held.message
    assert budget.verdict(changes, EPOCH + DAY_S).allowed
    clock_back = budget.verdict((EPOCH + 7200,), EPOCH)  # a change stamped after now still counts
    assert clock_back.allowed and budget.describe((EPOCH + 7200,), EPOCH).startswith("1 of 2")


class Engine:
    """A kvtune-like engine whose max_num_seqs only the loop changes; each change is timed."""

    knobs = frozenset({KNOB_MAX_NUM_SEQS})

    def __init__(self) -> None:
        self.values: dict[str, int | None] = {KNOB_MAX_NUM_SEQS: 256, KNOB_MAX_TOKENS_CAP: None}
        self.now = 0.0
        self.changed_at: list[float] = []

    def current(self) -> ActuatorResult:
        return ActuatorResult(True, dict(self.values))

    def apply(self, knob: str, value: int | str | None, cause: str = "") -> ActuatorResult:
        assert isinstance(value, int)
        self.values[knob] = value
        self.changed_at.append(self.now)
        return ActuatorResult(True, dict(self.values))


class Preempting:
    """An engine under pressure whatever its max_num_seqs: the tuner keeps lowering it."""

    def __init__(self) -> None:
        self.now = 0.0

    def read(self) -> SampleResult:
        t = self.now
        return synthetic(t, preemptions=2 * t, generated=300 * t, kv=0.97, running=12, waiting=4)


@settings(max_examples=25)
@given(
    st.integers(1, 3),
    st.integers(5, 60).map(float),
    st.lists(st.tuples(st.sampled_from([0.5, 1.0, 2.0, 5.0]), st.booleans()), min_size=40, max_size=120),
)
def test_the_loop_never_makes_more_restarting_changes_than_the_budget_allows(
    max_restarts: int, period: float, ticks: list[tuple[float, bool]]
) -> None:
    """Tuning moves and re-applies both count: at random ticks someone else puts the flag back (a GitOps
    sync), and the loop wants to put its value back each time."""
    budget = RestartBudget(max_restarts, period)
    policy = TuningPolicy(mode=Mode.APPLY, evaluation_window_s=2.0, cooldown_s=0.0, restart_budget=budget)
    engine, source = Engine(), Preempting()
    state, samples = TunerState(), deque[Sample](maxlen=40)
    now = EPOCH
    for gap, reverted in ticks:
        now += gap
        engine.now = source.now = now
        if reverted:
            engine.values[KNOB_MAX_NUM_SEQS] = 256
        tick = step(source, engine, policy, state, samples, now)
        state = tick.state
        if tick.held is not None:
            assert tick.held.verdict.reason == BUDGET_SPENT and "max_num_seqs" in tick.held.what
    assert engine.changed_at, "the pressure makes the tuner act"
    assert most_in_any_period(engine.changed_at, period) <= max_restarts
    assert set(state.restarts) <= set(engine.changed_at)


def test_a_held_change_is_made_once_the_budget_allows_it() -> None:
    budget = RestartBudget(1, 60.0)
    policy = TuningPolicy(mode=Mode.APPLY, evaluation_window_s=2.0, cooldown_s=0.0, restart_budget=budget)
    engine, source = Engine(), Preempting()
    state, samples = TunerState(), deque[Sample](maxlen=40)
    ticks = []
    for second in range(1, 90):
        engine.now = source.now = EPOCH + second
        ticks.append(step(source, engine, policy, state, samples, EPOCH + second))
        state = ticks[-1].state
    first, second_change = engine.changed_at[:2]
    assert second_change == first + 60.0  # held until the first change left the period, then made
    held = [t for t in ticks if t.held is not None and t.at < second_change]
    assert held and all(t.at > first for t in held)  # held after the first change, until it aged out
    assert held[0].held is not None and held[0].held.verdict.next_at == second_change
    assert "the next change at 2027-01-15T08:01:" in held[0].held.verdict.message


def test_without_a_budget_and_for_live_knobs_nothing_is_held_or_counted() -> None:
    policy = TuningPolicy(mode=Mode.APPLY, evaluation_window_s=2.0, cooldown_s=0.0)
    engine, source = Engine(), Preempting()
    state, samples = TunerState(), deque[Sample](maxlen=40)
    for second in range(1, 40):
        engine.now = source.now = EPOCH + second
        tick = step(source, engine, policy, state, samples, EPOCH + second)
        state = tick.state
        assert tick.held is None
    assert len(engine.changed_at) >= 2 and state.restarts == ()
