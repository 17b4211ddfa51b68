"""The bench's three signals as KEDA triggers, and the figures of a run's timeline."""

from __future__ import annotations

import pytest

from kvtune.bench.autoscale_signals import KV_USAGE, KVTUNE, WAITING_QUEUE, Point, figures, signals, table


def test_each_signal_asks_keda_for_ceil_value_over_threshold() -> None:
    found = signals("inference", "llama", "llama-.*")
    assert found[KVTUNE].replicas_for(3.0) == 3
    assert found[WAITING_QUEUE].replicas_for(11.0) == 3  # production-stack's threshold 5
    assert found[KV_USAGE].replicas_for(0.95) == 4  # 0.3 per replica
    assert found[WAITING_QUEUE].replicas_for(0.0) == 1
    trigger = found[KVTUNE].trigger("http://prometheus:9090")
    assert trigger["metricType"] == "AverageValue"
    metadata = trigger["metadata"]
    assert (
        isinstance(metadata, dict)
        and metadata["threshold"] == "1"
        and metadata["ignoreNullValues"] == "false"
    )
    assert 'policy="llama"' in metadata["query"] and metadata["query"].startswith("max(")


def test_a_run_s_figures_from_its_timeline() -> None:
    points = [Point(0, 0, 1, 0), Point(10, 1, 1, 0), Point(20, 1, 3, 2), Point(30, 1, 2, 2),
              Point(40, 1, 3, 3), Point(50, 2, 3, 3), Point(60, 2, 1, 3)]  # fmt: skip
    run = figures("waiting-queue", points, (0.1, 4.0, None))
    assert run.replicas_over_time == ((0.0, 1), (20.0, 3), (30.0, 2), (40.0, 3), (60.0, 1))
    assert run.preemptions == 3 and run.queue_wait_p95_s == (0.1, 4.0, None)
    assert run.replica_seconds == 1 * 10 + 1 * 10 + 3 * 10 + 2 * 10 + 3 * 10 + 3 * 10
    assert run.direction_changes == (0, 2, 0)  # step 1 went up, down, up: two reversals
    assert table([run])[2].startswith("| waiting-queue | 0: 1, 20: 3")
    assert "| 0.10 s / 4.00 s / n/a |" in table([run])[2]
    with pytest.raises(ValueError):
        figures("kvtune", [], ())
