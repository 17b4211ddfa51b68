"""The tuner's predicted move on synthetic windows: one jump to the what-if pick, one window to verify it,
a refit after a miss, measured stepping after two, and a recommendation (not a change) in Recommend mode.
Time is explicit, so every case is exact."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvtune.contract.knobs import KNOB_MAX_NUM_SEQS
from kvtune.core.predict import MISSES_BEFORE_STEPPING, NoForecast
from kvtune.operator.decide import tuner as tuner_module
from kvtune.operator.decide.ladder import Remedy
from kvtune.operator.decide.policy import Mode, TuningPolicy
from kvtune.operator.decide.sample import Sample
from kvtune.operator.decide.tuner import TunerState, decide
from kvtune.operator.decide.window import Window
from tests.operator.predicted_world import engine, sample

POLICY = TuningPolicy(mode=Mode.APPLY, evaluation_window_s=4, cooldown_s=4, predict=True)


def preempting(t0: int, t1: int, base: float = 0.0) -> list[Sample]:
    return [sample(t, preemptions=base + 3 * (t - t0)) for t in range(t0, t1 + 1)]


def jumped() -> tuple[int, TunerState]:
    """From 64, preempting, to the predicted value in one move."""
    decision, state = decide(Window.of(preempting(0, 5)), engine(64), POLICY, TunerState(), 5)
    assert [(c.knob, c.before) for c in decision.changes] == [(KNOB_MAX_NUM_SEQS, 64)]
    change = decision.changes[0]
    assert change.remedy is Remedy.PREDICT_MAX_NUM_SEQS
    assert isinstance(change.value, int)
    return change.value, state


def test_a_preempting_engine_is_moved_to_the_predicted_value_in_one_move() -> None:
    value, state = jumped()
    forecast = state.prediction.forecast
    assert forecast is not None and forecast.value == value and forecast.preemptions_per_min == 0
    assert 8 <= value < 24  # below the clients, about what the pool holds at full length
    assert forecast.current == 64 and forecast.current_preemptions_per_min > 0
    assert state.pending is not None and state.pending.direction == "predict"
    entry = state.history[-1]
    assert entry.kind == "applied" and entry.remedy is Remedy.PREDICT_MAX_NUM_SEQS
    assert "closed loop, 24 clients" in entry.evidence and "since it started" in entry.evidence
    assert state.unsafe_max_num_seqs == 64  # it preempted there


def test_a_short_window_is_gathered_first_not_stepped_by_the_ladder() -> None:
    decision, _ = decide(Window.of(preempting(0, 2)), engine(64), POLICY, TunerState(), 2)
    assert decision.changes == () and "gathering a window to fit the workload" in decision.note


def test_a_window_that_bears_the_forecast_out_holds_it_and_the_ladder_leaves_the_value_alone() -> None:
    value, state = jumped()
    # a lowering is judged on the evaluation window after the drain's (held at 6, judged on 10-14)
    calm = [sample(t, preemptions=15, running=value, waiting=24 - value) for t in range(6, 15)]
    early, _ = decide(Window.of([*preempting(0, 5), *calm[:6]]), engine(value), POLICY, state, 11)
    assert early.changes == () and early.note == "evaluating the last change"
    decision, state = decide(Window.of([*preempting(0, 5), *calm]), engine(value), POLICY, state, 14)
    assert decision.changes == ()
    assert state.prediction.verdict is not None and state.prediction.verdict.startswith("held")
    applied = [h for h in state.history if h.remedy is Remedy.PREDICT_MAX_NUM_SEQS]
    assert len(applied) == 1 and applied[0].after_figures is not None
    later = [sample(t, preemptions=15, running=value, waiting=24 - value) for t in range(15, 30)]
    decision, state = decide(Window.of([*calm, *later]), engine(value), POLICY, state, 29)
    assert decision.changes == () and "holding the predicted max_num_seqs" in decision.note


def test_two_misses_fall_back_to_measured_stepping_and_say_so() -> None:
    value, state = jumped()
    # preemptions at the predicted value: a miss; the value is unsafe and the refit goes below it
    # (a lowering that preempts in its first window is judged a window later: the old value's backlog)
    worse = [sample(t, preemptions=15 + 2 * (t - 6), running=value, waiting=24 - value) for t in range(6, 16)]
    decision, state = decide(Window.of([*preempting(0, 5), *worse]), engine(value), POLICY, state, 15)
    assert state.prediction.misses == 1 and "missed (1 of 2)" in (state.prediction.verdict or "")
    assert state.unsafe_max_num_seqs == value
    assert [c.remedy for c in decision.changes] == [Remedy.PREDICT_MAX_NUM_SEQS]
    second = decision.changes[0].value
    assert isinstance(second, int) and second < value
    again = [sample(t, preemptions=40 + 2 * (t - 16), running=second, waiting=24 - second)
             for t in range(16, 26)]  # fmt: skip
    decision, state = decide(Window.of([*worse, *again]), engine(second), POLICY, state, 25)
    assert state.prediction.misses == MISSES_BEFORE_STEPPING and state.prediction.stepping
    assert "falling back to measured stepping" in (state.prediction.verdict or "")
    # measured stepping from here: the ladder's own rung acts
    assert all(c.remedy is not Remedy.PREDICT_MAX_NUM_SEQS for c in decision.changes)


def test_recommend_mode_recommends_the_predicted_value_without_changing_it() -> None:
    policy = replace(POLICY, mode=Mode.RECOMMEND)
    decision, state = decide(Window.of(preempting(0, 5)), engine(64), policy, TunerState(), 5)
    assert decision.changes == ()
    assert [a.remedy for a in decision.advice] == [Remedy.PREDICT_MAX_NUM_SEQS]
    assert state.history[-1].kind == "recommended"


def test_an_engine_without_a_known_pool_is_stepped_by_measurement_at_once() -> None:
    blind = replace(engine(64), pool_tokens=None)
    decision, state = decide(Window.of(preempting(0, 2)), blind, POLICY, TunerState(), 2)
    assert decision.changes and all(c.remedy is not Remedy.PREDICT_MAX_NUM_SEQS for c in decision.changes)
    assert "no prediction" in (state.prediction.verdict or "")


def test_a_predicted_lowering_is_not_judged_on_its_drain() -> None:
    """The old value's residents drain slowly (the tuner benchmark's random-28-3: over three windows);
    their preemptions are not the predicted value's, so the verdict waits for the limit to hold."""
    value, state = jumped()
    assert state.pending is not None  # the jump's own sample (t=5, 16 running) is not the new limit holding
    state = replace(state, pending=replace(state.pending, at=5.5))
    draining = [sample(t, preemptions=15 + 2 * (t - 6), running=value + 4, waiting=20 - value)
                for t in range(6, 20)]  # fmt: skip
    decision, state = decide(Window.of([*preempting(0, 5), *draining]), engine(value), POLICY, state, 19)
    assert decision.changes == () and "settle" in decision.note
    assert state.prediction.misses == 0 and state.pending is not None


def test_a_recommendation_nobody_applied_is_planned_once_a_window_not_every_tick(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each plan is a what-if simulation: a fleet of Recommend policies re-planned it every tick (issue 38).
    The plan stands for a window (stretched by up to half of one), re-said meanwhile; then it is planned
    again on the window then."""
    policy = replace(POLICY, mode=Mode.RECOMMEND, evaluation_window_s=30)
    planned: list[float] = []
    real_plan = tuner_module.plan

    def counting_plan(*args: object, **kwargs: object) -> object:
        planned.append(1.0)
        return real_plan(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(tuner_module, "plan", counting_plan)
    samples = preempting(0, 80)
    decision, state = decide(Window.of(samples[:6]), engine(64), policy, TunerState(), 5)
    assert [a.remedy for a in decision.advice] == [Remedy.PREDICT_MAX_NUM_SEQS]
    for t in range(6, 35):  # within the window: said again (once in history), never planned again
        decision, state = decide(Window.of(samples[: t + 1]), engine(64), policy, state, t)
        assert decision.changes == () and "predicted max_num_seqs" in decision.note
    assert len(planned) == 1
    assert [e.kind for e in state.history] == ["recommended"]
    for t in range(35, 81):  # a window and a half later at the most: planned again
        decision, state = decide(Window.of(samples[: t + 1]), engine(64), policy, state, t)
    assert len(planned) >= 2
    assert decision.changes == ()


def test_a_plan_that_finds_no_forecast_is_not_run_again_until_the_value_moves_or_a_window_passes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A preempting fleet whose plans keep no candidate re-ran the what-if simulation at every tick, a third
    of a 100-policy operator's CPU (issue 38): the verdict stands while the value in force is the one it
    was planned at, the ladder steps meanwhile, and a moved value plans again at once."""
    planned: list[float] = []
    real_plan = tuner_module.plan

    def finds_nothing(*args: object, **kwargs: object) -> object:
        planned.append(1.0)
        return replace(real_plan(*args, **kwargs), outcome=NoForecast("no candidate kept"))  # type: ignore[arg-type]

    monkeypatch.setattr(tuner_module, "plan", finds_nothing)
    policy = replace(POLICY, mode=Mode.RECOMMEND, evaluation_window_s=30)
    samples = preempting(0, 80)
    decision, state = decide(Window.of(samples[:6]), engine(64), policy, TunerState(), 5)
    assert "no prediction, measured stepping meanwhile: no candidate kept" in (state.prediction.verdict or "")
    for t in range(6, 35):
        decision, state = decide(Window.of(samples[: t + 1]), engine(64), policy, state, t)
        assert "no candidate kept" in (state.prediction.verdict or "") and decision.changes == ()
    assert len(planned) == 1
    _, state = decide(Window.of(samples[:36]), engine(48), policy, state, 35)
    assert len(planned) == 2, "a value in force other than the one planned at is planned again"
    for t in range(36, 81):
        _, state = decide(Window.of(samples[: t + 1]), engine(48), policy, state, t)
    assert len(planned) == 3, "and again once its window (stretched by up to half) has passed"
