"""Kubernetes Events about a KVTuningPolicy (core/v1), posted by the operator for every action,
rollback, recommendation and flag, so `kubectl describe kvtp` tells what changed and why."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from datetime import UTC, datetime

from kvtune.operator.decide.findings import Finding, FindingKind
from kvtune.operator.k8s.crd import GROUP, KIND, VERSION
from kvtune.operator.k8s.kube_api import KubeApi, KubeError

COMPONENT = "kvtune-operator"
MESSAGE_LIMIT = 1024  # the API server truncates longer messages anyway


@dataclass(frozen=True)
class PolicyRef:
    namespace: str
    name: str
    uid: str | None = None


@dataclass(frozen=True)
class EventSpec:
    type: str  # Normal or Warning
    reason: str  # CamelCase, e.g. TuningApplied
    message: str
    action: str = "Evaluate"


@dataclass(frozen=True)
class Posting:
    """How a finding is posted: its start and each change as (type, reason), its end only where `ended`."""

    type: str
    reason: str
    action: str = "Evaluate"
    ended: tuple[str, str] | None = None


# The one table from a finding (`decide.findings`) to its Events; their words are the finding's message.
FINDING_EVENTS: dict[FindingKind, Posting] = {
    "mode_capped": Posting("Warning", "ModeCapped"),
    "actuator_unavailable": Posting("Warning", "ActuatorUnavailable"),
    "pods_disagree": Posting("Warning", "PodsDisagree"),
    "proxy_missing": Posting("Warning", "ProxyMetricsMissing"),
    "alternating": Posting("Warning", "MetricsSourceAlternating", ended=("Normal", "MetricsSourceStable")),
    "no_data": Posting("Warning", "NoMetrics"),
    "corrupt": Posting("Warning", "CorruptMetrics"),
    "change_held": Posting("Normal", "ChangeHeld", "Hold"),
}


def finding_events(findings: list[Finding]) -> list[EventSpec]:
    events: list[EventSpec] = []
    for finding in findings:
        posting = FINDING_EVENTS[finding.kind]
        if finding.edge != "ended":
            events.append(EventSpec(posting.type, posting.reason, finding.message, posting.action))
        elif posting.ended is not None:
            events.append(EventSpec(*posting.ended, finding.message, posting.action))
    return events


def event_name(policy: PolicyRef, now: float) -> str:
    """Named like client-go's recorder (object name + unique suffix): not every server does generateName."""
    return f"{policy.name}.{int(now * 1e9):x}{secrets.token_hex(2)}"


def post_event(
    api: KubeApi, policy: PolicyRef, event: EventSpec, now: float, name: str | None = None
) -> KubeError | None:
    """POST one Event (named `name` when it is posted again); returns the error (logged by the caller) rather
    than raising. An Event of that name already there is one an earlier try posted: it counts as posted."""
    stamp = datetime.fromtimestamp(now, UTC)
    body = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": name or event_name(policy, now), "namespace": policy.namespace},
        "involvedObject": {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": KIND,
            "name": policy.name,
            "namespace": policy.namespace,
            **({"uid": policy.uid} if policy.uid else {}),
        },
        "type": event.type,
        "reason": event.reason,
        "message": event.message[:MESSAGE_LIMIT],
        "action": event.action,
        "source": {"component": COMPONENT},
        "reportingComponent": COMPONENT,
        "reportingInstance": COMPONENT,
        "firstTimestamp": stamp.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "lastTimestamp": stamp.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "count": 1,
    }
    try:
        api.create_event(policy.namespace, body)
    except KubeError as err:
        return None if err.status == 409 else err
    return None
