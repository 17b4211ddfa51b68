"""One evaluation of one KVTuningPolicy in a cluster: read the metrics, run the same `step` as the local
loop (diagnose, decide, act through the right actuator), then write status (conditions, values, history,
tuner state) with a status merge patch and post an Event for every action, rollback, recommendation, flag
and failure. Missing metrics or an unusable actuator become conditions and Events, never exceptions.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from kvtune.operator.actuators import (
    ENGINE_KNOBS,
    PROXY_KNOBS,
    Actuator,
    ActuatorResult,
    ComposedActuator,
    FanOutActuator,
    KvtuneAdminActuator,
)
from kvtune.operator.crd import (
    CONDITION_TYPES,
    Condition,
    ConditionStatus,
    ConditionType,
    DesiredValues,
    KnobValues,
    KVTuningPolicySpec,
    KVTuningPolicyStatus,
    PredictionStatus,
    SecretKeyRef,
    state_from_status,
    state_to_status,
)
from kvtune.operator.diagnosis import Diagnosis
from kvtune.operator.engine_view import KNOB_KV_CACHE_DTYPE, KNOB_MAX_NUM_SEQS, KNOB_MAX_TOKENS_CAP
from kvtune.operator.events import EventSpec, PolicyRef, post_event
from kvtune.operator.k8s_actuator import WorkloadArgsActuator
from kvtune.operator.kube_api import KubeApi, KubeError
from kvtune.operator.ladder import Remedy, flag_prefix_defeat, recommend_fp8_kv
from kvtune.operator.local import Tick, step, window_length
from kvtune.operator.own_metrics import (
    ERROR_ACTUATOR,
    ERROR_EVENT_POST,
    ERROR_PROXY_METRICS,
    ERROR_STATUS_WRITE,
    Evaluation,
    OperatorMetrics,
    evaluation_of,
)
from kvtune.operator.pods import Pod, PodEndpointsSource, PooledSource, pod_url
from kvtune.operator.policy import TuningPolicy
from kvtune.operator.pooling import PoolState, worst_pod_line
from kvtune.operator.prediction import PredictionState, objective_of
from kvtune.operator.sample import NoData, Sample
from kvtune.operator.secret_cache import SecretCache
from kvtune.operator.sources import EngineWithProxy, MetricsEndpoint, MetricSource, PrometheusSource
from kvtune.operator.tuner import Figures, HistoryEntry, TunerState
from kvtune.operator.workload import (
    is_workload,
    pod_statuses,
    pods_admin_actuator,
    pods_proxy_actuator,
    workload_pods,
    workload_source,
)

logger = logging.getLogger("kvtune.operator")

EVENT_REASONS = {
    "applied": ("Normal", "TuningApplied"),
    "rolled_back": ("Warning", "TuningRolledBack"),
    "recommended": ("Normal", "TuningRecommended"),
    "flagged": ("Warning", "PrefixCacheDefeated"),
}
FIELDS = {
    KNOB_MAX_NUM_SEQS: "max_num_seqs",
    KNOB_MAX_TOKENS_CAP: "max_tokens_cap",
    KNOB_KV_CACHE_DTYPE: "kv_cache_dtype",
}


class UnavailableActuator:
    """Stands in when the real actuator cannot be built (a missing Secret): diagnosis and recommendations
    continue, nothing is applied. It holds no knob, so inside a ComposedActuator the knobs it stands for
    become recommendations and the ladder moves on to the knobs the other parts can change."""

    knobs: frozenset[str] = frozenset()

    def __init__(self, error: str) -> None:
        self.error = error

    def current(self) -> ActuatorResult:
        return ActuatorResult(False, {}, self.error)

    def apply(self, knob: str, value: int | str | None) -> ActuatorResult:
        return ActuatorResult(False, {}, self.error)


@dataclass
class PolicyMemory:
    """What the operator keeps between evaluations of one policy: the tuner state (also in status, to
    resume), the sample window (memory only: rebuilt within a few intervals), the last conditions and the
    Secrets read (re-read only when they change)."""

    state: TunerState = field(default_factory=TunerState)
    samples: deque[Sample] = field(default_factory=deque)
    conditions: dict[str, Condition] = field(default_factory=dict)
    recommended: KnobValues | None = None
    no_data: bool = False
    actuator_error: str | None = None
    proxy_problem: str | None = None  # why the proxy's /metrics could not be read at the last evaluation
    secrets: SecretCache = field(default_factory=SecretCache)
    pool: PoolState = field(default_factory=PoolState)  # many pods: each pod's last figures, pooled totals
    pod_findings: tuple[str, ...] = ()  # pods' disagreements and unreadable pods at the last evaluation

    @staticmethod
    def resume(status: dict[str, Any] | None) -> PolicyMemory:
        try:
            saved = KVTuningPolicyStatus.model_validate(status or {})
        except ValueError as err:
            logger.warning("ignoring an unreadable status: %s", err)
            return PolicyMemory()
        return PolicyMemory(
            state=state_from_status(saved),
            conditions={c.type: c for c in saved.conditions},
            recommended=saved.recommended,
        )


def source_for(spec: KVTuningPolicySpec) -> MetricSource:
    metrics = spec.metrics
    assert metrics is not None  # the model requires metrics unless the target's pods are read
    if metrics.prometheus is not None:
        return PrometheusSource(metrics.prometheus.url, metrics.prometheus.selector)
    assert metrics.metrics_url is not None  # the model guarantees exactly one
    if metrics.proxy_metrics_url is not None:
        return EngineWithProxy(
            MetricsEndpoint(metrics.metrics_url), MetricsEndpoint(metrics.proxy_metrics_url)
        )
    return MetricsEndpoint(metrics.metrics_url)


def secret_token(
    api: KubeApi, namespace: str, secrets: SecretCache, ref: SecretKeyRef, name: str
) -> str | UnavailableActuator:
    """The bearer token of the admin API called `name`, or an UnavailableActuator saying why it is not."""
    try:
        return secrets.value(api, namespace, ref.name, ref.key)
    except KubeError as err:
        return UnavailableActuator(f"{name} token secret {namespace}/{ref.name}: {err}")


def admin_actuator(
    api: KubeApi, namespace: str, secrets: SecretCache, url: str, ref: SecretKeyRef, knobs: frozenset[str],
    name: str,
) -> Actuator:  # fmt: skip
    """The admin API at `url`, with its bearer token from the Secret (unavailable while it cannot be read)."""
    token = secret_token(api, namespace, secrets, ref, name)
    if isinstance(token, UnavailableActuator):
        return token
    return KvtuneAdminActuator(url, token, knobs=knobs, name=name)


def engine_base_url(spec: KVTuningPolicySpec, pods: list[Pod] | NoData | None) -> str | None:
    """Where the engine's own HTTP API (its `/version`) answers: beside its metricsUrl, or on the first
    ready pod of target.podEndpoints; None when only Prometheus knows the engine."""
    if spec.metrics is not None and spec.metrics.metrics_url is not None:
        return spec.metrics.metrics_url.rstrip("/").removesuffix("/metrics")
    endpoints = spec.target.pod_endpoints
    if endpoints is not None and isinstance(pods, list) and pods:
        return pod_url(endpoints.scheme, pods[0], endpoints.metrics_port)
    return None


def actuator_for(
    api: KubeApi, spec: KVTuningPolicySpec, namespace: str, secrets: SecretCache,
    pods: list[Pod] | NoData | None = None,
) -> Actuator:  # fmt: skip
    """A kvtune engine: its admin API, or every pod's (`pods`, with target.podEndpoints). vLLM / SGLang: the
    Deployment's args for max_num_seqs (one patch, one rolling restart, however many pods), and with a
    kvtune proxy in front, the proxy's admin API for the max_tokens cap (live, so the cap never restarts
    the engine): one proxy's (proxyAdminUrl), or every pod's proxy sidecar (podEndpoints.proxyPort)."""
    target = spec.target
    if target.engine == "kvtune" and target.pod_endpoints is not None:
        assert target.admin_token_secret_ref is not None and pods is not None
        token = secret_token(api, namespace, secrets, target.admin_token_secret_ref, "admin API")
        if isinstance(token, UnavailableActuator):
            return token
        return pods_admin_actuator(pods, target.pod_endpoints, token)
    if target.engine == "kvtune":
        assert target.admin_url is not None and target.admin_token_secret_ref is not None
        return admin_actuator(api, namespace, secrets, target.admin_url, target.admin_token_secret_ref,
                              ENGINE_KNOBS, "admin API")  # fmt: skip
    version_url = engine_base_url(spec, pods)
    deployment = WorkloadArgsActuator(api, target.kind, namespace, target.name, target.container, target.engine,
                                      target.admission_flag, version_url)  # fmt: skip
    sidecars = target.pod_endpoints if target.pod_endpoints and target.pod_endpoints.proxy_port else None
    if target.proxy_admin_url is None and sidecars is None:
        return deployment
    ref = target.proxy_admin_token_secret_ref
    assert ref is not None  # the model requires it with proxyAdminUrl and with podEndpoints.proxyPort
    proxy: Actuator
    if sidecars is not None:
        assert pods is not None  # listed whenever the target has podEndpoints
        token = secret_token(api, namespace, secrets, ref, "proxy admin API")
        proxy = (
            token if isinstance(token, UnavailableActuator) else pods_proxy_actuator(pods, sidecars, token)
        )
    else:
        assert target.proxy_admin_url is not None
        proxy = admin_actuator(api, namespace, secrets, target.proxy_admin_url, ref, PROXY_KNOBS,
                               "proxy admin API")  # fmt: skip
    return ComposedActuator([proxy, deployment])


def unavailable(actuator: Actuator) -> str | None:
    """Why (part of) the actuator could not be built, or None."""
    parts = actuator.parts if isinstance(actuator, ComposedActuator) else [actuator]
    errors = [part.error for part in parts if isinstance(part, UnavailableActuator)]
    return "; ".join(errors) or None


def admission_flag_of(actuator: Actuator) -> str | None:
    """The vLLM flag the workload actuator reads and patches, and why (for Events and status)."""
    parts = actuator.parts if isinstance(actuator, ComposedActuator) else [actuator]
    for part in parts:
        if isinstance(part, WorkloadArgsActuator) and part.flag_choice is not None:
            return f"{part.flag_choice.flag} ({part.flag_choice.why})"
    return None


def _figures(figures: Figures | None) -> str:
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
        f"before: {_figures(entry.before_figures)}"
    )
    if entry.after_figures is not None:
        message += f"; after: {_figures(entry.after_figures)}"
    return EventSpec(kind, reason, message, entry.remedy.value)


def _condition(
    memory: PolicyMemory, kind: ConditionType, status: ConditionStatus, reason: str, message: str, now: float
) -> Condition:
    before = memory.conditions.get(kind)
    changed = before is None or before.status != status
    when = datetime.fromtimestamp(now, UTC) if changed or before is None else before.last_transition_time
    return Condition(type=kind, status=status, reason=reason, message=message, last_transition_time=when)


def conditions_for(
    memory: PolicyMemory,
    diagnosis: Diagnosis | None,
    no_data: str | None,
    prefix_defeated: tuple[bool, str],
    fp8: tuple[bool, str],
    now: float,
) -> list[Condition]:
    if diagnosis is None or diagnosis.status == "no_data":
        reason = no_data or (
            diagnosis.findings[0].evidence if diagnosis and diagnosis.findings else "no data"
        )
        return [_condition(memory, kind, "Unknown", "NoData", reason, now) for kind in CONDITION_TYPES]
    d = diagnosis
    if d.preemption_rate is None:
        preempting = _condition(
            memory, "Preempting", "Unknown", "WaitingForSamples", "rates need two samples", now
        )
    elif d.preempting:
        preempting = _condition(
            memory, "Preempting", "True", "PreemptionsObserved",
            f"{d.preemption_rate:.2f} preemptions/s over {d.window_seconds:.0f} s", now,
        )  # fmt: skip
    else:
        preempting = _condition(
            memory, "Preempting", "False", "NoPreemptions", f"over {d.window_seconds:.0f} s", now
        )
    kv = f"KV usage max {d.kv_usage_max or 0:.0%}, waiting max {d.waiting_max or 0:.0f}"
    saturated = _condition(
        memory, "KVSaturated", "True" if d.saturated else "False",
        "KVCacheFull" if d.saturated else "KVHeadroom", kv, now,
    )  # fmt: skip
    defeated, defeat_evidence = prefix_defeated
    prefix = _condition(
        memory, "PrefixCacheDefeated", "True" if defeated else "False",
        ("PrefixDefeatsReported" if d.prefix_defeats else "LowPrefixHitRate") if defeated else "NotDetected",
        defeat_evidence, now,
    )  # fmt: skip
    recommended, fp8_evidence = fp8
    fp8_condition = _condition(
        memory, "FP8Recommended", "True" if recommended else "False",
        "PressurePersists" if recommended else "NotNeeded", fp8_evidence, now,
    )  # fmt: skip
    unknown = d.preemption_rate is None
    stable = not unknown and not d.preempting and not d.saturated
    stable_condition = _condition(
        memory, "Stable", "Unknown" if unknown else ("True" if stable else "False"),
        "WaitingForSamples" if unknown else (("Idle" if d.status == "idle" else "NoPressure") if stable else "Pressure"),
        kv, now,
    )  # fmt: skip
    return [preempting, saturated, prefix, fp8_condition, stable_condition]


def _knobs(values: dict[str, int | str | None]) -> KnobValues:
    fields = {FIELDS[k]: v for k, v in values.items() if k in FIELDS and v is not None}
    return KnobValues.model_validate(fields)


def patch_body(value: Any, in_list: bool = False) -> Any:
    """A merge-patch body from a full dump: nulls stay on object fields (so stale keys are deleted), and
    are dropped inside list items (a list is replaced whole, and null is not a valid item value)."""
    if isinstance(value, dict):
        return {k: patch_body(v, in_list) for k, v in value.items() if not (in_list and v is None)}
    if isinstance(value, list):
        return [patch_body(item, True) for item in value]
    return value


def condition_states(conditions: list[Condition]) -> dict[str, bool | None]:
    return {c.type: {"True": True, "False": False}.get(c.status) for c in conditions}


def recommended_knobs(recommended: KnobValues | None) -> dict[str, int | None]:
    """The knobs the status recommends (a knob it does not name is advised at its current value)."""
    if recommended is None:
        return {}
    values = {KNOB_MAX_NUM_SEQS: recommended.max_num_seqs, KNOB_MAX_TOKENS_CAP: recommended.max_tokens_cap}
    return {knob: value for knob, value in values.items() if value is not None}


@dataclass(frozen=True)
class Outcome:
    tick: Tick
    status: KVTuningPolicyStatus
    events: tuple[EventSpec, ...]
    evaluation: Evaluation  # what the operator's own /metrics record of this tick


def follow_tick(
    memory: PolicyMemory, tick: Tick, policy: TuningPolicy, now: float
) -> tuple[KnobValues | None, list[Condition]]:
    """Carry one tick into `memory`: the recommendations (merged, dropped once Stable) and the conditions.
    Returns the knobs the engine holds (None without data) and the conditions. The --local loop keeps a
    PolicyMemory of its own for this too, so its metrics say what a KVTuningPolicy's status would."""
    diagnosis = tick.decision.diagnosis if tick.decision else None
    current: KnobValues | None = None
    prefix = fp8 = (False, "")
    if tick.engine is not None and diagnosis is not None:
        view = tick.engine
        current = _knobs({KNOB_MAX_NUM_SEQS: view.max_num_seqs, KNOB_MAX_TOKENS_CAP: view.max_tokens_cap,
                          KNOB_KV_CACHE_DTYPE: view.cache_dtype})  # fmt: skip
        flag = flag_prefix_defeat(diagnosis, view, policy)
        prefix = (flag.applicable, flag.evidence)
        advice = recommend_fp8_kv(diagnosis, view, policy)
        reached = any(h.remedy is Remedy.RECOMMEND_FP8_KV for h in tick.state.history)
        fp8 = (advice.applicable and reached, advice.evidence)
    if tick.decision is not None:
        proposed: dict[str, int | str | None] = {
            a.knob: a.recommended for a in tick.decision.advice if a.knob
        }
        proposed.update({c.knob: c.value for c in tick.decision.changes})
        if proposed:
            merged = {**(memory.recommended.dump() if memory.recommended else {}), **_knobs(proposed).dump()}
            memory.recommended = KnobValues.model_validate(merged)
    conditions = conditions_for(memory, diagnosis, tick.no_data, prefix, fp8, now)
    memory.conditions = {c.type: c for c in conditions}
    if any(c.type == "Stable" and c.status == "True" for c in conditions):
        memory.recommended = None
    return current, conditions


def held_by_pod(actuator: Actuator) -> dict[str, dict[str, int | None]]:
    """What each pod's admin API (its engine's, or its proxy sidecar's) last said it holds (empty when the
    knobs are not set pod by pod)."""
    parts = actuator.parts if isinstance(actuator, ComposedActuator) else [actuator]
    held: dict[str, dict[str, int | None]] = {}
    for part in parts:
        if isinstance(part, FanOutActuator):
            for pod, values in part.held.items():
                held.setdefault(pod, {}).update(values)
    return held


def proxy_problem_of(source: MetricSource) -> str | None:
    """Why a kvtune proxy's /metrics could not be read at this evaluation: the one proxy beside the engine,
    or the pods whose proxy sidecar did not answer."""
    if isinstance(source, EngineWithProxy):
        return source.proxy_problem
    if isinstance(source, PooledSource) and isinstance(source.pods, PodEndpointsSource):
        return source.pods.proxy_problem
    return None


def follow_pods(
    memory: PolicyMemory, source: PooledSource, actuator: Actuator, tick: Tick
) -> tuple[list[EventSpec], str | None]:
    """Carry one evaluation of many pods into `memory` (the pool state) and say what changed among the pods
    (restarts, disagreements, unreadable pods: an Event each time the findings change), and name the worst
    pod of the window."""
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
    _, worst = pod_statuses(memory.pool, tick.evidence_since, held_by_pod(actuator))
    return events, (worst_pod_line(worst) if worst is not None and tick.no_data is None else None)


def name_worst_pod(state: TunerState, previous: TunerState, worst: str) -> TunerState:
    """The history entries this evaluation added, with the worst pod in their evidence."""
    seen = {(h.at, h.kind, h.remedy, h.knob) for h in previous.history}
    history = tuple(
        h if (h.at, h.kind, h.remedy, h.knob) in seen else replace(h, evidence=f"{h.evidence}; {worst}")
        for h in state.history
    )
    return replace(state, history=history)


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


def prediction_status(
    policy: TuningPolicy, state: PredictionState, diagnosis: Diagnosis | None
) -> PredictionStatus | None:
    if not policy.predict:
        return None
    rate = diagnosis.preemption_rate if diagnosis is not None else None
    return PredictionStatus.of(
        state, objective_of(policy).describe(), policy.round_to, rate * 60 if rate is not None else None
    )


def evaluate(
    api: KubeApi,
    policy_ref: PolicyRef,
    spec: KVTuningPolicySpec,
    memory: PolicyMemory,
    now: float,
    generation: int | None = None,
) -> Outcome:
    """One step for one policy; updates `memory`, returns the status to write and the Events to post."""
    policy: TuningPolicy = spec.to_policy()
    keep = window_length(policy, float(spec.interval_seconds))
    if memory.samples.maxlen != keep:
        memory.samples = deque(memory.samples, maxlen=keep)
    pods = workload_pods(api, policy_ref.namespace, spec)
    actuator = actuator_for(api, spec, policy_ref.namespace, memory.secrets, pods)
    events: list[EventSpec] = []
    actuator_error = unavailable(actuator)
    if actuator_error and actuator_error != memory.actuator_error:
        events.append(EventSpec("Warning", "ActuatorUnavailable", actuator_error))
    memory.actuator_error = actuator_error
    previous = memory.state
    workload = is_workload(spec)
    horizon = keep * float(spec.interval_seconds)
    source = workload_source(spec, pods, memory.pool, horizon) if workload else source_for(spec)
    tick = step(source, actuator, policy, previous, memory.samples, now)
    pod_events, worst = (
        follow_pods(memory, source, actuator, tick) if isinstance(source, PooledSource) else ([], None)
    )
    if worst is not None:
        tick = replace(tick, state=name_worst_pod(tick.state, previous, worst))
    events += pod_events
    proxy_problem = proxy_problem_of(source)
    if proxy_problem and not memory.proxy_problem:
        events.append(EventSpec("Warning", "ProxyMetricsMissing",
                                f"the proxy's /metrics (defeat and cap series) cannot be read: {proxy_problem}"))  # fmt: skip
    memory.proxy_problem = proxy_problem
    seen = {(h.at, h.kind, h.remedy, h.knob) for h in previous.history}
    flag = admission_flag_of(actuator)
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
    events += prediction_events(previous.prediction, tick.state.prediction)
    if tick.no_data and not memory.no_data:
        events.append(EventSpec("Warning", "NoMetrics", f"no data from the metrics source: {tick.no_data}"))
    memory.no_data = tick.no_data is not None
    memory.state = tick.state

    current, conditions = follow_tick(memory, tick, policy, now)
    tuner, history = state_to_status(tick.state)
    errors = ((ERROR_ACTUATOR,) if actuator_error else ()) + ((ERROR_PROXY_METRICS,) if proxy_problem else ())
    evaluation = evaluation_of(previous, tick, condition_states(conditions),
                               recommended_knobs(memory.recommended), errors,
                               policy.objective if policy.predict else None)  # fmt: skip
    note = tick.decision.note if tick.decision else f"no data: {tick.no_data}"
    pods_status, worst_pod = (
        pod_statuses(memory.pool, tick.evidence_since, held_by_pod(actuator)) if workload else ([], None)
    )
    if worst is not None:
        note = f"{note}; {worst}"
    status = KVTuningPolicyStatus(
        observed_generation=generation,
        last_evaluation_time=datetime.fromtimestamp(now, UTC),
        note=note,
        conditions=conditions,
        current=current,
        recommended=memory.recommended,
        desired=DesiredValues.of(tick.state.desired),
        history=history,
        tuner_state=tuner,
        pods=pods_status,
        worst_pod=worst_pod.name if worst_pod else None,
        admission_flag=flag,
        prediction=prediction_status(
            policy, tick.state.prediction, tick.decision.diagnosis if tick.decision else None
        ),
    )
    return Outcome(tick, status, tuple(events), evaluation)


def write(api: KubeApi, policy_ref: PolicyRef, outcome: Outcome, now: float) -> tuple[str, ...]:
    """Patch the status subresource and post the Events; failures are logged (the next tick retries) and
    returned as error kinds for the operator's metrics."""
    failed: list[str] = []
    body = patch_body({"status": outcome.status.model_dump(mode="json", by_alias=True)})
    try:
        api.patch_policy_status(policy_ref.namespace, policy_ref.name, body)
    except KubeError as err:
        logger.error("could not write the status of %s/%s: %s", policy_ref.namespace, policy_ref.name, err)
        failed.append(ERROR_STATUS_WRITE)
    for event in outcome.events:
        error = post_event(api, policy_ref, event, now)
        if error:
            logger.error("could not post event %s: %s", event.reason, error)
            failed.append(ERROR_EVENT_POST)
    return tuple(failed)


def run_once(
    api: KubeApi,
    policy_ref: PolicyRef,
    spec: KVTuningPolicySpec,
    memory: PolicyMemory,
    now: float,
    generation: int | None = None,
    metrics: OperatorMetrics | None = None,
) -> Outcome:
    """Evaluate, write, and record the tick (with any write failures) in the operator's own metrics."""
    outcome = evaluate(api, policy_ref, spec, memory, now, generation)
    failed = write(api, policy_ref, outcome, now)
    outcome = replace(
        outcome, evaluation=replace(outcome.evaluation, errors=outcome.evaluation.errors + failed)
    )
    if metrics is not None:
        metrics.record(policy_ref.namespace, policy_ref.name, outcome.evaluation)
    return outcome
