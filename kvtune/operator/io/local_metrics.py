"""The --local loop's edge to the operator's own metrics and its log: each tick is recorded as the in-cluster
operator records a policy's evaluation (namespace "local", the policy named by the target's host:port), and
each finding is logged once when it starts and once when it ends, in the words of the cluster's Events.
Without a KVTuningPolicy status to carry recommendations and conditions between ticks, a `TickMemory` does.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from urllib.parse import urlsplit

from kvtune.operator.decide.findings import Finding, steady, tick_facts, transitions
from kvtune.operator.decide.loop import Tick
from kvtune.operator.decide.memory import TickMemory
from kvtune.operator.decide.policy import TuningPolicy
from kvtune.operator.decide.status import condition_states, recommended_knobs, record_tick
from kvtune.operator.io.own_metrics import ERROR_PROXY_METRICS, OperatorMetrics, evaluation_of

LOCAL_NAMESPACE = "local"
logger = logging.getLogger("kvtune.operator")


def local_policy_name(target: str) -> str:
    """The policy label of a --local run: the target URL's host:port (the port its scheme implies if none)."""
    parts = urlsplit(target)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"{parts.hostname}:{port}"


def log_finding(finding: Finding) -> None:
    if finding.edge == "ended":
        logger.info("%s", finding.message)
    else:
        logger.warning("%s", finding.message)


class LocalRecorder:
    """Called with every tick of `run_loop`; records it into `metrics` and logs its findings' edges."""

    def __init__(
        self, metrics: OperatorMetrics, target: str, policy: TuningPolicy, interval_s: float | None = None
    ) -> None:
        self.metrics = metrics
        self.policy = policy
        self.interval_s = interval_s
        self.name = local_policy_name(target)
        self.memory = TickMemory()  # the tuner's state, conditions and recommendations after the last tick
        metrics.declare(LOCAL_NAMESPACE, self.name)

    def __call__(self, tick: Tick, proxy_problem: str | None = None) -> list[Finding]:
        memory = self.memory
        previous, memory.state = memory.state, tick.state
        recorded = record_tick(memory.conditions, memory.recommended, tick, tick.at)
        memory.conditions = {c.type: c for c in recorded.conditions}
        memory.recommended = recorded.recommended
        if recorded.current is not None:
            memory.current = recorded.current
        memory.on, findings = transitions(
            memory.on, {"proxy_missing": steady(proxy_problem), **tick_facts(tick)}
        )
        for finding in findings:
            log_finding(finding)
        errors = (ERROR_PROXY_METRICS,) if proxy_problem else ()
        objective = self.policy.objective if self.policy.predict else None
        states, recommended = condition_states(recorded.conditions), recommended_knobs(memory.recommended)
        evaluation = evaluation_of(previous, tick, states, recommended, errors, objective)
        self.metrics.record(LOCAL_NAMESPACE, self.name, replace(evaluation, interval_s=self.interval_s))
        return findings
