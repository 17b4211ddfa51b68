"""`kvtune_operator_recommendation_pending_since_timestamp_seconds` (what KVTuneRecommendationPending reads)
from ticks the pure tuner produced in Recommend mode: it starts when the advice first differs from the
engine's value, keeps its start through later evaluations and evaluations without data, survives an operator
restart through the policy's history, and goes once the engine runs the advised value."""

from __future__ import annotations

from dataclasses import replace

from kvtune.contract.knobs import KNOB_MAX_NUM_SEQS
from kvtune.operator.decide.loop import Tick
from kvtune.operator.decide.policy import Mode
from kvtune.operator.decide.sample import EngineView
from kvtune.operator.decide.tuner import Decision, TunerState
from kvtune.operator.io.own_metrics import Evaluation, OperatorMetrics, evaluation_of
from tests.operator.helpers import kvtune_engine, series_value
from tests.operator.ladder_steps import POLICY, preempting, step
from tests.operator.own_metrics_scrape import scraped

PENDING = "kvtune_operator_recommendation_pending_since_timestamp_seconds"
WHERE = {"namespace": "inference", "policy": "llama"}
RECOMMEND = replace(POLICY, mode=Mode.RECOMMEND)


def recommended_in_recommend_mode() -> tuple[Decision, TunerState, int]:
    """A preempting engine at max_num_seqs 64, a policy in Recommend mode: advice, no change."""
    decision, state = step(preempting(0, 10), kvtune_engine(64), TunerState(), 10, RECOMMEND)
    assert decision.changes == ()
    (entry,) = [h for h in state.history if h.knob == KNOB_MAX_NUM_SEQS]
    assert entry.kind == "recommended" and isinstance(entry.after, int) and entry.after < 64
    return decision, state, entry.after


def evaluation(
    decision: Decision, state: TunerState, at: float, engine: EngineView, value: int
) -> Evaluation:
    tick = Tick(at, decision, (), state=state, engine=engine)
    return evaluation_of(state, tick, {}, {KNOB_MAX_NUM_SEQS: value})


def pending(metrics: OperatorMetrics) -> float | None:
    return series_value(scraped(metrics), PENDING, **WHERE, knob=KNOB_MAX_NUM_SEQS)


def test_a_recommendation_nobody_applies_keeps_its_start_until_the_engine_runs_it() -> None:
    decision, state, value = recommended_in_recommend_mode()
    metrics = OperatorMetrics()
    metrics.record("inference", "llama", evaluation(decision, state, 10, kvtune_engine(64), value))
    assert pending(metrics) == 10
    assert series_value(scraped(metrics), PENDING, **WHERE, knob="max_tokens_cap") is None  # advised as is
    metrics.record("inference", "llama", evaluation(decision, state, 3600, kvtune_engine(64), value))
    metrics.record("inference", "llama", Evaluation(at=3700, no_data=True))  # a scrape gap: no decision
    assert pending(metrics) == 10
    metrics.record("inference", "llama", evaluation(decision, state, 3800, kvtune_engine(value), value))
    assert pending(metrics) is None  # applied by someone: nothing pending
    metrics.record("inference", "llama", evaluation(decision, state, 3900, kvtune_engine(64), value))
    assert pending(metrics) == 3900  # put back: a new clock, not the old one


def test_an_operator_restart_takes_the_start_from_the_policys_history() -> None:
    decision, state, value = recommended_in_recommend_mode()
    restarted = OperatorMetrics()  # nothing in memory; the history came back from the policy's status
    restarted.record("inference", "llama", evaluation(decision, state, 2 * 86400, kvtune_engine(64), value))
    assert pending(restarted) == 10
    other = value - 1  # advice that has moved on since that entry: no seed for it
    restarted.forget("inference", "llama")
    restarted.record("inference", "llama", evaluation(decision, state, 2 * 86400, kvtune_engine(64), other))
    assert pending(restarted) == 2 * 86400


def test_forget_drops_the_pending_series() -> None:
    decision, state, value = recommended_in_recommend_mode()
    metrics = OperatorMetrics()
    metrics.record("inference", "llama", evaluation(decision, state, 10, kvtune_engine(64), value))
    metrics.forget("inference", "llama")
    assert pending(metrics) is None
