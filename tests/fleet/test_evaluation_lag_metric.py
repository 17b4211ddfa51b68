"""The operator's evaluation lag (`kvtune_operator_evaluation_lag_seconds`, what `kvtune bench fleet`
reports as tick lag): how late each evaluation is recorded after its policy's interval ran out, per policy,
with a failed evaluation breaking the chain rather than counting an interval twice."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvtune.operator.io.own_metrics import Evaluation, OperatorMetrics


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def lag_histogram(metrics: OperatorMetrics) -> tuple[float, float, dict[float, float]]:
    """(count, sum, upper bound -> cumulative count) of the lag histogram."""
    text = generate_latest(metrics.registry).decode()
    (family,) = [
        f for f in text_string_to_metric_families(text) if f.name == "kvtune_operator_evaluation_lag_seconds"
    ]
    count = next(s.value for s in family.samples if s.name.endswith("_count"))
    total = next(s.value for s in family.samples if s.name.endswith("_sum"))
    buckets = {float(s.labels["le"]): s.value for s in family.samples if s.name.endswith("_bucket")}
    return count, total, buckets


def test_each_evaluation_after_the_first_counts_its_lateness_per_policy() -> None:
    clock = Clock()
    metrics = OperatorMetrics(clock=clock)
    metrics.record("ns", "a", Evaluation(at=clock.now, interval_s=15.0))
    metrics.record("ns", "b", Evaluation(at=clock.now, interval_s=5.0))
    assert lag_histogram(metrics)[0] == 0  # a first evaluation has nothing it was due after
    clock.now += 15.5  # a: due at +15, recorded 0.5 s late; b: due at +5, 10.5 s late
    metrics.record("ns", "a", Evaluation(at=clock.now, interval_s=15.0))
    metrics.record("ns", "b", Evaluation(at=clock.now, interval_s=5.0))
    count, total, buckets = lag_histogram(metrics)
    assert count == 2 and total == 11.0
    assert buckets[0.5] == 1 and buckets[10.0] == 1 and buckets[15.0] == 2


def test_a_failed_evaluation_and_a_forgotten_policy_break_the_chain() -> None:
    clock = Clock()
    metrics = OperatorMetrics(clock=clock)
    metrics.record("ns", "a", Evaluation(at=clock.now, interval_s=1.0))
    clock.now += 1.2
    metrics.record_error("ns", "a", "kubernetes")
    clock.now += 1.1
    metrics.record("ns", "a", Evaluation(at=clock.now, interval_s=1.0))  # not 1.3 s late: nothing was due
    assert lag_histogram(metrics)[0] == 0
    metrics.forget("ns", "a")
    clock.now += 60
    metrics.record("ns", "a", Evaluation(at=clock.now, interval_s=1.0))  # created again: a first evaluation
    assert lag_histogram(metrics)[0] == 0
