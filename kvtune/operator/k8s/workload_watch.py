"""What the operator follows, each evaluation, on a vLLM or SGLang workload whose args it patches.

- **Its rollouts.** A patch restarts every replica. Until the rollout completes (the controller saw the new
  generation; every replica is updated and available) the metrics mix old and new pods, so the operator
  neither judges nor acts, and its status says "waiting for rollout". Once it completes, the evidence
  starts again from the new pods. A Deployment past its progress deadline (or a StatefulSet that has not
  finished within `STATEFULSET_PATIENCE_S`) is a stalled rollout: a Warning Event and the RolloutStalled
  condition, and still no action until it completes.
- **Its reverts.** When the args no longer hold the value the operator set and another field manager owns
  them (managedFields: Argo CD, Flux, a `kubectl apply`), that manager reverted the change. The operator
  names it (an Event, the ChangeReverted condition) and sets its value again after that rollout, up to
  `REVERTS_TOLERATED` times; at the next revert it stops: the value becomes a recommendation, the args
  stay as the other manager wants them, and it does not patch them again until the policy is edited.

Where a rollout stands (`rollout`) is read from the object the API server returns: a Deployment that
stops progressing says so itself (condition Progressing=False, reason ProgressDeadlineExceeded, after
spec.progressDeadlineSeconds); a StatefulSet has no deadline, so the watch bounds the wait for it. Pure
except for the one read of the workload the caller passes in."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtune.operator.decide.ports import ActuatorInfo, ActuatorResult
from kvtune.operator.decide.status import ConditionStatus, ConditionType
from kvtune.operator.k8s.crd import WorkloadWatch
from kvtune.operator.k8s.events import EventSpec
from kvtune.operator.k8s.kube_api import FIELD_MANAGER
from kvtune.operator.k8s.managed_fields import other_owner
from kvtune.operator.k8s.workload_actuator import WorkloadArgsActuator

REVERTS_TOLERATED = 2  # the operator re-applies its value after this many reverts; the next one it yields to
STATEFULSET_PATIENCE_S = 600.0  # a StatefulSet has no progress deadline: a rollout this long is stalled

ConditionSpec = tuple[ConditionType, ConditionStatus, str, str]  # type, status, reason, message


@dataclass(frozen=True)
class Watched:
    state: WorkloadWatch
    wait: str | None = None  # why this evaluation neither judges nor acts (None: it goes on)
    events: tuple[EventSpec, ...] = ()
    rolled_out: bool = False  # a rollout just completed: the evidence from before it is dropped
    yielded: bool = False  # stop holding the value: another field manager keeps reverting it


def needs_read(state: WorkloadWatch, desired: int | None) -> bool:
    """Whether this evaluation must read the workload for the watch (a rollout awaited, or a value held)."""
    return state.rollout_generation is not None or (desired is not None and state.yielded_value is None)


def _generation(workload: dict[str, Any]) -> int | None:
    generation = (workload.get("metadata") or {}).get("generation")
    return generation if isinstance(generation, int) else None


def follow(
    workload: dict[str, Any], actuator: WorkloadArgsActuator, state: WorkloadWatch, desired: int | None,
    policy_generation: int | None, now: float,
) -> Watched:  # fmt: skip
    """One evaluation's look at the workload: reverts first (a revert starts a rollout of its own), then the
    rollout awaited."""
    events: list[EventSpec] = []
    yielded = False
    if state.yielded_value is not None and state.yielded_policy_generation != policy_generation:
        state = WorkloadWatch(rollout_generation=state.rollout_generation, rollout_since=state.rollout_since)
    generation = _generation(workload)
    container = actuator.container_name(workload)
    if (
        desired is not None
        and state.yielded_value is None
        and container
        and not actuator.holds(workload, desired)
    ):
        owner = other_owner(workload, container, FIELD_MANAGER)
        if owner is not None and generation != state.revert_generation:
            held = actuator.held(workload)
            flag = actuator.flag_choice.flag if actuator.flag_choice else "the admission flag"
            count = state.reverts + 1
            state = state.model_copy(update=dict(reverts=count, reverted_by=owner.manager, reverted_to=held,
                            revert_generation=generation, rollout_generation=generation, rollout_since=now,
                            rollout_stalled=False))  # fmt: skip
            what = (
                f"{owner.describe()} put {flag} back to {held} on {actuator.where}, over kvtune's {desired}"
            )
            if count > REVERTS_TOLERATED:
                state = state.model_copy(
                    update=dict(yielded_value=desired, yielded_policy_generation=policy_generation)
                )
                yielded = True
                events.append(EventSpec("Warning", "YieldedToFieldManager", (
                    f"{what} (revert {count}): kvtune stops setting it and keeps {desired} as a recommendation. "
                    f"To let kvtune own the field, make {owner.manager} ignore the container's args (see the "
                    "README, GitOps); to try again, edit this policy"), "Yield"))  # fmt: skip
            else:
                events.append(EventSpec("Warning", "ChangeReverted", (
                    f"{what} (revert {count}; kvtune sets its value again after the rollout, at most "
                    f"{REVERTS_TOLERATED} times)"), "Revert"))  # fmt: skip
    wait = None
    rolled_out = False
    if state.rollout_generation is not None:
        progress = rollout(workload)
        waited = now - (state.rollout_since if state.rollout_since is not None else now)
        stalled = progress.stalled or (
            not progress.done and workload.get("kind") == "StatefulSet" and waited > STATEFULSET_PATIENCE_S
        )
        if progress.done:
            events.append(EventSpec("Normal", "RolloutComplete", (
                f"{actuator.where} rolled out ({progress.summary}) in {waited:.0f} s; the change is judged on "
                "the new pods from now"), "Rollout"))  # fmt: skip
            state = state.model_copy(update=dict(rollout_generation=None, rollout_since=None, rollout_stalled=False,
                            rollout_summary=progress.summary))  # fmt: skip
            rolled_out = True
        elif stalled:
            if not state.rollout_stalled:
                events.append(EventSpec("Warning", "RolloutStalled", (
                    f"{actuator.where} stopped rolling out ({progress.summary}) after {waited:.0f} s; kvtune "
                    "neither judges nor acts on it until the rollout completes"), "Rollout"))  # fmt: skip
            state = state.model_copy(update=dict(rollout_stalled=True, rollout_summary=progress.summary))
            wait = f"rollout stalled: {actuator.where} {progress.summary}; not acting until it completes"
        else:
            state = state.model_copy(update=dict(rollout_summary=progress.summary))
            wait = f"waiting for rollout of {actuator.where}: {progress.summary}"
    return Watched(state, wait, tuple(events), rolled_out, yielded)


def after_patch(state: WorkloadWatch, actuator: WorkloadArgsActuator, now: float) -> WorkloadWatch:
    """The watch after an evaluation: a patch that made a new generation is a rollout to wait for."""
    if actuator.patched_generation is None:
        return state
    return state.model_copy(update=dict(rollout_generation=actuator.patched_generation, rollout_since=now,
                   rollout_stalled=False, rollout_summary=None))  # fmt: skip


def conditions(state: WorkloadWatch) -> list[ConditionSpec]:
    """RolloutStalled and ChangeReverted, as (type, status, reason, message)."""
    stalled: ConditionSpec
    reverted: ConditionSpec
    if state.rollout_stalled:
        stalled = ("RolloutStalled", "True", "ProgressDeadlineExceeded", state.rollout_summary or "")
    elif state.rollout_generation is not None:
        stalled = ("RolloutStalled", "False", "RolloutInProgress", state.rollout_summary or "")
    else:
        stalled = (
            "RolloutStalled",
            "False",
            "RolloutComplete",
            state.rollout_summary or "no rollout awaited",
        )
    who = f"{state.reverted_by} put it back to {state.reverted_to}, {state.reverts} time(s)"
    if state.yielded_value is not None:
        reverted = ("ChangeReverted", "True", "YieldedToFieldManager",
                    f"{who}: kvtune keeps {state.yielded_value} as a recommendation and no longer sets it")  # fmt: skip
    elif state.reverts:
        reverted = ("ChangeReverted", "True", "RevertedByFieldManager",
                    f"{who}; kvtune sets its value again (at most {REVERTS_TOLERATED} times)")  # fmt: skip
    else:
        reverted = ("ChangeReverted", "False", "NotReverted", "kvtune's changes hold")
    return [stalled, reverted]


class AdvisoryWorkload:
    """The workload's args actuator once the operator yielded to another field manager: it still reads the
    value in force, and changes nothing (the tuner's decisions for it become recommendations)."""

    knobs: frozenset[str] = frozenset()

    def __init__(self, actuator: WorkloadArgsActuator, manager: str) -> None:
        self.actuator = actuator
        self.manager = manager

    def current(self) -> ActuatorResult:
        return self.actuator.current()

    def apply(self, knob: str, value: int | str | None, cause: str = "") -> ActuatorResult:
        return ActuatorResult(False, {}, f"{self.actuator.where}: its args are {self.manager}'s (GitOps)")

    def describe(self) -> ActuatorInfo:
        return self.actuator.describe()  # yielded, but still read: its flag is still the one in force


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
