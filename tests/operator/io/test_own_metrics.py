"""The operator's metrics from ticks the pure tuner produced (time explicit, so every count is exact): an
action and its rollback, a refused change, and a deleted policy's series dropped while another's stay."""

from __future__ import annotations

from kvtune import __version__
from kvtune.operator.decide.loop import Tick
from kvtune.operator.decide.ports import ActuatorResult
from kvtune.operator.decide.tuner import Decision, TunerState
from kvtune.operator.io.own_metrics import Evaluation, OperatorMetrics, evaluation_of
from tests.operator.helpers import kvtune_engine, series_value, synthetic
from tests.operator.ladder_steps import preempting, step
from tests.operator.own_metrics_scrape import scraped

POLICY = {"namespace": "inference", "policy": "llama"}
LOWER = {**POLICY, "remedy": "lower_max_num_seqs"}
OK = ActuatorResult(True, {}, None)


def tick_of(decision: Decision, state: TunerState, at: float, seqs: int, result: ActuatorResult = OK) -> Tick:
    applied = tuple((change, result) for change in decision.changes)
    return Tick(at, decision, applied, state=state, engine=kvtune_engine(seqs))


def test_an_action_and_its_rollback_are_counted_and_stamped() -> None:
    metrics = OperatorMetrics()
    decision, lowered = step(preempting(0, 10), kvtune_engine(64), TunerState(), 10)
    (change,) = decision.changes
    metrics.record("inference", "llama", evaluation_of(TunerState(), tick_of(decision, lowered, 10, change.value),
                                                       {"Preempting": True}, {}))  # fmt: skip
    worse = [synthetic(10, preemptions=50, generated=5000, kv=1, running=3, waiting=5),
             synthetic(21, preemptions=200, generated=5500, kv=1, running=3, waiting=5),
             synthetic(31, preemptions=350, generated=6000, kv=1, running=3, waiting=5)]  # fmt: skip
    decision, rolled = step(worse, kvtune_engine(3), lowered, 31)
    metrics.record("inference", "llama", evaluation_of(lowered, tick_of(decision, rolled, 31, 64), {}, {}))
    series = scraped(metrics)
    assert series_value(series, "kvtune_operator_actions_total", **LOWER, result="applied") == 1
    assert series_value(series, "kvtune_operator_actions_total", **LOWER, result="rolled_back") == 1
    assert series_value(series, "kvtune_operator_rollbacks_total", **POLICY) == 1
    assert series_value(series, "kvtune_operator_last_action_timestamp_seconds", **LOWER) == 31
    assert series_value(series, "kvtune_operator_knob", **POLICY, knob="max_num_seqs", kind="current") == 64
    assert series_value(series, "kvtune_operator_knob", **POLICY, knob="max_tokens_cap", kind="current") == 0
    assert series_value(series, "kvtune_operator_condition", **POLICY, type="Preempting") is None  # unknown


def test_a_refused_change_is_failed_not_applied() -> None:
    decision, _ = step(preempting(0, 10), kvtune_engine(64), TunerState(), 10)
    refused = ActuatorResult(False, {}, "401 bad token")
    tick = tick_of(decision, TunerState(), 10, 64, refused)  # the loop keeps the old state on a refusal
    evaluation = evaluation_of(TunerState(), tick, {}, {})
    assert evaluation.actions == (("lower_max_num_seqs", "failed"),)
    assert evaluation.errors == ("apply",)


def test_forget_drops_only_the_deleted_policys_series() -> None:
    metrics = OperatorMetrics()
    full = Evaluation(at=5.0, actions=(("cap_max_tokens", "applied"),), current={"max_num_seqs": 8},
                      recommended={"max_num_seqs": 8}, rung=1, conditions={"Stable": True}, ceiling_real=9,
                      ceiling_boot_line=1.5, errors=("apply",), no_data=True)  # fmt: skip
    metrics.record("inference", "llama", full)
    metrics.record("inference", "mistral", full)
    metrics.forget("inference", "llama")
    kept = {dict(labels).get("policy") for _, labels in scraped(metrics)}
    assert kept == {"mistral", None}  # None: kvtune_operator_info, the operator's, stays
    assert series_value(scraped(metrics), "kvtune_operator_info", version=__version__, max_mode="Apply") == 1
    metrics.record("inference", "llama", Evaluation(at=6.0))  # a policy created again starts from zero
    assert series_value(scraped(metrics), "kvtune_operator_errors_total", **POLICY, kind="apply") == 0


def test_a_withdrawn_replica_signal_is_absent_never_zero() -> None:
    metrics = OperatorMetrics()
    metrics.record("inference", "llama", Evaluation(at=1.0, desired_replicas=3, demand_capacity_ratio=2.4))
    series = scraped(metrics)
    assert series_value(series, "kvtune_operator_desired_replicas", **POLICY) == 3
    assert series_value(series, "kvtune_operator_demand_capacity_ratio", **POLICY) == 2.4
    # two autoscalers on the workload: the series goes, so KEDA's trigger errors and the HPA holds
    metrics.record("inference", "llama", Evaluation(at=2.0))
    series = scraped(metrics)
    assert series_value(series, "kvtune_operator_desired_replicas", **POLICY) is None
    assert series_value(series, "kvtune_operator_demand_capacity_ratio", **POLICY) is None
