"""Where a Deployment's or StatefulSet's rollout stands, from the object the API server returns. Pure.

A patch of the pod template restarts every replica, one batch at a time; until the controller has seen the
new generation and every replica runs the new template and is available, the engines' metrics mix old and
new pods, so the operator neither judges nor acts. A Deployment that stops progressing says so itself
(condition Progressing=False, reason ProgressDeadlineExceeded, after spec.progressDeadlineSeconds); a
StatefulSet has no deadline, so the caller bounds the wait for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PROGRESS_DEADLINE_EXCEEDED = "ProgressDeadlineExceeded"


@dataclass(frozen=True)
class Rollout:
    done: bool
    stalled: bool  # the controller gave up on it (a Deployment past its progress deadline)
    summary: str  # e.g. "generation 4: 1 of 3 replicas updated, 3 available"


def _count(status: dict[str, Any], key: str) -> int:
    value = status.get(key)
    return value if isinstance(value, int) else 0


def rollout(workload: dict[str, Any]) -> Rollout:
    """The rollout of the workload's current generation (`kubectl rollout status`'s rules)."""
    metadata, spec, status = (workload.get(key) or {} for key in ("metadata", "spec", "status"))
    generation = metadata.get("generation")
    wanted = spec.get("replicas", 1)
    wanted = wanted if isinstance(wanted, int) else 1
    observed = status.get("observedGeneration")
    updated, available = _count(status, "updatedReplicas"), _count(status, "availableReplicas")
    total = _count(status, "replicas")
    summary = f"generation {generation}: {updated} of {wanted} replicas updated, {available} available"
    if total > updated:
        summary += f", {total - updated} old still running"
    seen = isinstance(observed, int) and isinstance(generation, int) and observed >= generation
    if not seen:
        return Rollout(False, False, f"{summary} (the controller has not seen it yet)")
    if workload.get("kind") == "StatefulSet":
        revisions = status.get("currentRevision"), status.get("updateRevision")
        done = (
            updated >= wanted and _count(status, "readyReplicas") >= wanted and revisions[0] == revisions[1]
        )
    else:
        done = updated >= wanted and total <= updated and available >= wanted
    if done:
        return Rollout(True, False, summary)
    progressing = next(
        (c for c in status.get("conditions") or [] if isinstance(c, dict) and c.get("type") == "Progressing"),
        None,
    )
    if (
        progressing
        and progressing.get("status") == "False"
        and progressing.get("reason") == PROGRESS_DEADLINE_EXCEEDED
    ):
        return Rollout(False, True, f"{summary}: {progressing.get('message') or PROGRESS_DEADLINE_EXCEEDED}")
    return Rollout(False, False, summary)
