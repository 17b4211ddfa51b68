"""The replica signal on Kubernetes: the autoscalers that drive the policy's workload (two withdraw the
signal, with a condition), the status it writes, and the Events when it moves or says NoPreemption costs."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from kvtune.operator.decide.scaling import ScalingSignal
from kvtune.operator.decide.status import Conditions, ConditionState, ConditionStatus, condition
from kvtune.operator.k8s.autoscalers import autoscalers_of, conflict_message
from kvtune.operator.k8s.crd import KVTuningPolicySpec, ScalingStatus
from kvtune.operator.k8s.events import EventSpec
from kvtune.operator.k8s.kube_api import KubeApi, KubeError


@dataclass(frozen=True)
class ReplicaSignal:
    """One evaluation's signal as exported: `desired` None when withdrawn (a conflict, autoscalers unknown,
    or no count said)."""

    status: ScalingStatus | None
    condition: ConditionState | None
    events: tuple[EventSpec, ...]
    desired: int | None
    ratio: float | None


def drivers(api: KubeApi, namespace: str, spec: KVTuningPolicySpec) -> list[str] | str:
    """The autoscalers whose target is the policy's workload, or why they cannot be listed."""
    try:
        hpas, scaled = api.list_autoscalers(namespace)
    except KubeError as err:
        return f"the autoscalers of {namespace} cannot be listed: {err}"
    return autoscalers_of(spec.target.kind, spec.target.name, hpas, scaled)


def replica_signal(
    api: KubeApi,
    namespace: str,
    spec: KVTuningPolicySpec,
    signal: ScalingSignal | None,
    before: ScalingStatus | None,
    conditions: Conditions,
    now: float,
) -> ReplicaSignal:
    if spec.scaling is None:
        return ReplicaSignal(None, None, (), None, None)
    found = drivers(api, namespace, spec)
    events: list[EventSpec] = []
    if isinstance(found, str):
        state = condition(conditions, "AutoscalerConflict", "Unknown", "AutoscalersUnknown", found, now)
        listed: list[str] = []
        withdrawn: str | None = found
    else:
        listed, withdrawn = found, conflict_message(found)
        status_of: ConditionStatus = "True" if withdrawn else "False"
        reason = "TwoAutoscalers" if withdrawn else "OneAutoscalerOrNone"
        state = condition(
            conditions, "AutoscalerConflict", status_of, reason, withdrawn or ", ".join(found), now
        )
        if (withdrawn and conditions.get("AutoscalerConflict", None) is None) or (
            withdrawn and conditions["AutoscalerConflict"].status != "True"
        ):
            events.append(EventSpec("Warning", "AutoscalerConflict", withdrawn))
    if signal is None:
        status = ScalingStatus.model_validate(
            {"replicas": 0, "reason": "no evaluation window yet", "autoscalers": listed, "held": withdrawn}
        )
        return ReplicaSignal(status, state, tuple(events), None, None)
    status = ScalingStatus.model_validate({
        "desiredReplicas": signal.desired, "replicas": signal.replicas_now, "demand": signal.demand,
        "demandEvidence": signal.demand_evidence,
        "demandCapacityRatio": signal.ratio, "maxNumSeqsPerReplica": signal.max_num_seqs,
        "reason": signal.reason, "held": withdrawn or signal.held, "noPreemptionCost": signal.costly,
        "goodputLoss": signal.goodput_loss, "autoscalers": listed,
        "evaluatedAt": datetime.fromtimestamp(signal.at, UTC),
    })  # fmt: skip
    if signal.costly and (before is None or before.no_preemption_cost is None):
        events.append(EventSpec("Warning", "NoPreemptionCostly", signal.costly))
    moved = before is None or before.desired_replicas != signal.desired
    if signal.desired is not None and moved and not withdrawn:
        events.append(EventSpec("Normal", "ReplicasNeeded", f"{signal.desired} replicas: {signal.reason}"))
    if withdrawn:
        return ReplicaSignal(status, state, tuple(events), None, None)
    return ReplicaSignal(status, state, tuple(events), signal.desired, signal.ratio)
