"""One evaluation of one KVTuningPolicy in a cluster: read the metrics, run the same `step` as the local
loop (diagnose, decide, act through the right actuator), then write status (conditions, values, history,
tuner state) with a status merge patch and post an Event for every action, rollback, recommendation, flag
and failure. Missing metrics or an unusable actuator become conditions and Events, never exceptions.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from kvtune.contract.knobs import KNOB_MAX_NUM_SEQS
from kvtune.core.objectives import default_round_to
from kvtune.operator.decide.diagnosis import corrupt_text
from kvtune.operator.decide.findings import Fact, Facts, FindingKind, fact, steady, tick_facts, transitions
from kvtune.operator.decide.loop import Held, Tick, step, window_length
from kvtune.operator.decide.memory import TickMemory
from kvtune.operator.decide.policy import Mode, ModeDecision, TuningPolicy, effective_mode
from kvtune.operator.decide.pooling import PodEvidence, PoolState, worst_pod_line
from kvtune.operator.decide.ports import Actuator
from kvtune.operator.decide.prediction import PredictionState, objective_of
from kvtune.operator.decide.sample import NoData
from kvtune.operator.decide.status import (
    CONDITION_TYPES,
    Conditions,
    ConditionState,
    ConditionStatus,
    Knobs,
    Standing,
    TickStatus,
    condition,
    condition_states,
    ready,
    recommended_knobs,
    record_tick,
)
from kvtune.operator.decide.tuner import HistoryEntry, JudgedFigures, TunerState, Value
from kvtune.operator.decide.undo import first_values, undo
from kvtune.operator.io.own_metrics import (
    ERROR_ACTUATOR,
    ERROR_EVENT_POST,
    ERROR_PROXY_METRICS,
    ERROR_STATUS_WRITE,
    Evaluation,
    OperatorMetrics,
    evaluation_of,
)
from kvtune.operator.k8s.bounded_patch import Freshness
from kvtune.operator.k8s.crd import (
    Condition,
    DesiredValues,
    KnobValues,
    KVTuningPolicySpec,
    KVTuningPolicyStatus,
    OriginalValues,
    PodStatus,
    PredictionStatus,
    ScalingStatus,
    TimingStatus,
    UndoStatus,
    WorkloadWatch,
    state_from_status,
    state_to_status,
)
from kvtune.operator.k8s.events import EventSpec, PolicyRef, event_name, finding_events, post_event
from kvtune.operator.k8s.kube_api import KubeApi, KubeError
from kvtune.operator.k8s.pods import Pod, PooledSource
from kvtune.operator.k8s.replica_signal import ReplicaSignal, replica_signal
from kvtune.operator.k8s.secret_cache import SecretCache
from kvtune.operator.k8s.status_writes import StatusWrites
from kvtune.operator.k8s.wiring import (
    actuator_for,
    advisory,
    args_actuator_of,
    is_workload,
    pod_statuses,
    source_for,
    workload_pods,
    workload_source,
)
from kvtune.operator.k8s.workload_actuator import WorkloadArgsActuator
from kvtune.operator.k8s.workload_watch import Watched, after_patch, follow, needs_read
from kvtune.operator.k8s.workload_watch import conditions as watch_conditions

logger = logging.getLogger("kvtune.operator")

EVENT_REASONS = {
    "applied": ("Normal", "TuningApplied"),
    "rolled_back": ("Warning", "TuningRolledBack"),
    "recommended": ("Normal", "TuningRecommended"),
    "flagged": ("Warning", "PrefixCacheDefeated"),
    "undone": ("Normal", "TuningUndone"),
}


UNPOSTED_LIMIT = 32  # Events kept to post again while the API server cannot take them (the first ones)
UNPOSTED_MAX_AGE_S = 600.0  # and for how long
# what an API server answers while it is away or starting: unreachable (0), and 401 / 403 as well, since a
# restarted one authorizes before its RBAC caches are filled ("role ... not found"); a 4xx else is for good
PASSING_STATUSES = frozenset({0, 401, 403, 429})


@dataclass(frozen=True)
class Unposted:
    """An Event the API server could not take for a passing reason (PASSING_STATUSES, 5xx): posted again at
    the next evaluations under its first name and time, so what the operator did or met during an outage is
    still told after it."""

    event: EventSpec
    at: float
    name: str


@dataclass(frozen=True)
class Resumed:
    """What a replica found in a policy's status when it began to evaluate it (a restart, a takeover from a
    peer that stopped or was killed, an upgrade): told once, as an OperatorResumed Event."""

    history: int
    last_evaluated: float | None
    pending: str | None  # the change still being judged, as the status holds it

    def message(self, now: float) -> str:
        ago = "never evaluated" if self.last_evaluated is None else (
            f"last evaluated {max(0.0, now - self.last_evaluated):.0f} s ago")  # fmt: skip
        judged = f"; still judging {self.pending}" if self.pending else ""
        return (f"this operator replica resumed the policy from its status: history {self.history} "
                f"entries, {ago}{judged}")  # fmt: skip


@dataclass
class PolicyMemory:
    """What the operator keeps between evaluations of one policy: the pure tick memory (`tuning`: the tuner
    state, also in status to resume, the sample window, conditions, recommendations, findings on) and what is
    the cluster's: the Secrets read (re-read only when they change), the pods' pool, the workload's watch,
    the undo, the knobs' first values, the replica signal and the Events and status writes in flight."""

    tuning: TickMemory = field(default_factory=TickMemory)
    secrets: SecretCache = field(default_factory=SecretCache)
    pool: PoolState = field(default_factory=PoolState)  # many pods: each pod's last figures, pooled totals
    original: dict[str, Value] = field(default_factory=dict)  # each knob before the operator first changed it
    undo: UndoStatus | None = None  # the last undo asked for (kvtune.dev/undo) and how it went
    watch: WorkloadWatch = field(default_factory=WorkloadWatch)  # a vllm / sglang workload's rollout, reverts
    scaling: ScalingStatus | None = None  # the replica signal as last written
    exported: tuple[int | None, float | None] = (None, None)  # desired replicas and load ratio last exported
    unposted: list[Unposted] = field(default_factory=list)  # Events to post again (the API server was down)
    resumed: Resumed | None = None  # what was taken over from status, until told (OperatorResumed)
    status_writes: StatusWrites = field(default_factory=StatusWrites)  # what was last written, and when

    @staticmethod
    def resume(status: dict[str, Any] | None) -> PolicyMemory:
        try:
            saved = KVTuningPolicyStatus.model_validate(status or {})
        except ValueError as err:
            logger.warning("ignoring an unreadable status: %s", err)
            return PolicyMemory()
        tuning = TickMemory(
            state=state_from_status(saved),
            conditions={c.type: c.state() for c in saved.conditions},
            recommended=knobs_of(saved.recommended),
            current=knobs_of(saved.current),
        )
        return PolicyMemory(
            tuning=tuning,
            original=saved.original.values() if saved.original else {},
            undo=saved.undo,
            watch=saved.workload or WorkloadWatch(),
            resumed=resumed_from(saved),
        )

    def found(self, facts: Facts) -> list[EventSpec]:
        """The Events for the findings that started, changed or ended (`findings.transitions`)."""
        self.tuning.on, findings = transitions(self.tuning.on, facts)
        return finding_events(findings)


def resumed_from(saved: KVTuningPolicyStatus) -> Resumed | None:
    """What an evaluation by an earlier replica left in status (None when no replica evaluated it yet)."""
    if saved.last_evaluation_time is None and not saved.history and saved.tuner_state is None:
        return None
    state = state_from_status(saved)
    pending = state.pending
    what = f"{pending.knob} {pending.before} -> {pending.after}" if pending is not None else None
    last = saved.last_evaluation_time.timestamp() if saved.last_evaluation_time is not None else None
    return Resumed(len(saved.history), last, what)


def knobs_of(values: KnobValues | None) -> Knobs | None:
    return None if values is None else dict(values.model_dump(exclude_none=True))


def knob_values(knobs: Knobs | None) -> KnobValues | None:
    return None if knobs is None else KnobValues.model_validate(knobs)


def conditions_of(states: list[ConditionState]) -> list[Condition]:
    return [Condition.of(state) for state in states]


def _judged_figures(figures: JudgedFigures | None) -> str:
    if figures is None:
        return "n/a"
    rate = "n/a" if figures.preemption_rate is None else f"{figures.preemption_rate:.2f}/s"
    kv = "n/a" if figures.kv_usage_max is None else f"{figures.kv_usage_max:.0%}"
    goodput = "n/a" if figures.goodput is None else f"{figures.goodput:.0f} tokens/s"
    return f"preemptions {rate}, KV usage max {kv}, goodput {goodput}"


def history_event(entry: HistoryEntry, flag: str | None = None) -> EventSpec:
    kind, reason = EVENT_REASONS.get(entry.kind, ("Normal", "Tuning"))
    what = f"{entry.knob}: {entry.before} -> {entry.after}" if entry.knob else f"{entry.after}"
    if flag and entry.knob == KNOB_MAX_NUM_SEQS:
        what += f" through {flag}"
    message = (
        f"{entry.remedy.value} {entry.kind}: {what}; why: {entry.reason}; evidence: {entry.evidence}; "
        f"before: {_judged_figures(entry.before_figures)}"
    )
    if entry.after_figures is not None:
        message += f"; after: {_judged_figures(entry.after_figures)}"
    return EventSpec(kind, reason, message, entry.remedy.value)


def patch_body(value: Any, in_list: bool = False) -> Any:
    """A merge-patch body from a full dump: nulls stay on object fields (so stale keys are deleted), and
    are dropped inside list items (a list is replaced whole, and null is not a valid item value)."""
    if isinstance(value, dict):
        return {k: patch_body(v, in_list) for k, v in value.items() if not (in_list and v is None)}
    if isinstance(value, list):
        return [patch_body(item, True) for item in value]
    return value


@dataclass(frozen=True)
class PolicyTick:
    """One evaluation's inputs: the policy, its spec and generation as read now, the highest mode the
    operator runs it in, the undo asked for (kvtune.dev/undo), and how often its unchanged status is
    written again."""

    ref: PolicyRef
    spec: KVTuningPolicySpec
    now: float
    generation: int | None = None
    max_mode: Mode = Mode.APPLY
    undo: str | None = None
    status_refresh_s: float = 0.0


@dataclass(frozen=True)
class Outcome:
    tick: Tick
    status: KVTuningPolicyStatus
    events: tuple[EventSpec, ...]
    evaluation: Evaluation  # what the operator's own /metrics record of this tick


@dataclass
class Prelude:
    """What an evaluation knows before it steps: the mode it runs in (and its condition), what acts on the
    engine, why that cannot act (if so), and the Events so far."""

    decision: ModeDecision
    capped: ConditionState
    actuator: Actuator
    error: str | None
    events: list[EventSpec]
    pods: list[Pod] | NoData | None  # the target's ready pods (None without target.podEndpoints)


@dataclass(frozen=True)
class Reading:
    """What the status says beyond the policy's memory: the evaluation's note, conditions and findings."""

    note: str
    conditions: list[ConditionState]
    current: Knobs | None
    mode: Mode
    flag: str | None = None
    pods: list[PodStatus] = field(default_factory=list)
    worst_pod: PodEvidence | None = None
    workload: WorkloadWatch | None = None
    prediction: PredictionStatus | None = None
    scaling: ScalingStatus | None = None


@dataclass(frozen=True)
class PodsRead:
    """One evaluation of many pods: their status lines, the worst one, and what changed among them."""

    pods: list[PodStatus]
    worst_pod: PodEvidence | None
    worst: str | None  # the worst pod's line, named in the note and the new history entries
    events: list[EventSpec]  # the pods that restarted
    fact: Fact | None  # the pods' disagreements and unreadable pods


def record_pods(
    memory: PolicyMemory, source: PooledSource, tick: Tick, held_by_pod: Mapping[str, Any]
) -> PodsRead:
    """Carry one evaluation of many pods into `memory` (the pool state) and say what changed among them
    (restarts; disagreements and unreadable pods, a finding)."""
    memory.pool = source.state
    events: list[EventSpec] = []
    pooled = source.last
    if pooled is not None and pooled.restarted and tick.no_data is None:
        restarted = ", ".join(pooled.restarted)
        message = (
            f"pods restarted: {restarted}; their counters count from zero, the pooled totals do not fall"
        )
        events.append(EventSpec("Warning", "PodRestarted", message))
    unread = (f"pod {name} unreadable: {why}" for name, why in sorted(source.unread.items()))
    findings = (*(pooled.findings if pooled else ()), *unread)
    pods, worst_pod = pod_statuses(memory.pool, tick.evidence_since, held_by_pod)
    worst = worst_pod_line(worst_pod) if worst_pod is not None and tick.no_data is None else None
    disagree = Fact("\n".join(findings), "; ".join(findings)) if findings else None
    return PodsRead(pods, worst_pod, worst, events, disagree)


HistoryKey = tuple[float, str, object, str | None]


def history_keys(state: TunerState) -> set[HistoryKey]:
    """What tells one history entry from another: an entry whose key is not in an earlier state's is new."""
    return {(h.at, h.kind, h.remedy, h.knob) for h in state.history}


def name_worst_pod(state: TunerState, seen: set[HistoryKey], worst: str) -> TunerState:
    """The history entries this evaluation added (not `seen`), with the worst pod in their evidence."""
    history = tuple(
        h if (h.at, h.kind, h.remedy, h.knob) in seen else replace(h, evidence=f"{h.evidence}; {worst}")
        for h in state.history
    )
    return replace(state, history=history)


def mode_condition(conditions: Conditions, decision: ModeDecision, now: float) -> ConditionState:
    """The ModeCapped condition: True while the policy runs below its spec.mode."""
    status: ConditionStatus = "True" if decision.capped else "False"
    return condition(conditions, "ModeCapped", status, decision.reason, decision.message, now)


def mode_fact(decision: ModeDecision) -> Fact | None:
    """Running below spec.mode, a finding that changes with its reason."""
    return Fact(decision.reason, decision.message) if decision.capped else None


def carry_out_undo(
    memory: PolicyMemory, actuator: Actuator, request: str, now: float
) -> tuple[TunerState, list[EventSpec]]:
    """Answer a kvtune.dev/undo request not yet carried out: the tuner state to step from, and an Event when
    a knob could not be set back (tried again next evaluation; the restored ones are TuningUndone Events
    from the history)."""
    state = memory.tuning.state
    if memory.undo is not None and memory.undo.request == request and memory.undo.done:
        return state, []
    current = actuator.current()
    first = first_values(memory.original, state.history)
    outcome = undo(actuator, first, current.values if current.ok else {}, state, request, now)
    message = "; ".join(outcome.failures) or (
        "restored " + ", ".join(f"{knob} {was} -> {value}" for knob, was, value in outcome.restored)
        if outcome.restored
        else "nothing to restore: the operator had changed no knob"
    )
    events = []
    if outcome.failures and (memory.undo is None or memory.undo.message != message):
        events.append(EventSpec("Warning", "UndoFailed", f"could not set back: {message}", "Undo"))
    at = datetime.fromtimestamp(now, UTC)
    memory.undo = UndoStatus(request=request, time=at, done=outcome.done, message=message)
    memory.original = outcome.remaining
    return outcome.state, events


def watch_workload(
    args: WorkloadArgsActuator, memory: PolicyMemory, policy: TuningPolicy, generation: int | None, now: float
) -> Watched | None:
    """Follow the workload's rollout and reverts (None when there is nothing to follow, or when it cannot be
    read: the actuator's own read then reports why)."""
    desired = dict(memory.tuning.state.desired).get(KNOB_MAX_NUM_SEQS) if policy.mode is Mode.APPLY else None
    held = desired if isinstance(desired, int) else None
    if not needs_read(memory.watch, held):
        return None
    try:
        workload = args.read()
    except KubeError:
        return None
    args.observe(workload)
    return follow(workload, args, memory.watch, held, generation, now)


def yield_value(memory: PolicyMemory) -> None:
    """Stop holding max_num_seqs (another field manager keeps reverting it): it stays a recommendation."""
    value = memory.watch.yielded_value
    tuning = memory.tuning
    desired = tuple((k, v) for k, v in tuning.state.desired if k != KNOB_MAX_NUM_SEQS)
    tuning.state = replace(tuning.state, desired=desired)
    tuning.recommended = {**(tuning.recommended or {}), KNOB_MAX_NUM_SEQS: value}


def follow_rollout(
    memory: PolicyMemory,
    at: PolicyTick,
    args: WorkloadArgsActuator,
    policy: TuningPolicy,
    events: list[EventSpec],
) -> str | None:
    """Carry the workload's rollout and reverts into `memory` (its Events into `events`); returns why to
    wait (a rollout under way: no judging, no acting) unless an undo, a person's override, is asked."""
    watched = watch_workload(args, memory, policy, at.generation, at.now)
    if watched is None:
        return None
    events += watched.events
    memory.watch = watched.state
    if watched.yielded:
        yield_value(memory)
    if watched.rolled_out:  # the new pods' evidence only, and a full window of it before judging
        memory.tuning.samples.clear()
        memory.tuning.state = memory.tuning.state.after_engine_restart(at.now)
    return watched.wait if at.undo is None else None


def workload_conditions(memory: PolicyMemory, now: float) -> list[ConditionState]:
    return [
        condition(memory.tuning.conditions, kind, status, reason, message, now)
        for kind, status, reason, message in watch_conditions(memory.watch)
    ]


def actuator_condition(conditions: Conditions, error: str | None, now: float) -> ConditionState:
    """ActuatorUnavailable: True while what acts on the engine's knobs cannot be built (a Secret missing):
    the diagnosis and the recommendations go on, nothing is applied."""
    if error:
        return condition(conditions, "ActuatorUnavailable", "True", "SecretUnreadable", error, now)
    built = "what acts on the engine's knobs is built"
    return condition(conditions, "ActuatorUnavailable", "False", "ActuatorBuilt", built, now)


def held_condition(
    conditions: Conditions, policy: TuningPolicy, held: Held | None, restarts: tuple[float, ...], now: float
) -> ConditionState:
    """ChangeHeld (a workload whose pods a change restarts): True while the restart budget holds a change
    (its start a finding, `findings.tick_facts`); False says how much of the budget is used."""
    budget = policy.restart_budget
    if held is not None:
        verdict = held.verdict
        return condition(conditions, "ChangeHeld", "True", verdict.reason, verdict.message, now)
    if budget is None:
        why = "no spec.restartBudget: changes that restart the pods are bounded by the cooldown only"
        return condition(conditions, "ChangeHeld", "False", "NoRestartBudget", why, now)
    return condition(conditions, "ChangeHeld", "False", "WithinBudget", budget.describe(restarts, now), now)


def ready_condition(conditions: Conditions, standing: Standing, now: float) -> ConditionState:
    status, reason, message = ready(standing)
    return condition(conditions, "Ready", status, reason, message, now)


def watch_standing(watch: WorkloadWatch | None) -> tuple[str | None, str | None]:
    """What the workload's watch puts in the way of acting: a stalled rollout, and the field yielded to
    another manager (None, None without a workload whose args the operator patches)."""
    if watch is None:
        return None, None
    stalled = f"rollout stalled: {watch.rollout_summary or ''}" if watch.rollout_stalled else None
    yielded = (
        f"{watch.reverted_by or 'another field manager'} keeps reverting max_num_seqs: kept "
        f"{watch.yielded_value} as a recommendation until the policy is edited"
        if watch.yielded_value is not None
        else None
    )
    return stalled, yielded


def begin(api: KubeApi, at: PolicyTick, memory: PolicyMemory) -> tuple[Prelude, TuningPolicy]:
    """The mode the policy runs in (at most `at.max_mode`, at most Recommend while an undo holds), the
    window resized to the spec, the pods listed and the actuator built; their findings' Events."""
    decision = effective_mode(Mode(at.spec.mode), at.max_mode, undo_hold=at.undo is not None)
    policy: TuningPolicy = replace(at.spec.to_policy(), mode=decision.mode)
    tuning = memory.tuning
    events: list[EventSpec] = []
    if memory.resumed is not None:
        events.append(EventSpec("Normal", "OperatorResumed", memory.resumed.message(at.now)))
        memory.resumed = None
    keep = window_length(policy, float(at.spec.interval_seconds))
    if tuning.samples.maxlen != keep:
        tuning.samples = deque(tuning.samples, maxlen=keep)
    pods = workload_pods(api, at.ref.namespace, at.spec)
    actuator = actuator_for(api, at.spec, at.ref.namespace, memory.secrets, pods)
    error = actuator.describe().unavailable
    events += memory.found({"mode_capped": mode_fact(decision), "actuator_unavailable": fact(error)})
    capped = mode_condition(tuning.conditions, decision, at.now)
    return Prelude(decision, capped, actuator, error, events, pods), policy


def waiting(memory: PolicyMemory, at: PolicyTick, prelude: Prelude, note: str, flag: str | None) -> Outcome:
    """The outcome of an evaluation that neither judges nor acts (a rollout in progress): status says why,
    and keeps what the last evaluation found."""
    tuning, now, capped = memory.tuning, at.now, prelude.capped
    kept = [tuning.conditions[kind] for kind in (*CONDITION_TYPES, "ChangeHeld") if kind in tuning.conditions]
    stalled, yielded = watch_standing(memory.watch)
    standing = Standing(
        prelude.decision.mode, actuator=prelude.error, stalled=stalled, yielded=yielded,
        rollout=None if stalled else note, capped=capped.message if capped.status == "True" else None,
    )  # fmt: skip
    conditions = [
        *kept, capped, *workload_conditions(memory, now), actuator_condition(tuning.conditions, prelude.error, now),
        ready_condition(tuning.conditions, standing, now),
    ]  # fmt: skip
    tuning.conditions.update({c.type: c for c in conditions})
    tick = Tick(now, None, state=tuning.state)
    states = condition_states(conditions)
    evaluation = evaluation_of(tuning.state, tick, states, recommended_knobs(tuning.recommended))
    # no new figures while waiting, but the conditions still stand: their series stay on the dashboards
    desired, ratio = memory.exported  # the replica signal holds through a rollout of the operator's
    evaluation = replace(evaluation, conditions=states, desired_replicas=desired, demand_capacity_ratio=ratio)
    pods, worst_pod = pod_statuses(memory.pool, None, {}) if is_workload(at.spec) else ([], None)
    reading = Reading(note, conditions, tuning.current, prelude.decision.mode, flag, pods, worst_pod,
                      memory.watch, scaling=memory.scaling)  # fmt: skip
    return Outcome(tick, policy_status(memory, tuning.state, at, reading), tuple(prelude.events), evaluation)


def policy_status(
    memory: PolicyMemory, state: TunerState, at: PolicyTick, reading: Reading
) -> KVTuningPolicyStatus:
    """The status both outcomes write (waiting for a rollout, or evaluated): one place maps the policy's
    memory and the tuner's state onto the CRD's fields."""
    tuner, history = state_to_status(state)
    return KVTuningPolicyStatus(
        observed_generation=at.generation,
        last_evaluation_time=datetime.fromtimestamp(at.now, UTC),
        note=reading.note,
        conditions=conditions_of(reading.conditions),
        current=knob_values(reading.current),
        recommended=knob_values(memory.tuning.recommended),
        desired=DesiredValues.of(state.desired),
        history=history,
        tuner_state=tuner,
        pods=reading.pods,
        worst_pod=reading.worst_pod.name if reading.worst_pod else None,
        admission_flag=reading.flag,
        mode=reading.mode.value,
        original=OriginalValues.of(memory.original),
        undo=memory.undo,
        workload=reading.workload,
        prediction=reading.prediction,
        scaling=reading.scaling,
        timing=TimingStatus.of(at.spec),
    )


def prediction_events(before: PredictionState, after: PredictionState) -> list[EventSpec]:
    """An Event for each new verdict on a forecast, and one when the tuner falls back to measured stepping."""
    events: list[EventSpec] = []
    if after.verdict and after.verdict != before.verdict:
        if after.verdict.startswith("held"):
            events.append(EventSpec("Normal", "PredictionHeld", after.verdict))
        elif after.verdict.startswith("missed"):
            events.append(EventSpec("Warning", "PredictionMissed", after.verdict))
    if after.stepping and not before.stepping:
        events.append(EventSpec("Warning", "PredictionFallback",
                                "two predictions missed on this workload: measured stepping from now on"))  # fmt: skip
    return events


def prediction_status(policy: TuningPolicy, tick: Tick) -> PredictionStatus | None:
    if not policy.predict:
        return None
    rate = tick.decision.diagnosis.preemption_rate if tick.decision is not None else None
    return PredictionStatus.of(
        tick.state.prediction, objective_of(policy).describe(), policy.round_to,
        rate * 60 if rate is not None else None,
    )  # fmt: skip


def action_events(
    tick: Tick, previous: TunerState, seen: set[HistoryKey], flag: str | None
) -> list[EventSpec]:
    """An Event for every history entry this tick added, every failed apply, a restart, every desired value
    put back, and every new verdict on a forecast."""
    events = [
        history_event(h, flag) for h in tick.state.history if (h.at, h.kind, h.remedy, h.knob) not in seen
    ]
    for change, result in tick.applied:
        if not result.ok:
            message = f"{change.knob} {change.before} -> {change.value}: {result.error}"
            events.append(EventSpec("Warning", "ApplyFailed", message, change.remedy.value))
    if tick.restart is not None:
        message = f"{tick.restart}; samples from before the restart dropped"
        events.append(EventSpec("Warning", "EngineRestarted", message))
    for knob, value, result in tick.reapplied:
        if result.ok:
            events.append(EventSpec("Normal", "DesiredStateReapplied", f"{knob} set back to {value}"))
        else:
            events.append(EventSpec("Warning", "ReapplyFailed", f"{knob} -> {value}: {result.error}"))
    return events + prediction_events(previous.prediction, tick.state.prediction)


def standing_conditions(
    conditions: Conditions, prelude: Prelude, tick: Tick, watch: WorkloadWatch | None, now: float
) -> list[ConditionState]:
    """ActuatorUnavailable and Ready, which sums up what stands in the way of acting."""
    stalled, yielded = watch_standing(watch)
    decision = prelude.decision
    standing = Standing(
        decision.mode, no_data=tick.no_data, alternating=tick.holding, actuator=prelude.error, stalled=stalled,
        yielded=yielded, held=tick.held.text if tick.held else None,
        capped=decision.message if decision.capped else None,
    )  # fmt: skip
    return [actuator_condition(conditions, prelude.error, now), ready_condition(conditions, standing, now)]


def tick_note(tick: Tick, worst: str | None) -> str:
    note = tick.decision.note if tick.decision else f"no data: {tick.no_data}"
    corrupt = tick.decision.diagnosis.corrupt if tick.decision else ()
    if corrupt:
        note = f"{note}; corrupt metrics, dropped: {corrupt_text(corrupt)}"
    return note if worst is None else f"{note}; {worst}"


def tick_conditions(
    api: KubeApi, at: PolicyTick, memory: PolicyMemory, policy: TuningPolicy, tick: Tick, prelude: Prelude,
    watch: WorkloadWatch | None, acting: bool,
) -> tuple[list[ConditionState], TickStatus, ReplicaSignal]:  # fmt: skip
    """The conditions this tick leaves, kept in the policy's memory, with what `record_tick` recorded and
    the replica signal (whose Events the caller posts). `acting`: the policy patches the workload's args."""
    tuning, now = memory.tuning, at.now
    watching = workload_conditions(memory, now) if acting else []
    recorded = record_tick(tuning.conditions, tuning.recommended, tick, now)
    tuning.recommended = recorded.recommended
    replicas = replica_signal(api, at.ref.namespace, at.spec, tick.state.scaling.signal, memory.scaling,
                              tuning.conditions, now)  # fmt: skip
    memory.scaling, memory.exported = replicas.status, (replicas.desired, replicas.ratio)
    signal = [replicas.condition] if replicas.condition is not None else []
    held = [held_condition(tuning.conditions, policy, tick.held, tick.state.restarts, now)] if acting else []
    conditions = [*recorded.conditions, prelude.capped, *watching, *signal, *held,
                  *standing_conditions(tuning.conditions, prelude, tick, watch, now)]  # fmt: skip
    tuning.conditions = {c.type: c for c in conditions}
    tuning.current = recorded.current if recorded.current is not None else tuning.current
    return conditions, recorded, replicas


def evaluate(api: KubeApi, at: PolicyTick, memory: PolicyMemory) -> Outcome:
    """One step for one policy; updates `memory`, returns the status to write and the Events to post."""
    prelude, policy = begin(api, at, memory)
    tuning, spec, now = memory.tuning, at.spec, at.now
    args = args_actuator_of(prelude.actuator)
    if args is not None:
        wait = follow_rollout(memory, at, args, policy, prelude.events)
        if wait is not None:
            return waiting(memory, at, prelude, wait, prelude.actuator.describe().admission_flag)
        if memory.watch.yielded_value is not None:
            prelude.actuator = advisory(
                prelude.actuator, args, memory.watch.reverted_by or "another field manager"
            )
        device = args.device() if spec.round_to is None else None
        if device is not None:  # unset roundTo assumes a GPU; the container says where it runs
            policy = replace(policy, round_to=default_round_to(spec.target.engine, device))
    previous = start = tuning.state
    events = prelude.events
    if at.undo is not None:
        start, undone = carry_out_undo(memory, prelude.actuator, at.undo, now)
        events += undone
    horizon = (tuning.samples.maxlen or 0) * float(spec.interval_seconds)
    pooled = workload_source(spec, prelude.pods, memory.pool, horizon) if is_workload(spec) else None
    source = pooled if pooled is not None else source_for(spec)
    if args is not None:  # its patches land within one interval of the data read now, or are not made
        args.decides_on(Freshness(time.time(), float(spec.interval_seconds)))
    tick = step(source, prelude.actuator, policy, start, tuning.samples, now)
    info, seen = prelude.actuator.describe(), history_keys(previous)  # after the step: what the pods answered
    pods = record_pods(memory, pooled, tick, info.held_by_pod) if pooled is not None else None
    if pods is not None and pods.worst is not None:
        tick = replace(tick, state=name_worst_pod(tick.state, seen, pods.worst))
    facts: dict[FindingKind, Fact | None] = {"pods_disagree": pods.fact} if pods is not None else {}
    facts.update({"proxy_missing": steady(source.proxy_problem), **tick_facts(tick, held=args is not None)})
    events += [*(pods.events if pods else ()), *memory.found(facts)]
    events += action_events(tick, previous, seen, info.admission_flag)
    tuning.state = tick.state
    memory.original = first_values(memory.original, tick.state.history)
    watch = after_patch(memory.watch, args, now) if args is not None else None
    if watch is not None:
        memory.watch = watch
    conditions, recorded, replicas = tick_conditions(
        api, at, memory, policy, tick, prelude, watch, args is not None
    )
    events += replicas.events
    errors = ((ERROR_ACTUATOR,) if prelude.error else ()) + (
        (ERROR_PROXY_METRICS,) if source.proxy_problem else ()
    )
    evaluation = evaluation_of(previous, tick, condition_states(conditions), recommended_knobs(tuning.recommended),
                               errors, policy.objective if policy.predict else None)  # fmt: skip
    evaluation = replace(evaluation, desired_replicas=replicas.desired, demand_capacity_ratio=replicas.ratio)
    reading = Reading(tick_note(tick, pods.worst if pods else None), conditions, recorded.current,
                      prelude.decision.mode, info.admission_flag, pods.pods if pods else [],
                      pods.worst_pod if pods else None, watch, prediction_status(policy, tick), replicas.status)  # fmt: skip
    return Outcome(tick, policy_status(memory, tick.state, at, reading), tuple(events), evaluation)


def write(
    api: KubeApi, policy_ref: PolicyRef, outcome: Outcome, now: float, unposted: list[Unposted] | None = None,
    writes: StatusWrites | None = None, status_refresh_s: float = 0.0,
) -> tuple[str, ...]:  # fmt: skip
    """Patch the status subresource (when `writes` says it is due: changed in meaning, or not written for
    `status_refresh_s`) and post the Events (first those `unposted` kept from earlier ticks); failures are
    logged (the next tick retries) and returned as error kinds for the operator's metrics. An Event the API
    server could not take for a passing reason goes back into `unposted` (UNPOSTED_LIMIT of them, for
    UNPOSTED_MAX_AGE_S)."""
    failed: list[str] = []
    status = outcome.status.model_dump(mode="json", by_alias=True)
    if writes is None or writes.due(status, now, status_refresh_s):
        try:
            api.patch_policy_status(policy_ref.namespace, policy_ref.name, patch_body({"status": status}))
            if writes is not None:
                writes.wrote(status, now)
        except KubeError as err:
            logger.error(
                "could not write the status of %s/%s: %s", policy_ref.namespace, policy_ref.name, err
            )
            failed.append(ERROR_STATUS_WRITE)
            if writes is not None:
                writes.failed()
    fresh = [Unposted(event, now, event_name(policy_ref, now)) for event in outcome.events]
    waiting = [*(unposted or ()), *fresh]
    if unposted is not None:
        unposted.clear()
    for item in waiting:
        error = post_event(api, policy_ref, item.event, item.at, item.name)
        if error is None:
            continue
        logger.error("could not post event %s: %s", item.event.reason, error)
        failed.append(ERROR_EVENT_POST)
        passing = error.status in PASSING_STATUSES or error.status >= 500
        fresh_enough = now - item.at < UNPOSTED_MAX_AGE_S
        if unposted is not None and passing and fresh_enough and len(unposted) < UNPOSTED_LIMIT:
            unposted.append(item)
    return tuple(failed)


def run_once(
    api: KubeApi, at: PolicyTick, memory: PolicyMemory, metrics: OperatorMetrics | None = None
) -> Outcome:
    """Evaluate, write, and record the tick (with any write failures) in the operator's own metrics."""
    outcome = evaluate(api, at, memory)
    failed = write(api, at.ref, outcome, at.now, memory.unposted, memory.status_writes, at.status_refresh_s)
    errors = outcome.evaluation.errors + failed
    evaluation = replace(outcome.evaluation, errors=errors, interval_s=float(at.spec.interval_seconds))
    outcome = replace(outcome, evaluation=evaluation)
    if metrics is not None:
        metrics.record(at.ref.namespace, at.ref.name, outcome.evaluation)
    return outcome
