"""The one measurement and sweep-best rule of the bench (`kvtune.bench.sweep`), with fake engines: a setting that
cannot be applied is never measured, and a sweep none of whose values stays clean goes on below it."""

from __future__ import annotations

import pytest

from kvtune.bench.sweep import (
    ATTEMPTS,
    Sweep,
    Window,
    confirmed_best,
    measure_sweep,
    static_window,
)
from kvtune.errors import KvtuneError
from kvtune.operator.decide.ports import ActuatorResult

CONFIRM_S = 300.0
SHORT_S = 6.0


class FakeEngine:
    """An engine whose admin API fails the first `failures` calls; its windows are made up from the value."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.applied: list[int] = []
        self.measured: list[int] = []

    def apply(self, value: int) -> ActuatorResult:
        self.applied.append(value)
        if len(self.applied) <= self.failures:
            return ActuatorResult(False, {}, "connection refused")
        return ActuatorResult(True, {"max_num_seqs": value})

    def window(self, value: int, seconds: float) -> Window:
        self.measured.append(value)
        return Window(value, seconds, 100.0 * value, 100.0 * value, 0.0)


def test_a_setting_the_engine_never_takes_raises_and_is_never_measured() -> None:
    engine = FakeEngine(failures=ATTEMPTS)
    with pytest.raises(KvtuneError, match="setting max_num_seqs 8 failed 3 times: connection refused"):
        static_window(engine, 8, SHORT_S, settle=0.0)
    assert engine.applied == [8] * ATTEMPTS and engine.measured == []


def test_a_setting_taken_on_a_later_try_is_measured_at_that_value() -> None:
    engine = FakeEngine(failures=ATTEMPTS - 1)
    window = static_window(engine, 8, SHORT_S, settle=0.0)
    assert engine.applied == [8] * ATTEMPTS and engine.measured == [8]
    assert (window.max_num_seqs, window.seconds, window.goodput) == (8, SHORT_S, 800.0)


class Load:
    """A made-up engine under load: goodput grows with the value; a value preempts in its short windows from
    `short_edge` up, and in a long window from `long_edge` up (a marginal value's rare preemptions)."""

    def __init__(self, short_edge: int, long_edge: int) -> None:
        self.short_edge, self.long_edge = short_edge, long_edge
        self.asked: list[tuple[int, float, str]] = []

    def __call__(self, value: int, seconds: float, label: str) -> Window:
        self.asked.append((value, seconds, label))
        edge = self.long_edge if seconds > SHORT_S else self.short_edge
        return Window(value, seconds, 100.0 * value, 100.0 * value, 3.0 if value >= edge else 0.0)


def test_the_sweep_best_is_the_best_clean_value_confirmed_over_the_long_window() -> None:
    load = Load(short_edge=10, long_edge=9)  # 9 looks clean in seconds, preempts over minutes
    sweep = measure_sweep([6, 7, 8, 9, 10], load, SHORT_S)
    assert [v for v, _, _ in load.asked] == [6, 7, 8, 9, 10, 10, 9, 8, 7, 6]  # rising, then falling
    assert sweep.best() == 9
    assert confirmed_best(sweep, load, SHORT_S, CONFIRM_S) == 8
    assert load.asked[10:] == [(9, CONFIRM_S, "confirm"), (8, CONFIRM_S, "confirm")]  # no neighbours asked
    assert sweep.dropped == [(9, 3.0, "its 300 s confirming window")] and not sweep.below


def test_when_every_swept_value_preempts_the_sweep_goes_on_below_it_to_a_clean_value() -> None:
    """The review's new-user run: every value of the sweep 2..10 preempted within its 300 s confirming window,
    and the rule never measured below the sweep, where 1 stayed clean."""
    load = Load(short_edge=11, long_edge=2)
    sweep = measure_sweep(list(range(2, 11)), load, SHORT_S)
    assert confirmed_best(sweep, load, SHORT_S, CONFIRM_S) == 1
    assert [value for value, _, _ in sweep.dropped] == list(range(10, 1, -1))  # each best in turn, dropped
    assert sweep.below == [1]
    assert load.asked[-3:] == [(1, SHORT_S, "below the sweep"), (1, SHORT_S, "below the sweep"),
                               (1, CONFIRM_S, "confirm")]  # fmt: skip
    assert [row.max_num_seqs for row in sweep.rows()] == [*range(2, 11), 1]


def test_the_sweep_goes_down_one_value_at_a_time_and_stops_at_the_first_clean_one() -> None:
    load = Load(short_edge=5, long_edge=4)
    sweep = measure_sweep([8, 10, 12], load, SHORT_S)
    assert confirmed_best(sweep, load, SHORT_S, CONFIRM_S) == 3
    assert sweep.below == [7, 6, 5, 4, 3]
    assert sweep.dropped == [(4, 3.0, "its 300 s confirming window")]  # 4 looked clean in seconds
    assert sweep.confirmed.keys() == {4, 3}


def test_no_sweep_best_only_when_even_1_preempts() -> None:
    load = Load(short_edge=1, long_edge=1)
    sweep = measure_sweep([2, 4], load, SHORT_S)
    assert confirmed_best(sweep, load, SHORT_S, CONFIRM_S) is None
    assert sweep.below == [1] and not sweep.confirmed


def test_without_a_confirming_window_the_sweep_best_is_read_off_the_passes() -> None:
    load = Load(short_edge=9, long_edge=1)
    sweep = measure_sweep([6, 8, 10], load, SHORT_S)
    assert confirmed_best(sweep, load, SHORT_S, 0.0) == 8
    assert all(seconds == SHORT_S for _, seconds, _ in load.asked)


def test_windows_after_the_sweep_that_see_a_preemption_drop_the_value() -> None:
    sweep = Sweep(passes={v: [Window(v, SHORT_S, 100.0 * v, 100.0 * v, 0.0)] * 2 for v in (4, 5)})
    assert sweep.best() == 5
    sweep.add_later(
        5, [Window(5, SHORT_S, 500.0, 500.0, 0.0), Window(5, SHORT_S, 500.0, 500.0, 2.0)], "its rounds"
    )
    assert not sweep.clean(5) and sweep.best() == 4
    assert sweep.dropped == [(5, 2.0, "its rounds")]
    sweep.add_later(5, [Window(5, SHORT_S, 500.0, 500.0, 1.0)], "its rounds")  # dropped once
    assert len(sweep.dropped) == 1
