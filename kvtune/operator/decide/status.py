"""What a policy's status says after one tick, as plain values: the conditions (each keeping the time its
status last changed), the knobs the engine holds, and the knobs recommended (merged over ticks, dropped
once Stable). `k8s.reconcile` turns them into the KVTuningPolicy status; the --local loop
(`io.local_metrics`) records the same values in the operator's own metrics, so both say the same.

The Ready condition (`ready`) sums up whether the operator reads the policy's
engines and can do what its mode asks, so `kubectl wait --for=condition=Ready` and an alert need not know
every other condition. False names the first thing in the way; True names what the operator does, and
what it waits for by design (a rollout, the restart budget, the mode ceiling). Pure."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal

from kvtune.contract.knobs import KNOB_KV_CACHE_DTYPE, KNOB_MAX_NUM_SEQS, KNOB_MAX_TOKENS_CAP
from kvtune.operator.decide.continuity import ALTERNATING_HINT
from kvtune.operator.decide.diagnosis import Diagnosis, corrupt_text, known
from kvtune.operator.decide.ladder import Remedy
from kvtune.operator.decide.loop import Tick
from kvtune.operator.decide.policy import Mode
from kvtune.operator.decide.tuner import Value

ConditionType = Literal[
    "Preempting",
    "KVSaturated",
    "PrefixCacheDefeated",
    "FP8Recommended",
    "Stable",
    "SourceAlternating",
    "ModeCapped",
    "RolloutStalled",
    "ChangeReverted",
    "AutoscalerConflict",
    "ActuatorUnavailable",
    "ChangeHeld",
    "Ready",
]
# What the diagnosis says (Unknown without data), on every policy. ModeCapped is the operator's own: the
# policy runs below its spec.mode (the operator's maxMode, or an undo's hold). So are ActuatorUnavailable,
# ChangeHeld (the restart budget holds a change) and Ready, which sums up the others (`ready`).
CONDITION_TYPES: tuple[ConditionType, ...] = (
    "Preempting",
    "KVSaturated",
    "PrefixCacheDefeated",
    "FP8Recommended",
    "Stable",
    "SourceAlternating",  # the metrics source answers from more than one process: nothing is acted on
)
ConditionStatus = Literal["True", "False", "Unknown"]
STATUS_KNOBS = (KNOB_MAX_NUM_SEQS, KNOB_MAX_TOKENS_CAP, KNOB_KV_CACHE_DTYPE)  # what status.current names

Knobs = dict[str, Value]  # knob name -> value; a knob not known is left out


@dataclass(frozen=True)
class ConditionState:
    type: ConditionType
    status: ConditionStatus
    reason: str
    message: str
    since: datetime  # when its status last changed


Conditions = Mapping[str, ConditionState]  # the last evaluation's, by type


@dataclass(frozen=True)
class TickStatus:
    current: Knobs | None  # the knobs the engine holds (None without data)
    conditions: list[ConditionState]
    recommended: Knobs | None


def condition(
    before: Conditions, kind: ConditionType, status: ConditionStatus, reason: str, message: str, now: float
) -> ConditionState:
    """A condition as it stands now; its time moves only when its status changes."""
    last = before.get(kind)
    changed = last is None or last.status != status
    since = datetime.fromtimestamp(now, UTC) if changed or last is None else last.since
    return ConditionState(kind, status, reason, message, since)


def source_condition(before: Conditions, holding: str | None, no_data: bool, now: float) -> ConditionState:
    """SourceAlternating: True while the metrics source answers from more than one process (no action is
    taken until it answers from one), False while its samples come from one, Unknown without data."""
    if holding is not None:
        return condition(before, "SourceAlternating", "True", "AlternatingSource",
                         f"{ALTERNATING_HINT}: {holding}; no action until it answers from one process", now)  # fmt: skip
    if no_data:
        return condition(before, "SourceAlternating", "Unknown", "NoData", "no sample", now)
    return condition(
        before, "SourceAlternating", "False", "OneProcess", "the samples come from one process", now
    )


def conditions_for(
    before: Conditions,
    diagnosis: Diagnosis | None,
    no_data: str | None,
    prefix_defeated: tuple[bool, str],
    fp8: tuple[bool, str],
    now: float,
    holding: str | None = None,
) -> list[ConditionState]:
    """The diagnosis's conditions (CONDITION_TYPES), every one Unknown without data."""
    if diagnosis is None or diagnosis.status == "no_data":
        reason = no_data or (
            diagnosis.findings[0].evidence if diagnosis and diagnosis.findings else "no data"
        )
        blank = [
            condition(before, kind, "Unknown", "NoData", reason, now)
            for kind in CONDITION_TYPES
            if kind != "SourceAlternating"
        ]
        return [*blank, source_condition(before, holding, True, now)]
    d = diagnosis
    corrupt = (
        f"corrupt metrics, dropped and never used as figures: {corrupt_text(d.corrupt)}" if d.corrupt else ""
    )
    if d.preemption_rate is None and d.corrupt and d.samples >= 2:
        preempting = condition(before, "Preempting", "Unknown", "CorruptMetrics", corrupt, now)
    elif d.preemption_rate is None:
        preempting = condition(
            before, "Preempting", "Unknown", "WaitingForSamples", "rates need two samples", now
        )
    elif d.preempting:
        preempting = condition(
            before, "Preempting", "True", "PreemptionsObserved",
            f"{d.preemption_rate:.2f} preemptions/s over {d.window_seconds:.0f} s", now,
        )  # fmt: skip
    elif d.other_preemptions:  # the engine says why, and none was for lack of KV blocks: nothing to remedy
        others = ", ".join(f"{reason} {count:.0f}" for reason, count in d.preemptions_by_reason)
        preempting = condition(
            before, "Preempting", "False", "NoKVPressurePreemptions",
            f"over {d.window_seconds:.0f} s; {d.other_preemptions:.0f} for other reasons ({others})", now,
        )  # fmt: skip
    else:
        preempting = condition(
            before, "Preempting", "False", "NoPreemptions", f"over {d.window_seconds:.0f} s", now
        )
    kv = f"KV usage max {known(d.kv_usage_max, '.0%')}, waiting max {known(d.waiting_max, '.0f')}"
    if corrupt:
        kv += f"; {corrupt}"
    if d.kv_usage_max is None and d.corrupt:
        saturated = condition(before, "KVSaturated", "Unknown", "CorruptMetrics", kv, now)
    else:
        saturated = condition(
            before, "KVSaturated", "True" if d.saturated else "False",
            "KVCacheFull" if d.saturated else "KVHeadroom", kv, now,
        )  # fmt: skip
    defeated, defeat_evidence = prefix_defeated
    prefix = condition(
        before, "PrefixCacheDefeated", "True" if defeated else "False",
        ("PrefixDefeatsReported" if d.prefix_defeats else "LowPrefixHitRate") if defeated else "NotDetected",
        defeat_evidence, now,
    )  # fmt: skip
    recommended, fp8_evidence = fp8
    fp8_condition = condition(
        before, "FP8Recommended", "True" if recommended else "False",
        "PressurePersists" if recommended else "NotNeeded", fp8_evidence, now,
    )  # fmt: skip
    unknown = d.preemption_rate is None
    stable = not unknown and not d.preempting and not d.saturated
    stable_condition = condition(
        before, "Stable", "Unknown" if unknown else ("True" if stable else "False"),
        "WaitingForSamples" if unknown else (("Idle" if d.status == "idle" else "NoPressure") if stable else "Pressure"),
        kv, now,
    )  # fmt: skip
    source = source_condition(before, holding, False, now)
    return [preempting, saturated, prefix, fp8_condition, stable_condition, source]


def known_knobs(values: Mapping[str, Value]) -> Knobs:
    """The knobs status names, those with a value."""
    return {knob: value for knob, value in values.items() if knob in STATUS_KNOBS and value is not None}


def record_tick(before: Conditions, recommended: Knobs | None, tick: Tick, now: float) -> TickStatus:
    """One tick as status says it: the knobs the engine holds, the conditions, and the recommendations
    (this tick's merged over the earlier ones; none once Stable)."""
    decision = tick.decision
    diagnosis = decision.diagnosis if decision else None
    current: Knobs | None = None
    prefix = fp8 = (False, "")
    if tick.engine is not None and decision is not None:
        view = tick.engine
        current = known_knobs({KNOB_MAX_NUM_SEQS: view.max_num_seqs, KNOB_MAX_TOKENS_CAP: view.max_tokens_cap,
                               KNOB_KV_CACHE_DTYPE: view.cache_dtype})  # fmt: skip
        flag = decision.rung(Remedy.FLAG_PREFIX_DEFEAT)
        advice = decision.rung(Remedy.RECOMMEND_FP8_KV)
        assert flag is not None and advice is not None  # `loop.step` gives every decision its rungs
        prefix = (flag.applicable, flag.evidence)
        reached = any(h.remedy is Remedy.RECOMMEND_FP8_KV for h in tick.state.history)
        fp8 = (advice.applicable and reached, advice.evidence)
    if decision is not None:
        proposed: dict[str, Value] = {a.knob: a.recommended for a in decision.advice if a.knob}
        proposed.update({c.knob: c.value for c in decision.changes})
        if proposed:
            recommended = {**(recommended or {}), **known_knobs(proposed)}
    conditions = conditions_for(before, diagnosis, tick.no_data, prefix, fp8, now, tick.holding)
    if any(c.type == "Stable" and c.status == "True" for c in conditions):
        recommended = None
    return TickStatus(current, conditions, recommended)


def condition_states(conditions: list[ConditionState]) -> dict[str, bool | None]:
    return {c.type: {"True": True, "False": False}.get(c.status) for c in conditions}


def recommended_knobs(recommended: Knobs | None) -> dict[str, int | None]:
    """The knobs the status recommends (a knob it does not name is advised at its current value)."""
    values = recommended or {}
    return {
        knob: value
        for knob in (KNOB_MAX_NUM_SEQS, KNOB_MAX_TOKENS_CAP)
        if isinstance(value := values.get(knob), int)
    }


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
