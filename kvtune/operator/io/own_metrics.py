"""The operator's own /metrics: what it did (actions by remedy and result, rollbacks), what it holds and
advises (current and recommended knobs, the ladder's rung, the conditions, the concurrency ceilings), when
it last evaluated and how often it should, and when it could not act (errors, no data). Dashboards draw
actions as annotations from `kvtune_operator_last_action_timestamp_seconds` and `changes()` of the actions
counter; the `KVTuneOperatorCannotAct` alert reads the error and no-data counters, `KVTuneOperatorStalled`
the last evaluation against the interval, `KVTuneOperatorDown` the absence of `kvtune_operator_info`,
which every running operator exports from its start, policies or not, `KVTuneRollback` the rollbacks
counter, and `KVTuneRecommendationPending` since when a knob's advice has differed from the engine's value.

The tuner and the ladder stay pure: the loop's edges (k8s.reconcile for kopf, io.local_metrics for --local) turn
each tick into an `Evaluation` with `evaluation_of` and hand it to `OperatorMetrics.record`. The registry is
the operator's own, served by prometheus_client's small HTTP server, so no web framework rides along.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.metrics_core import Metric

from kvtune import __version__
from kvtune.contract.knobs import KNOB_MAX_NUM_SEQS, KNOB_MAX_TOKENS_CAP
from kvtune.core.predict import OBJECTIVES
from kvtune.operator.decide.ladder import LADDER, Remedy
from kvtune.operator.decide.loop import Tick
from kvtune.operator.decide.status import CONDITION_TYPES
from kvtune.operator.decide.tuner import TunerState

DEFAULT_PORT = 9100
# the actions counter's remedies: the ladder's rungs and the what-if model's predicted move
REMEDIES = (*LADDER, Remedy.PREDICT_MAX_NUM_SEQS)
KNOBS = (KNOB_MAX_NUM_SEQS, KNOB_MAX_TOKENS_CAP)
ACTION_RESULTS = ("applied", "recommended", "failed", "rolled_back", "undone")
# a history entry's kind -> the actions counter's result (a flag is advice, like a recommendation)
RESULTS = {
    "applied": "applied",
    "rolled_back": "rolled_back",
    "recommended": "recommended",
    "flagged": "recommended",
    "undone": "undone",
}
# the diagnosis' conditions, and the operator's own: below its spec.mode, no actuator, a change held by the
# restart budget, and Ready, which sums them up
CONDITIONS = (*CONDITION_TYPES, "ModeCapped", "ActuatorUnavailable", "ChangeHeld", "Ready")

# errors_total's kinds
ERROR_APPLY = "apply"  # the actuator refused a change the tuner decided
ERROR_REAPPLY = "reapply"  # a value the operator holds could not be put back
ERROR_ACTUATOR = "actuator_unavailable"  # the actuator could not be built (a missing Secret)
ERROR_PROXY_METRICS = "proxy_metrics"  # the proxy's /metrics (defeats, cap) could not be read
ERROR_STATUS_WRITE = "status_write"  # the KVTuningPolicy's status could not be patched
ERROR_EVENT_POST = "event_post"  # a Kubernetes Event could not be posted
ERROR_KUBERNETES = "kubernetes"  # another Kubernetes API failure stopped the evaluation
ERROR_EVALUATION = "evaluation"  # an unexpected exception stopped the evaluation
ERROR_INVALID_SPEC = "invalid_spec"  # the KVTuningPolicy's spec does not validate: nothing is evaluated
# the evaluation lag's buckets, seconds: from a quick tick to one that waited several 15 s intervals
LAG_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 30.0, 60.0, 120.0, 300.0)
ERROR_KINDS = (ERROR_APPLY, ERROR_REAPPLY, ERROR_ACTUATOR, ERROR_PROXY_METRICS, ERROR_STATUS_WRITE,
               ERROR_EVENT_POST, ERROR_KUBERNETES, ERROR_EVALUATION, ERROR_INVALID_SPEC)  # fmt: skip


@dataclass(frozen=True)
class Evaluation:
    """One evaluation of one policy as the operator's metrics see it. A None value is unknown: its series
    is removed rather than left at a stale value."""

    at: float
    actions: tuple[tuple[str, str], ...] = ()  # (remedy, result) taken this tick
    current: Mapping[str, int | None] | None = None  # knob -> value the engine holds (None: no data)
    recommended: Mapping[str, int | None] | None = None
    rung: int = 0  # 0 none, 1-4 the ladder's rung being worked
    conditions: Mapping[str, bool | None] | None = None  # type -> true/false/unknown (None: no data)
    ceiling_real: float | None = None
    ceiling_boot_line: float | None = None
    errors: tuple[str, ...] = ()  # error kinds met this tick
    no_data: bool = False
    interval_s: float | None = None  # how often the policy is evaluated (the stall alert's yardstick)
    corrupt: tuple[
        str, ...
    ] = ()  # series dropped as impossible this tick (exposed names, as the doctor says)
    alternated: bool = False  # the metrics source answered from another process this tick
    # issue 28: the forecast at the value in force and the window's observed rate, per minute (None: no
    # forecast for this value, or no rate yet); the misses; the objective in force (None: prediction off)
    predicted_preemptions_per_min: float | None = None
    observed_preemptions_per_min: float | None = None
    prediction_misses: int | None = None
    objective: str | None = None
    # issue 36: the replicas the demand needs and demand ÷ one replica's capacity (None: no signal, or
    # withdrawn: two autoscalers on the workload)
    desired_replicas: int | None = None
    demand_capacity_ratio: float | None = None
    # knob -> when the policy's history recommended the value advised now: a pending recommendation's clock
    # starts there after an operator restart (the history survives it in the policy's status)
    recommended_at: Mapping[str, float] | None = None


def recommended_at(state: TunerState, advised: Mapping[str, int | None]) -> dict[str, float]:
    """knob -> the time of the latest "recommended" history entry for the value advised now."""
    found: dict[str, float] = {}
    for entry in state.history:
        knob = entry.knob
        if knob is None or entry.kind != "recommended":
            continue
        if knob in advised and entry.after == advised[knob]:
            found[knob] = entry.at
    return found


def actions_of(previous: TunerState, tick: Tick) -> tuple[tuple[str, str], ...]:
    """(remedy, result) for every action of the tick: the history entries it added, and the changes the
    actuator refused (those leave the state, hence the history, as it was)."""
    seen = {(h.at, h.kind, h.remedy, h.knob) for h in previous.history}
    done = [
        (h.remedy.value, RESULTS.get(h.kind, h.kind))
        for h in tick.state.history
        if (h.at, h.kind, h.remedy, h.knob) not in seen
    ]
    done += [(change.remedy.value, "failed") for change, result in tick.applied if not result.ok]
    return tuple(done)


def rung_of(state: TunerState) -> int:
    return LADDER.index(state.rung) + 1 if state.rung is not None else 0


def errors_of(tick: Tick) -> tuple[str, ...]:
    failed = [ERROR_APPLY for _, result in tick.applied if not result.ok]
    failed += [ERROR_REAPPLY for _, _, result in tick.reapplied if not result.ok]
    return tuple(failed)


def evaluation_of(
    previous: TunerState,
    tick: Tick,
    conditions: Mapping[str, bool | None],
    recommended: Mapping[str, int | None],
    errors: tuple[str, ...] = (),
    objective: str | None = None,
) -> Evaluation:
    """The metrics' view of a tick. `recommended` holds the knobs the operator advises now; a knob it does
    not name is advised at its current value (nothing to change), so current and recommended lines meet
    on a dashboard when the operator is content and part where it wants a change. A missing cap is 0, as
    on the engine's own `kvtune:max_tokens_cap`."""
    corrupt = tuple(sorted({name for name, _ in tick.decision.diagnosis.corrupt})) if tick.decision else ()
    base = Evaluation(at=tick.at, actions=actions_of(previous, tick), rung=rung_of(tick.state),
                      errors=errors_of(tick) + errors, corrupt=corrupt,
                      alternated=tick.alternation is not None)  # fmt: skip
    if tick.no_data is not None or tick.engine is None or tick.decision is None:
        return replace(base, no_data=tick.no_data is not None)
    engine, d = tick.engine, tick.decision.diagnosis
    current = {KNOB_MAX_NUM_SEQS: engine.max_num_seqs, KNOB_MAX_TOKENS_CAP: engine.max_tokens_cap or 0}
    advised = {knob: recommended.get(knob, current[knob]) for knob in KNOBS}
    if advised[KNOB_MAX_TOKENS_CAP] is None:
        advised[KNOB_MAX_TOKENS_CAP] = 0
    prediction = tick.state.prediction
    forecast = prediction.forecast
    predicted = (
        forecast.preemptions_per_min
        if forecast is not None and forecast.value == engine.max_num_seqs
        else None
    )
    observed = d.preemption_rate * 60 if d.preemption_rate is not None else None
    return replace(base, current=current, recommended=advised, conditions=conditions,
                   ceiling_real=d.real_concurrency_ceiling, ceiling_boot_line=d.boot_line_concurrency,
                   predicted_preemptions_per_min=predicted, observed_preemptions_per_min=observed,
                   prediction_misses=prediction.misses, objective=objective,
                   recommended_at=recommended_at(tick.state, advised))  # fmt: skip


class OperatorMetrics:
    """The contract's series on a registry of their own; `record` is the only writer."""

    def __init__(self, max_mode: str = "Apply", clock: Callable[[], float] = time.time) -> None:
        self.registry = CollectorRegistry()
        self._lock = threading.Lock()
        self._clock = clock
        r = self.registry
        self.info = Gauge("kvtune_operator_info", "1 while the operator runs: its version and the highest "
                          "mode it lets a policy run in", ["version", "max_mode"], registry=r)  # fmt: skip
        self.info.labels(__version__, max_mode).set(1)
        self.actions = Counter("kvtune_operator_actions", "Actions the operator took, by remedy and result "
                               "(applied, recommended, failed, rolled_back, undone)",
                               ["namespace", "policy", "remedy", "result"], registry=r)  # fmt: skip
        self.last_action = Gauge("kvtune_operator_last_action_timestamp_seconds",
                                 "When the operator last acted on a remedy (a Grafana annotation source)",
                                 ["namespace", "policy", "remedy"], registry=r)  # fmt: skip
        self.knob = Gauge("kvtune_operator_knob", "The engine's knob (current) and the operator's advice "
                          "(recommended); max_tokens_cap 0 is no cap", ["namespace", "policy", "knob", "kind"],
                          registry=r)  # fmt: skip
        self.rung = Gauge("kvtune_operator_ladder_rung", "The remedy ladder's rung being worked: 0 none, "
                          "1 cap max_tokens, 2 lower max_num_seqs, 3 flag prefix defeats, 4 recommend FP8 KV",
                          ["namespace", "policy"], registry=r)  # fmt: skip
        self.condition = Gauge("kvtune_operator_condition", "A KVTuningPolicy condition: 1 true, 0 false "
                               "(absent while unknown)", ["namespace", "policy", "type"], registry=r)  # fmt: skip
        self.ceiling = Gauge("kvtune_operator_concurrency_ceiling", "Concurrent requests the KV pool holds: "
                             "real (from request footprints) and boot_line (pool / max_model_len)",
                             ["namespace", "policy", "kind"], registry=r)  # fmt: skip
        self.last_evaluation = Gauge("kvtune_operator_last_evaluation_timestamp_seconds",
                                     "When the operator last evaluated the policy", ["namespace", "policy"],
                                     registry=r)  # fmt: skip
        self.interval = Gauge("kvtune_operator_evaluation_interval_seconds", "How often the operator "
                              "evaluates the policy (its intervalSeconds)", ["namespace", "policy"],
                              registry=r)  # fmt: skip
        self.errors = Counter("kvtune_operator_errors", "Evaluations that met an error, by kind",
                              ["namespace", "policy", "kind"], registry=r)  # fmt: skip
        self.no_data = Counter("kvtune_operator_no_data", "Evaluations without data from the metrics source",
                               ["namespace", "policy"], registry=r)  # fmt: skip
        self.rollbacks = Counter("kvtune_operator_rollbacks", "Changes the operator rolled back",
                                 ["namespace", "policy"], registry=r)  # fmt: skip
        self.preemptions = Gauge("kvtune_operator_preemptions_per_minute", "Preemptions per minute at the "
                                 "max_num_seqs in force: predicted by the what-if model (absent without a "
                                 "forecast for that value) and observed over the last window",
                                 ["namespace", "policy", "kind"], registry=r)  # fmt: skip
        self.misses = Gauge("kvtune_operator_prediction_misses", "Forecasts an evaluation window contradicted "
                            "(two: measured stepping)", ["namespace", "policy"], registry=r)  # fmt: skip
        self.objective = Gauge("kvtune_operator_objective", "The objective in force (1 on its label; absent "
                               "with prediction off)", ["namespace", "policy", "objective"], registry=r)  # fmt: skip
        self.desired_replicas = Gauge("kvtune_operator_desired_replicas", "Replicas the observed demand needs "
                                      "at the policy's objective (for KEDA or an HPA; absent: no signal)",
                                      ["namespace", "policy"], registry=r)  # fmt: skip
        self.load_ratio = Gauge("kvtune_operator_demand_capacity_ratio", "The workload's demand ÷ the most one "
                                "replica holds at the policy's objective", ["namespace", "policy"], registry=r)  # fmt: skip
        self.corrupt = Gauge("kvtune_operator_corrupt_series", "1 for each engine series the last evaluation "
                             "dropped as impossible (NaN, infinite, a negative counter, ...): never used as a "
                             "figure", ["namespace", "policy", "series"], registry=r)  # fmt: skip
        self.alternations = Counter("kvtune_operator_source_alternations", "Samples that came from another "
                                    "process than the one followed (the metrics URL answers from more than "
                                    "one process): nothing is acted on until it answers from one",
                                    ["namespace", "policy"], registry=r)  # fmt: skip
        self.pending = Gauge("kvtune_operator_recommendation_pending_since_timestamp_seconds", "Since when "
                             "the operator has advised a knob value the engine does not run (absent while "
                             "they agree): the age of a recommendation nobody applied",
                             ["namespace", "policy", "knob"], registry=r)  # fmt: skip
        self.lag = Histogram("kvtune_operator_evaluation_lag_seconds", "From when a policy's interval ran out "
                             "(its last recorded evaluation + intervalSeconds) to when its next evaluation was "
                             "recorded: the tick's wait for a worker and its own duration", registry=r,
                             buckets=LAG_BUCKETS)  # fmt: skip
        self.api_requests = Counter("kvtune_operator_kube_api_requests", "The operator's own Kubernetes API "
                                    "requests (kopf's watches and peering apart), by verb and HTTP code (0: no "
                                    "answer)", ["verb", "code"], registry=r)  # fmt: skip
        self.api_throttled = Counter("kvtune_operator_kube_api_throttled_seconds", "Seconds its requests "
                                     "waited on the client-side rate limit (--kube-api-qps, --kube-api-burst)",
                                     registry=r)  # fmt: skip
        self._due: dict[tuple[str, str], float] = {}  # policy -> when its next evaluation is due
        self._corrupt_seen: dict[tuple[str, str], tuple[str, ...]] = {}  # policy -> its corrupt series
        self._pending_since: dict[tuple[str, str, str], float] = {}  # (namespace, policy, knob) -> since
        self._pending_judged: set[tuple[str, str, str]] = set()  # told pending or not since this start

    def api_request(self, verb: str, code: int, waited_s: float) -> None:
        """One request of the operator's Kubernetes client (KubeApi's observer)."""
        self.api_requests.labels(verb, str(code)).inc()
        if waited_s > 0:
            self.api_throttled.inc(waited_s)

    def declare(self, namespace: str, policy: str) -> None:
        """Start the policy's counters at 0: `increase()` and `changes()` miss the first step of a series
        that appears already at 1, which would hide a policy's first action or first error."""
        self.no_data.labels(namespace, policy)
        self.rollbacks.labels(namespace, policy)
        self.alternations.labels(namespace, policy)
        for kind in ERROR_KINDS:
            self.errors.labels(namespace, policy, kind)
        for remedy in REMEDIES:
            for result in ACTION_RESULTS:
                self.actions.labels(namespace, policy, remedy.value, result)

    def record(self, namespace: str, policy: str, evaluation: Evaluation) -> None:
        with self._lock:
            self._record_lag(namespace, policy, evaluation.interval_s)
            self.declare(namespace, policy)
            self.last_evaluation.labels(namespace, policy).set(evaluation.at)
            self._set(self.interval, (namespace, policy), evaluation.interval_s)
            for remedy, result in evaluation.actions:
                self.actions.labels(namespace, policy, remedy, result).inc()
                self.last_action.labels(namespace, policy, remedy).set(evaluation.at)
                if result == "rolled_back":
                    self.rollbacks.labels(namespace, policy).inc()
            for kind in evaluation.errors:
                self.errors.labels(namespace, policy, kind).inc()
            if evaluation.no_data:
                self.no_data.labels(namespace, policy).inc()
            if evaluation.alternated:
                self.alternations.labels(namespace, policy).inc()
            for series in self._corrupt_seen.get((namespace, policy), ()):
                if series not in evaluation.corrupt:
                    self._remove(self.corrupt, (namespace, policy, series))
            for series in evaluation.corrupt:
                self.corrupt.labels(namespace, policy, series).set(1)
            self._corrupt_seen[(namespace, policy)] = evaluation.corrupt
            self.rung.labels(namespace, policy).set(evaluation.rung)
            for knob in KNOBS:
                for kind, values in (
                    ("current", evaluation.current),
                    ("recommended", evaluation.recommended),
                ):
                    self._set(self.knob, (namespace, policy, knob, kind), (values or {}).get(knob))
            for kind in CONDITIONS:
                state = (evaluation.conditions or {}).get(kind)
                self._set(self.condition, (namespace, policy, kind), None if state is None else float(state))
            self._set(self.ceiling, (namespace, policy, "real"), evaluation.ceiling_real)
            self._set(self.ceiling, (namespace, policy, "boot_line"), evaluation.ceiling_boot_line)
            predicted, observed = (
                evaluation.predicted_preemptions_per_min,
                evaluation.observed_preemptions_per_min,
            )
            self._set(self.preemptions, (namespace, policy, "predicted"), predicted)
            self._set(self.preemptions, (namespace, policy, "observed"), observed)
            self._set(self.misses, (namespace, policy), evaluation.prediction_misses)
            for gauge, value in ((self.desired_replicas, evaluation.desired_replicas),
                                 (self.load_ratio, evaluation.demand_capacity_ratio)):  # fmt: skip
                if value is None:
                    self._remove(gauge, (namespace, policy))  # withdrawn: the autoscaler holds, never reads 0
                else:
                    gauge.labels(namespace, policy).set(value)
            for name in OBJECTIVES:
                self._set(
                    self.objective, (namespace, policy, name), 1.0 if evaluation.objective == name else None
                )
            self._record_pending(namespace, policy, evaluation)

    def _record_lag(self, namespace: str, policy: str, interval_s: float | None) -> None:
        """The loops wait a policy's interval after recording its evaluation, so the next one is due then;
        the lag is how late it is recorded (an evaluation that failed breaks the chain: nothing is due)."""
        now = self._clock()
        due = self._due.pop((namespace, policy), None)
        if due is not None:
            self.lag.observe(max(0.0, now - due))
        if interval_s is not None:
            self._due[(namespace, policy)] = now + interval_s

    def _record_pending(self, namespace: str, policy: str, evaluation: Evaluation) -> None:
        """Since when each knob's advice has differed from the engine's value, kept while it still differs
        (the advice may move meanwhile: still not applied), gone once they meet or nothing is advised. An
        evaluation that cannot tell (no data, the engine's value unknown) leaves it as it stands: a scrape
        gap must not restart a clock that counts days. Only the first judgement after the operator starts
        takes its start from the policy's history; later, a recommendation that appears is new."""
        if evaluation.current is None or evaluation.recommended is None:
            return
        for knob in KNOBS:
            key = (namespace, policy, knob)
            current, advised = evaluation.current.get(knob), evaluation.recommended.get(knob)
            if current is None and advised is not None:
                continue
            first = key not in self._pending_judged
            self._pending_judged.add(key)
            if advised is None or current == advised:
                self._pending_since.pop(key, None)
                self._remove(self.pending, key)
                continue
            if key not in self._pending_since:
                history = (evaluation.recommended_at or {}) if first else {}
                self._pending_since[key] = min(history.get(knob, evaluation.at), evaluation.at)
            self.pending.labels(*key).set(self._pending_since[key])

    def record_error(self, namespace: str, policy: str, kind: str) -> None:
        """An error that stopped an evaluation before it produced an Evaluation."""
        with self._lock:
            self._due.pop((namespace, policy), None)
            self.declare(namespace, policy)
            self.errors.labels(namespace, policy, kind).inc()

    def forget(self, namespace: str, policy: str) -> None:
        """Drop every series of a policy that is gone (a deleted KVTuningPolicy), rather than leave its
        last values standing."""
        remedies = [remedy.value for remedy in REMEDIES]
        children: list[tuple[Counter | Gauge, tuple[str, ...]]] = [
            (self.last_evaluation, ()), (self.interval, ()), (self.rung, ()), (self.no_data, ()),
            (self.rollbacks, ()), (self.alternations, ()),
            *[(self.actions, (remedy, result)) for remedy in remedies for result in ACTION_RESULTS],
            *[(self.last_action, (remedy,)) for remedy in remedies],
            *[(self.knob, (knob, kind)) for knob in KNOBS for kind in ("current", "recommended")],
            *[(self.condition, (kind,)) for kind in CONDITIONS],
            *[(self.ceiling, (kind,)) for kind in ("real", "boot_line")],
            *[(self.errors, (kind,)) for kind in ERROR_KINDS],
            *[(self.preemptions, (kind,)) for kind in ("predicted", "observed")], (self.misses, ()),
            *[(self.objective, (name,)) for name in OBJECTIVES],
            (self.desired_replicas, ()), (self.load_ratio, ()),
            *[(self.pending, (knob,)) for knob in KNOBS],
        ]  # fmt: skip
        with self._lock:
            self._due.pop((namespace, policy), None)
            for knob in KNOBS:
                self._pending_since.pop((namespace, policy, knob), None)
                self._pending_judged.discard((namespace, policy, knob))
            corrupt = self._corrupt_seen.pop((namespace, policy), ())
            for metric, rest in [*children, *[(self.corrupt, (series,)) for series in corrupt]]:
                self._remove(metric, (namespace, policy, *rest))

    @staticmethod
    def _remove(metric: Counter | Gauge, labels: tuple[str, ...]) -> None:
        with contextlib.suppress(KeyError):  # never set, or already removed
            metric.remove(*labels)

    @classmethod
    def _set(cls, gauge: Gauge, labels: tuple[str, ...], value: float | None) -> None:
        if value is not None:
            gauge.labels(*labels).set(value)
        else:
            cls._remove(gauge, labels)

    def collect(self) -> list[Metric]:
        """Every series at one instant: taken under the lock `record` holds, so a scrape never sees half
        an evaluation (an action counted before that tick's conditions are set)."""
        with self._lock:
            return list(self.registry.collect())

    def serve(self, port: int, address: str = "0.0.0.0") -> WSGIServer:
        """Serve /metrics on `port` in a daemon thread; returns the server (shutdown() stops it)."""
        consistent = CollectorRegistry(auto_describe=False)
        consistent.register(self)
        server, _ = start_http_server(port, address, registry=consistent)
        return server
