"""The policy's Ready condition: one condition that sums up whether the operator reads the policy's
engines and can do what its mode asks, so `kubectl wait --for=condition=Ready` and an alert need not know
every other condition. False names the first thing in the way; True names what the operator does, and
what it waits for by design (a rollout, the restart budget, the mode ceiling). Pure."""

from __future__ import annotations

from dataclasses import dataclass

from kvtune.operator.decide.policy import Mode
from kvtune.operator.decide.status import ConditionStatus

DOING = {Mode.OBSERVE: "Observing", Mode.RECOMMEND: "Recommending", Mode.APPLY: "Acting"}


@dataclass(frozen=True)
class Standing:
    """Where one policy stands at an evaluation: each field is why (None: nothing of that kind)."""

    mode: Mode  # the mode it runs in (spec.mode, or less)
    no_data: str | None = None  # the metrics source gave nothing
    alternating: str | None = None  # the source answers from more than one process: nothing is acted on
    actuator: str | None = None  # what acts could not be built (a Secret missing)
    stalled: str | None = None  # the rollout the operator's patch started stopped progressing
    yielded: str | None = None  # another field manager kept reverting the change: the operator stopped
    rollout: str | None = None  # a rollout under way, awaited before judging
    held: str | None = None  # a change that restarts the pods, held by the restart budget
    capped: str | None = None  # runs below spec.mode (maxMode, or an undo's hold)


def ready(standing: Standing) -> tuple[ConditionStatus, str, str]:
    """(status, reason, message) of the Ready condition. Without metrics nothing is diagnosed in any mode;
    the actuator, the rollout and the field's owner stand in the way only of Apply."""
    blockers = [("NoMetrics", standing.no_data), ("SourceAlternating", standing.alternating)]
    if standing.mode is Mode.APPLY:
        blockers += [
            ("ActuatorUnavailable", standing.actuator),
            ("RolloutStalled", standing.stalled),
            ("YieldedToFieldManager", standing.yielded),
        ]
    for reason, why in blockers:
        if why:
            return "False", reason, why
    reason = "WaitingForRollout" if standing.rollout else DOING[standing.mode]
    notes = [standing.rollout, standing.held, standing.capped]
    if standing.mode is not Mode.APPLY:
        notes += [standing.actuator and f"cannot act: {standing.actuator}", standing.yielded]
    said = "; ".join(note for note in notes if note)
    return "True", reason, f"runs as {standing.mode.value}" + (f"; {said}" if said else "")
