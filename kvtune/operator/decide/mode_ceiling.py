"""The mode a policy actually runs in. A policy asks for one (spec.mode); the operator runs none above its
ceiling (`kvtune operator --max-mode`, the chart's `maxMode`), so turning on Apply is the cluster
administrator's decision and not whoever can write a policy; and a policy whose changes were undone
(`kvtune.dev/undo`) is held at Recommend until the annotation goes. Pure: values in, values out."""

from __future__ import annotations

from dataclasses import dataclass

from kvtune.operator.decide.policy import Mode

ORDER = (Mode.OBSERVE, Mode.RECOMMEND, Mode.APPLY)
UNDO_ANNOTATION = "kvtune.dev/undo"


@dataclass(frozen=True)
class ModeDecision:
    mode: Mode  # the mode the policy runs in
    capped: bool  # below what the policy asked for
    reason: str  # CamelCase, for the ModeCapped condition: MaxMode, UndoHold or AsRequested
    message: str


def effective_mode(requested: Mode, ceiling: Mode, undo_hold: bool = False) -> ModeDecision:
    """The lower of the policy's mode and the operator's ceiling; at most Recommend while an undo holds."""
    mode = min(requested, ceiling, key=ORDER.index)
    if undo_hold and ORDER.index(mode) > ORDER.index(Mode.RECOMMEND):
        return ModeDecision(
            Mode.RECOMMEND,
            True,
            "UndoHold",
            f"spec.mode is {requested.value}; held at Recommend while the {UNDO_ANNOTATION} annotation is "
            f"set (its changes were undone): remove the annotation to let it act again",
        )
    if mode is not requested:
        return ModeDecision(
            mode,
            True,
            "MaxMode",
            f"spec.mode is {requested.value}, but this operator runs no policy above {ceiling.value} (the "
            f"chart value maxMode, `kvtune operator --max-mode`): evaluated as {mode.value}",
        )
    return ModeDecision(mode, False, "AsRequested", f"runs as spec.mode asks: {mode.value}")
