"""Which autoscalers drive a policy's workload, pure: two on one target fight over `spec.replicas`, so the
operator says so with a condition and withdraws its replica signal rather than feed either of them.

A ScaledObject acts through an HPA KEDA makes and owns; that HPA is the ScaledObject's, not a second
autoscaler.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

Json = dict[str, Any]
SCALED_OBJECT = "ScaledObject"


def _targets(ref: Any, kind: str, name: str) -> bool:
    if not isinstance(ref, dict):
        return False
    return ref.get("name") == name and (ref.get("kind") or "Deployment") == kind


def _owned_by_scaled_object(hpa: Json) -> bool:
    owners = (hpa.get("metadata") or {}).get("ownerReferences") or []
    return any(isinstance(o, dict) and o.get("kind") == SCALED_OBJECT for o in owners)


def autoscalers_of(kind: str, name: str, hpas: Iterable[Json], scaled_objects: Iterable[Json]) -> list[str]:
    """`Kind/name` of every autoscaler whose target is the workload `kind`/`name`, sorted."""
    found = [
        f"HorizontalPodAutoscaler/{(h.get('metadata') or {}).get('name')}"
        for h in hpas
        if not _owned_by_scaled_object(h)
        and _targets((h.get("spec") or {}).get("scaleTargetRef"), kind, name)
    ]
    found += [
        f"{SCALED_OBJECT}/{(o.get('metadata') or {}).get('name')}"
        for o in scaled_objects
        if _targets((o.get("spec") or {}).get("scaleTargetRef"), kind, name)
    ]
    return sorted(found)


def conflict_message(found: list[str]) -> str | None:
    """Why the replica signal is withdrawn, or None when at most one autoscaler drives the workload."""
    if len(found) < 2:
        return None
    return (
        f"{len(found)} autoscalers drive this workload ({', '.join(found)}): they would fight over spec.replicas, "
        "so the replica signal (kvtune_operator_desired_replicas) is withdrawn until one remains"
    )
