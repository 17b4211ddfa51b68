"""Undo: put back, through the same actuator, the value each knob held before the operator first changed
it (the `before` of its first applied action), and stop holding the tuned values.

The operator keeps those first values in the policy's status (`status.original`) from the moment it
acts, because the history it also reads them from keeps only its last 32 entries. An undo is asked for
with the `kvtune.dev/undo` annotation (any value; a new value asks again); while the annotation is there
the policy is held at Recommend (`policy.effective_mode`), so the tuner does not take the values straight back.
The first values are forgotten once restored: the next action records a new baseline.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from kvtune.contract.knobs import KNOB_KV_CACHE_DTYPE, KNOB_MAX_NUM_SEQS, KNOB_MAX_TOKENS_CAP
from kvtune.operator.decide.ladder import Remedy
from kvtune.operator.decide.policy import UNDO_ANNOTATION
from kvtune.operator.decide.ports import Actuator
from kvtune.operator.decide.tuner import HistoryEntry, JudgedFigures, TunerState, Value

REMEDY_OF = {
    KNOB_MAX_TOKENS_CAP: Remedy.CAP_MAX_TOKENS,
    KNOB_MAX_NUM_SEQS: Remedy.LOWER_MAX_NUM_SEQS,
    KNOB_KV_CACHE_DTYPE: Remedy.RECOMMEND_FP8_KV,
}
NO_FIGURES = JudgedFigures(None, None, None, None)


def first_values(saved: Mapping[str, Value], history: Iterable[HistoryEntry]) -> dict[str, Value]:
    """knob -> the value in force before the operator first changed it: what `saved` already holds, and for
    any other knob the `before` of its earliest applied action in `history` since the last undo (an undo
    ends a baseline: what came before it is restored and forgotten)."""
    entries = sorted(history, key=lambda h: h.at)
    undone = [index for index, entry in enumerate(entries) if entry.kind == "undone"]
    found = dict(saved)
    for entry in entries[undone[-1] + 1 if undone else 0 :]:
        if entry.kind == "applied" and entry.knob in REMEDY_OF and entry.knob not in found:
            found[entry.knob] = entry.before
    return found


@dataclass(frozen=True)
class UndoOutcome:
    state: TunerState  # nothing desired, nothing pending, the undone entries in history
    restored: tuple[tuple[str, Value, Value], ...]  # (knob, from, to) set back
    failures: tuple[str, ...]  # one line per knob that could not be set back
    remaining: dict[str, Value]  # first values not restored (failed): kept to try again

    @property
    def done(self) -> bool:
        return not self.failures


def undo(
    actuator: Actuator,
    first: Mapping[str, Value],
    current: Mapping[str, Value],
    state: TunerState,
    request: str,
    now: float,
) -> UndoOutcome:
    """Set every knob in `first` that the actuator can change back to its first value (`current`: what the
    engine holds now, for the history). A knob already at its first value needs no call."""
    restored: list[tuple[str, Value, Value]] = []
    failures: list[str] = []
    remaining: dict[str, Value] = {}
    entries: list[HistoryEntry] = []
    for knob, value in sorted(first.items()):
        if knob not in actuator.knobs:
            failures.append(f"{knob}: no actuator here changes it; set it back to {value} by hand")
            remaining[knob] = value
            continue
        held = current.get(knob)
        if held != value:
            result = actuator.apply(knob, value)
            if not result.ok:
                failures.append(f"{knob} -> {value}: {result.error}")
                remaining[knob] = value
                continue
        restored.append((knob, held, value))
        entries.append(
            HistoryEntry(
                now,
                "undone",
                REMEDY_OF[knob],
                knob,
                held,
                value,
                "undo",
                f"{UNDO_ANNOTATION}={request}: the value in force before the operator first changed {knob}",
                NO_FIGURES,
            )
        )
    undone = state
    for entry in entries:
        undone = undone.record(entry)
    undone = replace(
        undone,
        rung=None,
        pending=None,
        last_action_at=now,
        unsafe_max_num_seqs=None,
        unsafe_since=None,
        exhausted=frozenset(),
        desired=(),
    )
    return UndoOutcome(undone, tuple(restored), tuple(failures), remaining)
