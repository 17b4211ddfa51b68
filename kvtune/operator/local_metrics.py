"""The --local loop's edge to the operator's own metrics: each tick is recorded as the in-cluster operator
records a policy's evaluation (namespace "local", the policy named by the target's host:port). Without a
KVTuningPolicy status to carry recommendations and conditions between ticks, a PolicyMemory of its own does.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from kvtune.operator.local import Tick
from kvtune.operator.own_metrics import ERROR_PROXY_METRICS, OperatorMetrics, evaluation_of
from kvtune.operator.policy import TuningPolicy
from kvtune.operator.policy_tick import PolicyMemory, condition_states, follow_tick, recommended_knobs

LOCAL_NAMESPACE = "local"


def local_policy_name(target: str) -> str:
    """The policy label of a --local run: the target URL's host:port (the port its scheme implies if none)."""
    parts = urlsplit(target)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"{parts.hostname}:{port}"


class LocalRecorder:
    """Called with every tick of `run_loop`; records it into `metrics`."""

    def __init__(self, metrics: OperatorMetrics, target: str, policy: TuningPolicy) -> None:
        self.metrics = metrics
        self.policy = policy
        self.name = local_policy_name(target)
        self.memory = PolicyMemory()
        metrics.declare(LOCAL_NAMESPACE, self.name)

    def __call__(self, tick: Tick, proxy_problem: str | None = None) -> None:
        previous = self.memory.state
        self.memory.state = tick.state
        _, conditions = follow_tick(self.memory, tick, self.policy, tick.at)
        errors = (ERROR_PROXY_METRICS,) if proxy_problem else ()
        objective = self.policy.objective if self.policy.predict else None
        evaluation = evaluation_of(previous, tick, condition_states(conditions),
                                   recommended_knobs(self.memory.recommended), errors, objective)  # fmt: skip
        self.metrics.record(LOCAL_NAMESPACE, self.name, evaluation)
