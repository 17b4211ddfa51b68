"""The --local loop's edge to the operator's own metrics: each tick is recorded as the in-cluster operator
records a policy's evaluation (namespace "local", the policy named by the target's host:port). Without a
KVTuningPolicy status to carry recommendations and conditions between ticks, `LocalStatus` does.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from urllib.parse import urlsplit

from kvtune.operator.decide.loop import Tick
from kvtune.operator.decide.policy import TuningPolicy
from kvtune.operator.decide.status import (
    ConditionState,
    Knobs,
    condition_states,
    recommended_knobs,
    record_tick,
)
from kvtune.operator.decide.tuner import TunerState
from kvtune.operator.io.own_metrics import ERROR_PROXY_METRICS, OperatorMetrics, evaluation_of

LOCAL_NAMESPACE = "local"


def local_policy_name(target: str) -> str:
    """The policy label of a --local run: the target URL's host:port (the port its scheme implies if none)."""
    parts = urlsplit(target)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"{parts.hostname}:{port}"


@dataclass
class LocalStatus:
    """What a KVTuningPolicy's status would hold between ticks: the conditions and the recommendations."""

    conditions: dict[str, ConditionState] = field(default_factory=dict)
    recommended: Knobs | None = None


class LocalRecorder:
    """Called with every tick of `run_loop`; records it into `metrics`."""

    def __init__(
        self, metrics: OperatorMetrics, target: str, policy: TuningPolicy, interval_s: float | None = None
    ) -> None:
        self.metrics = metrics
        self.policy = policy
        self.interval_s = interval_s
        self.name = local_policy_name(target)
        self.memory = LocalStatus()
        self.state = TunerState()  # the tuner's state after the last tick
        metrics.declare(LOCAL_NAMESPACE, self.name)

    def __call__(self, tick: Tick, proxy_problem: str | None = None) -> None:
        previous, self.state = self.state, tick.state
        recorded = record_tick(self.memory.conditions, self.memory.recommended, tick, tick.at)
        self.memory.conditions = {c.type: c for c in recorded.conditions}
        self.memory.recommended = recorded.recommended
        errors = (ERROR_PROXY_METRICS,) if proxy_problem else ()
        objective = self.policy.objective if self.policy.predict else None
        evaluation = evaluation_of(previous, tick, condition_states(recorded.conditions),
                                   recommended_knobs(self.memory.recommended), errors, objective)  # fmt: skip
        self.metrics.record(LOCAL_NAMESPACE, self.name, replace(evaluation, interval_s=self.interval_s))
