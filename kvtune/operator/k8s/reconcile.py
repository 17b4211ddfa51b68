"""One evaluation of one KVTuningPolicy in a cluster: read the metrics, run the same `step` as the local
loop (diagnose, decide, act through the right actuator), then write status (conditions, values, history,
tuner state) with a status merge patch and post an Event for every action, rollback, recommendation, flag
and failure. Missing metrics or an unusable actuator become conditions and Events, never exceptions.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from kvtune.contract.knobs import KNOB_MAX_NUM_SEQS
from kvtune.core.objectives import default_round_to
from kvtune.operator.decide.continuity import ALTERNATING_HINT
from kvtune.operator.decide.diagnosis import corrupt_text
from kvtune.operator.decide.freshness import Freshness
from kvtune.operator.decide.loop import Held, Tick, step, window_length
from kvtune.operator.decide.mode_ceiling import ModeDecision, effective_mode
from kvtune.operator.decide.policy import Mode, TuningPolicy
from kvtune.operator.decide.pooling import PodEvidence, PoolState, worst_pod_line
from kvtune.operator.decide.ports import Actuator
from kvtune.operator.decide.prediction import PredictionState, objective_of
from kvtune.operator.decide.readiness import Standing, ready
from kvtune.operator.decide.sample import Sample
from kvtune.operator.decide.status import (
    CONDITION_TYPES,
    ConditionState,
    ConditionStatus,
    Knobs,
    condition,
    condition_states,
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
from kvtune.operator.k8s.events import EventSpec, PolicyRef, event_name, post_event
from kvtune.operator.k8s.kube_api import KubeApi, KubeError
from kvtune.operator.k8s.pods import PooledSource
from kvtune.operator.k8s.replica_signal import replica_signal
from kvtune.operator.k8s.secret_cache import SecretCache
from kvtune.operator.k8s.status_writes import StatusWrites
from kvtune.operator.k8s.wiring import actuator_for, advisory, args_actuator_of, source_for
from kvtune.operator.k8s.workload import is_workload, pod_statuses, workload_pods, workload_source
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
    """What the operator keeps between evaluations of one policy: the tuner state (also in status, to
    resume), the sample window (memory only: rebuilt within a few intervals), the last conditions and the
    Secrets read (re-read only when they change)."""

    state: TunerState = field(default_factory=TunerState)
    samples: deque[Sample] = field(default_factory=deque)
    conditions: dict[str, ConditionState] = field(default_factory=dict)
    recommended: Knobs | None = None
    no_data: bool = False
    actuator_error: str | None = None
    proxy_problem: str | None = None  # why the proxy's /metrics could not be read at the last evaluation
    secrets: SecretCache = field(default_factory=SecretCache)
    pool: PoolState = field(default_factory=PoolState)  # many pods: each pod's last figures, pooled totals
    pod_findings: tuple[str, ...] = ()  # pods' disagreements and unreadable pods at the last evaluation
    original: dict[str, Value] = field(default_factory=dict)  # each knob before the operator first changed it
    undo: UndoStatus | None = None  # the last undo asked for (kvtune.dev/undo) and how it went
    mode_capped: str | None = None  # why the policy ran below its spec.mode at the last evaluation
    watch: WorkloadWatch = field(
        default_factory=lambda: WorkloadWatch()
    )  # a vllm / sglang workload's rollout, reverts
    current: Knobs | None = None  # the knobs the engine held at the last evaluation that read them
    alternating: bool = False  # the source answered from more than one process, recently enough to hold
    corrupt: tuple[tuple[str, str], ...] = ()  # the series dropped as impossible at the last evaluation
    scaling: ScalingStatus | None = None  # the replica signal as last written
    exported: tuple[int | None, float | None] = (None, None)  # desired replicas and load ratio last exported
    held: str | None = None  # why a change that restarts the pods was held at the last evaluation
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
        return PolicyMemory(
            state=state_from_status(saved),
            conditions={c.type: c.state() for c in saved.conditions},
            recommended=knobs_of(saved.recommended),
            original=saved.original.values() if saved.original else {},
            undo=saved.undo,
            watch=saved.workload or WorkloadWatch(),
            current=knobs_of(saved.current),
            resumed=resumed_from(saved),
        )


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
class Outcome:
    tick: Tick
    status: KVTuningPolicyStatus
    events: tuple[EventSpec, ...]
    evaluation: Evaluation  # what the operator's own /metrics record of this tick


def record_pods(memory: PolicyMemory, source: PooledSource, tick: Tick) -> list[EventSpec]:
    """Carry one evaluation of many pods into `memory` (the pool state) and say what changed among the pods
    (restarts, disagreements, unreadable pods: an Event each time the findings change)."""
    memory.pool = source.state
    events: list[EventSpec] = []
    pooled = source.last
    if pooled is not None and pooled.restarted and tick.no_data is None:
        events.append(EventSpec("Warning", "PodRestarted", f"pods restarted: {', '.join(pooled.restarted)}; "
                                "their counters count from zero, the pooled totals do not fall"))  # fmt: skip
    findings = (*(pooled.findings if pooled else ()),
                *(f"pod {name} unreadable: {why}" for name, why in sorted(source.unread.items())))  # fmt: skip
    if findings and findings != memory.pod_findings:
        events.append(EventSpec("Warning", "PodsDisagree", "; ".join(findings)))
    memory.pod_findings = findings
    return events


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


def mode_condition(
    memory: PolicyMemory, decision: ModeDecision, now: float
) -> tuple[ConditionState, list[EventSpec]]:
    """The ModeCapped condition, and a Warning Event when the policy starts running below its spec.mode
    (or for another reason than at the last evaluation)."""
    reason = decision.reason if decision.capped else None
    events = (
        [EventSpec("Warning", "ModeCapped", decision.message)]
        if reason and reason != memory.mode_capped
        else []
    )
    memory.mode_capped = reason
    status: ConditionStatus = "True" if decision.capped else "False"
    return condition(memory.conditions, "ModeCapped", status, decision.reason, decision.message, now), events


def carry_out_undo(
    memory: PolicyMemory, actuator: Actuator, request: str, now: float
) -> tuple[TunerState, list[EventSpec]]:
    """Answer a kvtune.dev/undo request not yet carried out: the tuner state to step from, and an Event when
    a knob could not be set back (tried again next evaluation; the restored ones are TuningUndone Events
    from the history)."""
    if memory.undo is not None and memory.undo.request == request and memory.undo.done:
        return memory.state, []
    current = actuator.current()
    first = first_values(memory.original, memory.state.history)
    outcome = undo(actuator, first, current.values if current.ok else {}, memory.state, request, now)
    message = "; ".join(outcome.failures) or (
        "restored " + ", ".join(f"{knob} {was} -> {value}" for knob, was, value in outcome.restored)
        if outcome.restored
        else "nothing to restore: the operator had changed no knob"
    )
    events = []
    if outcome.failures and (memory.undo is None or memory.undo.message != message):
        events.append(EventSpec("Warning", "UndoFailed", f"could not set back: {message}", "Undo"))
    memory.undo = UndoStatus(request=request, time=datetime.fromtimestamp(now, UTC), done=outcome.done,
                             message=message)  # fmt: skip
    memory.original = outcome.remaining
    return outcome.state, events


def watch_workload(
    args: WorkloadArgsActuator, memory: PolicyMemory, policy: TuningPolicy, generation: int | None, now: float
) -> Watched | None:
    """Follow the workload's rollout and reverts (None when there is nothing to follow, or when it cannot be
    read: the actuator's own read then reports why)."""
    desired = dict(memory.state.desired).get(KNOB_MAX_NUM_SEQS) if policy.mode is Mode.APPLY else None
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
    memory.state = replace(
        memory.state, desired=tuple((k, v) for k, v in memory.state.desired if k != KNOB_MAX_NUM_SEQS)
    )
    memory.recommended = {**(memory.recommended or {}), KNOB_MAX_NUM_SEQS: value}


def workload_conditions(memory: PolicyMemory, now: float) -> list[ConditionState]:
    return [
        condition(memory.conditions, kind, status, reason, message, now)
        for kind, status, reason, message in watch_conditions(memory.watch)
    ]


def actuator_condition(memory: PolicyMemory, error: str | None, now: float) -> ConditionState:
    """ActuatorUnavailable: True while what acts on the engine's knobs cannot be built (a Secret missing):
    the diagnosis and the recommendations go on, nothing is applied."""
    if error:
        return condition(memory.conditions, "ActuatorUnavailable", "True", "SecretUnreadable", error, now)
    return condition(memory.conditions, "ActuatorUnavailable", "False", "ActuatorBuilt",
                     "what acts on the engine's knobs is built", now)  # fmt: skip


def held_condition(
    memory: PolicyMemory, policy: TuningPolicy, held: Held | None, restarts: tuple[float, ...], now: float
) -> tuple[ConditionState, list[EventSpec]]:
    """ChangeHeld (a workload whose pods a change restarts): True while the restart budget holds a change,
    with a Normal Event when a hold begins; False says how much of the budget is used."""
    budget = policy.restart_budget
    events: list[EventSpec] = []
    if held is not None:
        verdict = held.verdict
        if verdict.reason != memory.held:
            events.append(EventSpec("Normal", "ChangeHeld", f"{held.what} held: {verdict.message}", "Hold"))
        memory.held = verdict.reason
        held_state = condition(memory.conditions, "ChangeHeld", "True", verdict.reason, verdict.message, now)
        return held_state, events
    memory.held = None
    if budget is None:
        return condition(memory.conditions, "ChangeHeld", "False", "NoRestartBudget",
                         "no spec.restartBudget: changes that restart the pods are bounded by the cooldown only",
                         now), events  # fmt: skip
    return condition(memory.conditions, "ChangeHeld", "False", "WithinBudget", budget.describe(restarts, now),
                     now), events  # fmt: skip


def ready_condition(memory: PolicyMemory, standing: Standing, now: float) -> ConditionState:
    status, reason, message = ready(standing)
    return condition(memory.conditions, "Ready", status, reason, message, now)


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


def waiting(
    memory: PolicyMemory, spec: KVTuningPolicySpec, note: str, events: list[EventSpec], flag: str | None,
    generation: int | None, now: float, capped: ConditionState, mode: Mode,
) -> Outcome:  # fmt: skip
    """The outcome of an evaluation that neither judges nor acts (a rollout in progress): status says why,
    and keeps what the last evaluation found."""
    kept = [memory.conditions[kind] for kind in (*CONDITION_TYPES, "ChangeHeld") if kind in memory.conditions]
    stalled, yielded = watch_standing(memory.watch)
    standing = Standing(mode, actuator=memory.actuator_error, stalled=stalled, yielded=yielded,
                        rollout=None if stalled else note,
                        capped=capped.message if capped.status == "True" else None)  # fmt: skip
    conditions = [*kept, capped, *workload_conditions(memory, now),
                  actuator_condition(memory, memory.actuator_error, now), ready_condition(memory, standing, now)]  # fmt: skip
    memory.conditions.update({c.type: c for c in conditions})
    tick = Tick(now, None, state=memory.state)
    states = condition_states(conditions)
    evaluation = evaluation_of(memory.state, tick, states, recommended_knobs(memory.recommended))
    # no new figures while waiting, but the conditions still stand: their series stay on the dashboards
    desired, ratio = memory.exported  # the replica signal holds through a rollout of the operator's
    evaluation = replace(evaluation, conditions=states, desired_replicas=desired, demand_capacity_ratio=ratio)
    pods_status, worst_pod = pod_statuses(memory.pool, None, {}) if is_workload(spec) else ([], None)
    status = policy_status(memory, memory.state, generation, now, note, conditions, memory.current, pods_status,
                           worst_pod, flag, mode, memory.watch, scaling=memory.scaling,
                           timing=TimingStatus.of(spec))  # fmt: skip
    return Outcome(tick, status, tuple(events), evaluation)


def policy_status(
    memory: PolicyMemory, state: TunerState, generation: int | None, now: float, note: str,
    conditions: list[ConditionState], current: Knobs | None, pods: list[PodStatus],
    worst_pod: PodEvidence | None, flag: str | None, mode: Mode, workload: WorkloadWatch | None,
    prediction: PredictionStatus | None = None, scaling: ScalingStatus | None = None,
    timing: TimingStatus | None = None,
) -> KVTuningPolicyStatus:  # fmt: skip
    """The status both outcomes write (waiting for a rollout, or evaluated): one place maps the policy's
    memory and the tuner's state onto the CRD's fields."""
    tuner, history = state_to_status(state)
    return KVTuningPolicyStatus(
        observed_generation=generation,
        last_evaluation_time=datetime.fromtimestamp(now, UTC),
        note=note,
        conditions=conditions_of(conditions),
        current=knob_values(current),
        recommended=knob_values(memory.recommended),
        desired=DesiredValues.of(state.desired),
        history=history,
        tuner_state=tuner,
        pods=pods,
        worst_pod=worst_pod.name if worst_pod else None,
        admission_flag=flag,
        mode=mode.value,
        original=OriginalValues.of(memory.original),
        undo=memory.undo,
        workload=workload,
        prediction=prediction,
        scaling=scaling,
        timing=timing,
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


def evaluate(
    api: KubeApi,
    policy_ref: PolicyRef,
    spec: KVTuningPolicySpec,
    memory: PolicyMemory,
    now: float,
    generation: int | None = None,
    max_mode: Mode = Mode.APPLY,
    undo_request: str | None = None,
) -> Outcome:
    """One step for one policy; updates `memory`, returns the status to write and the Events to post. The
    policy runs at most in `max_mode` (the operator's ceiling), and at most in Recommend while an undo
    (`undo_request`, the kvtune.dev/undo annotation) holds."""
    decision = effective_mode(Mode(spec.mode), max_mode, undo_hold=undo_request is not None)
    policy: TuningPolicy = replace(spec.to_policy(), mode=decision.mode)
    capped, events = mode_condition(memory, decision, now)
    if memory.resumed is not None:
        events.insert(0, EventSpec("Normal", "OperatorResumed", memory.resumed.message(now)))
        memory.resumed = None
    keep = window_length(policy, float(spec.interval_seconds))
    if memory.samples.maxlen != keep:
        memory.samples = deque(memory.samples, maxlen=keep)
    pods = workload_pods(api, policy_ref.namespace, spec)
    actuator = actuator_for(api, spec, policy_ref.namespace, memory.secrets, pods)
    actuator_error = actuator.describe().unavailable
    if actuator_error and actuator_error != memory.actuator_error:
        events.append(EventSpec("Warning", "ActuatorUnavailable", actuator_error))
    memory.actuator_error = actuator_error
    args = args_actuator_of(actuator)
    watched = watch_workload(args, memory, policy, generation, now) if args is not None else None
    if args is not None and watched is not None:
        events += watched.events
        memory.watch = watched.state
        if watched.yielded:
            yield_value(memory)
        if watched.rolled_out:  # the new pods' evidence only, and a full window of it before judging
            memory.samples.clear()
            memory.state = memory.state.after_engine_restart(now)
        # an undo is a person's override: it is carried out even while a rollout is under way
        if watched.wait is not None and undo_request is None:
            return waiting(memory, spec, watched.wait, events, actuator.describe().admission_flag, generation,
                           now, capped, decision.mode)  # fmt: skip
    if args is not None and memory.watch.yielded_value is not None:
        actuator = advisory(actuator, args, memory.watch.reverted_by or "another field manager")
    device = args.device() if args is not None and spec.round_to is None else None
    if device is not None:  # unset roundTo assumes a GPU; the container says where it runs
        policy = replace(policy, round_to=default_round_to(spec.target.engine, device))
    previous = memory.state
    start = previous
    if undo_request is not None:
        start, undo_events = carry_out_undo(memory, actuator, undo_request, now)
        events += undo_events
    workload = is_workload(spec)
    horizon = keep * float(spec.interval_seconds)
    pooled = workload_source(spec, pods, memory.pool, horizon) if workload else None
    source = pooled if pooled is not None else source_for(spec)
    if args is not None:  # its patches land within one interval of the data read now, or are not made
        args.decides_on(Freshness(time.time(), float(spec.interval_seconds)))
    tick = step(source, actuator, policy, start, memory.samples, now)
    info = actuator.describe()  # after the step: what the pods answered to it
    seen = history_keys(previous)
    pods_status: list[PodStatus] = []
    worst_pod: PodEvidence | None = None
    worst: str | None = None
    if pooled is not None:
        events += record_pods(memory, pooled, tick)
        pods_status, worst_pod = pod_statuses(memory.pool, tick.evidence_since, info.held_by_pod)
        worst = worst_pod_line(worst_pod) if worst_pod is not None and tick.no_data is None else None
    if worst is not None:
        tick = replace(tick, state=name_worst_pod(tick.state, seen, worst))
    proxy_problem = source.proxy_problem
    if proxy_problem and not memory.proxy_problem:
        events.append(EventSpec("Warning", "ProxyMetricsMissing",
                                f"the proxy's /metrics (defeat and cap series) cannot be read: {proxy_problem}"))  # fmt: skip
    memory.proxy_problem = proxy_problem
    flag = info.admission_flag
    events += [
        history_event(h, flag) for h in tick.state.history if (h.at, h.kind, h.remedy, h.knob) not in seen
    ]
    for change, result in tick.applied:
        if not result.ok:
            events.append(EventSpec("Warning", "ApplyFailed",
                                    f"{change.knob} {change.before} -> {change.value}: {result.error}",
                                    change.remedy.value))  # fmt: skip
    if tick.restart is not None:
        events.append(EventSpec("Warning", "EngineRestarted",
                                f"{tick.restart}; samples from before the restart dropped"))  # fmt: skip
    for knob, value, result in tick.reapplied:
        if result.ok:
            events.append(EventSpec("Normal", "DesiredStateReapplied", f"{knob} set back to {value}"))
        else:
            events.append(EventSpec("Warning", "ReapplyFailed", f"{knob} -> {value}: {result.error}"))
    if tick.alternation is not None and not memory.alternating:
        events.append(EventSpec("Warning", "MetricsSourceAlternating",
                                f"{ALTERNATING_HINT}: {tick.alternation}; its samples are dropped and nothing "
                                "is acted on until it answers from one process"))  # fmt: skip
    elif memory.alternating and tick.holding is None and tick.no_data is None:
        events.append(EventSpec("Normal", "MetricsSourceStable",
                                "the metrics source has answered from one process long enough: tuning resumes"))  # fmt: skip
    if tick.no_data is None:
        memory.alternating = tick.holding is not None
    events += prediction_events(previous.prediction, tick.state.prediction)
    if tick.no_data and not memory.no_data:
        events.append(EventSpec("Warning", "NoMetrics", f"no data from the metrics source: {tick.no_data}"))
    memory.no_data = tick.no_data is not None
    corrupt = tick.decision.diagnosis.corrupt if tick.decision else ()
    if corrupt and corrupt != memory.corrupt:
        events.append(EventSpec("Warning", "CorruptMetrics",
                                f"corrupt metrics, dropped and never used as figures: {corrupt_text(corrupt)}"))  # fmt: skip
    memory.corrupt = corrupt
    memory.state = tick.state
    memory.original = first_values(memory.original, tick.state.history)
    if args is not None:
        memory.watch = after_patch(memory.watch, args, now)
    watching = workload_conditions(memory, now) if args is not None else []

    recorded = record_tick(memory.conditions, memory.recommended, tick, now)
    current = recorded.current
    memory.recommended = recorded.recommended
    replicas = replica_signal(api, policy_ref.namespace, spec, tick.state.scaling.signal, memory.scaling,
                              memory.conditions, now)  # fmt: skip
    events += replicas.events
    memory.scaling, memory.exported = replicas.status, (replicas.desired, replicas.ratio)
    signal_condition = [replicas.condition] if replicas.condition is not None else []
    held: list[ConditionState] = []
    if args is not None:
        held_state, held_events = held_condition(memory, policy, tick.held, tick.state.restarts, now)
        held = [held_state]
        events += held_events
    stalled, yielded = watch_standing(memory.watch if args is not None else None)
    standing = Standing(decision.mode, no_data=tick.no_data, alternating=tick.holding, actuator=actuator_error,
                        stalled=stalled, yielded=yielded,
                        held=f"{tick.held.what} held: {tick.held.verdict.message}" if tick.held else None,
                        capped=decision.message if decision.capped else None)  # fmt: skip
    conditions = [*recorded.conditions, capped, *watching, *signal_condition, *held,
                  actuator_condition(memory, actuator_error, now), ready_condition(memory, standing, now)]  # fmt: skip
    memory.conditions = {c.type: c for c in conditions}
    if current is not None:
        memory.current = current
    errors = ((ERROR_ACTUATOR,) if actuator_error else ()) + ((ERROR_PROXY_METRICS,) if proxy_problem else ())
    evaluation = evaluation_of(previous, tick, condition_states(conditions),
                               recommended_knobs(memory.recommended), errors,
                               policy.objective if policy.predict else None)  # fmt: skip
    evaluation = replace(evaluation, desired_replicas=replicas.desired, demand_capacity_ratio=replicas.ratio)
    note = tick.decision.note if tick.decision else f"no data: {tick.no_data}"
    if corrupt:
        note = f"{note}; corrupt metrics, dropped: {corrupt_text(corrupt)}"
    if worst is not None:
        note = f"{note}; {worst}"
    status = policy_status(memory, tick.state, generation, now, note, conditions, current, pods_status, worst_pod,
                           flag, decision.mode, memory.watch if args is not None else None,
                           prediction_status(policy, tick), replicas.status, TimingStatus.of(spec))  # fmt: skip
    return Outcome(tick, status, tuple(events), evaluation)


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
    api: KubeApi,
    policy_ref: PolicyRef,
    spec: KVTuningPolicySpec,
    memory: PolicyMemory,
    now: float,
    generation: int | None = None,
    metrics: OperatorMetrics | None = None,
    max_mode: Mode = Mode.APPLY,
    undo_request: str | None = None,
    status_refresh_s: float = 0.0,
) -> Outcome:
    """Evaluate, write, and record the tick (with any write failures) in the operator's own metrics."""
    outcome = evaluate(api, policy_ref, spec, memory, now, generation, max_mode, undo_request)
    failed = write(api, policy_ref, outcome, now, memory.unposted, memory.status_writes, status_refresh_s)
    outcome = replace(
        outcome,
        evaluation=replace(
            outcome.evaluation,
            errors=outcome.evaluation.errors + failed,
            interval_s=float(spec.interval_seconds),
        ),
    )
    if metrics is not None:
        metrics.record(policy_ref.namespace, policy_ref.name, outcome.evaluation)
    return outcome
