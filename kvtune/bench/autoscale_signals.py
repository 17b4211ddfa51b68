"""The three replica signals `kvtune bench autoscale` compares through the same KEDA, and the figures of one
run, pure: what a signal asks KEDA for, and what a timeline of replicas and engine counters comes to.

- kvtune: the operator's `kvtune_operator_desired_replicas`, threshold 1 (the value is the count);
- production-stack's default: its chart's ScaledObject on `vllm:num_requests_waiting`, threshold 5
  (helm/values.yaml, `servingEngineSpec.modelSpec[].keda`, at a6c01db), summed over the pods so one series
  comes back;
- KV usage, as AIBrix's examples scale: `gpu_cache_usage_perc` averaged over the pods at 0.3 (KPA example),
  i.e. the pods' sum over 0.3 per replica.

KEDA's Prometheus trigger with metricType AverageValue asks the HPA for ceil(value / threshold) replicas.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

KVTUNE = "kvtune"
WAITING_QUEUE = "waiting-queue"
KV_USAGE = "kv-usage"


@dataclass(frozen=True)
class Signal:
    """One autoscaling signal as a KEDA Prometheus trigger."""

    name: str
    query: str
    threshold: float
    source: str  # where its shape and threshold come from

    def trigger(self, prometheus: str) -> dict[str, object]:
        return {
            "type": "prometheus",
            "metricType": "AverageValue",
            "metadata": {
                "serverAddress": prometheus,
                "query": self.query,
                "threshold": f"{self.threshold:g}",
                "ignoreNullValues": "false",
            },
        }

    def replicas_for(self, value: float) -> int:
        """What the HPA asks for at this value (before its bounds and its 10% tolerance)."""
        return max(1, math.ceil(value / self.threshold - 1e-9))


def signals(namespace: str, policy: str, pods: str) -> dict[str, Signal]:
    """The three signals for a policy's workload whose pods match the regex `pods`."""
    where = f'namespace="{namespace}",pod=~"{pods}"'
    return {
        KVTUNE: Signal(KVTUNE, f'max(kvtune_operator_desired_replicas{{namespace="{namespace}",policy="{policy}"}})',
                       1.0, "kvtune's replica signal"),
        WAITING_QUEUE: Signal(WAITING_QUEUE, f"sum(vllm:num_requests_waiting{{{where}}})", 5.0,
                              "production-stack's chart default (threshold 5)"),
        KV_USAGE: Signal(KV_USAGE, f"sum(vllm:kv_cache_usage_perc{{{where}}})", 0.3,
                         "AIBrix's KPA example (gpu_cache_usage_perc, target 0.3 per pod)"),
    }  # fmt: skip


@dataclass(frozen=True)
class Point:
    """One look at the run: the load step in force, the Deployment's replicas, and the engines' counters
    summed over the pods that existed then (a pod that went keeps its last figures in the sums)."""

    at: float
    step: int
    replicas: int
    preemptions: float


@dataclass(frozen=True)
class RunFigures:
    signal: str
    replicas_over_time: tuple[tuple[float, int], ...]  # (seconds from the start, replicas) at each change
    preemptions: float
    queue_wait_p95_s: tuple[float | None, ...]  # per load step: its requests' p95 wait (None: no request)
    replica_seconds: float
    direction_changes: tuple[int, ...]  # per load step


def replica_seconds(points: Sequence[Point]) -> float:
    """Replicas integrated over time (each count held until the next point)."""
    return sum(a.replicas * (b.at - a.at) for a, b in itertools.pairwise(points))


def direction_changes(points: Sequence[Point]) -> tuple[int, ...]:
    """Per load step: how often the replica count reversed its direction (up then down, or down then up)
    within the step; a step's first move is not a change."""
    steps = sorted({p.step for p in points})
    out = []
    for step in steps:
        counts = [p.replicas for p in points if p.step == step]
        moves = [b - a for a, b in itertools.pairwise(counts) if b != a]
        out.append(sum(1 for a, b in itertools.pairwise(moves) if (a > 0) != (b > 0)))
    return tuple(out)


def figures(signal: str, points: Sequence[Point], step_waits: Sequence[float | None]) -> RunFigures:
    """A run's figures from its timeline and each load step's p95 queue wait."""
    if not points:
        raise ValueError("a run without a single point has no figures")
    start = points[0].at
    changes = [(0.0, points[0].replicas)]
    for p in points[1:]:
        if p.replicas != changes[-1][1]:
            changes.append((round(p.at - start, 1), p.replicas))
    return RunFigures(
        signal, tuple(changes), points[-1].preemptions - points[0].preemptions, tuple(step_waits),
        replica_seconds(points), direction_changes(points),
    )  # fmt: skip


def table(runs: Sequence[RunFigures]) -> list[str]:
    """The side-by-side table BENCHMARKS.md records."""
    lines = ["| signal | replicas over time (s: count) | preemptions | p95 queue wait per step | replica-seconds | "
             "direction changes per step |", "|---|---|---:|---|---:|---|"]  # fmt: skip
    for run in runs:
        timeline = ", ".join(f"{at:g}: {count}" for at, count in run.replicas_over_time)
        wait = " / ".join("n/a" if w is None else f"{w:.2f} s" for w in run.queue_wait_p95_s)
        steps = ", ".join(str(n) for n in run.direction_changes)
        lines.append(f"| {run.signal} | {timeline} | {run.preemptions:.0f} | {wait} | {run.replica_seconds:.0f} | "
                     f"{steps} |")  # fmt: skip
    return lines
