"""The `KVTuningPolicy` custom resource (kvtune.dev/v1alpha1) as pydantic models: the one source of the CRD
schema (`crd_yaml` generates it), of spec parsing, and of the status the operator writes. camelCase in
YAML through aliases; `to_policy` turns a spec into the pure TuningPolicy, and the tuner's state goes to and
comes back from status so a restarted operator resumes where it stopped."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Annotated, Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

from kvtune.core.objectives import default_round_to
from kvtune.core.predict import Forecast
from kvtune.operator.decide.admission_flag import AdmissionFlagChoice
from kvtune.operator.decide.ladder import Remedy
from kvtune.operator.decide.policy import Mode, ScalingPolicy, Timing, TuningPolicy, default_timing
from kvtune.operator.decide.prediction import PredictionState
from kvtune.operator.decide.restart_budget import DAY_S, MaintenanceWindow, RestartBudget
from kvtune.operator.decide.status import ConditionState, ConditionStatus, ConditionType
from kvtune.operator.decide.tuner import HISTORY_LIMIT, HistoryEntry, JudgedFigures, Pending, TunerState

GROUP = "kvtune.dev"
VERSION = "v1alpha1"
KIND = "KVTuningPolicy"
PLURAL = "kvtuningpolicies"
SINGULAR = "kvtuningpolicy"
SHORT_NAMES = ("kvtp",)

EngineType = Literal["kvtune", "vllm", "sglang"]
ModeName = Literal["Observe", "Recommend", "Apply"]
HistoryKind = Literal["applied", "rolled_back", "recommended", "flagged", "undone"]
Direction = Literal["cap", "lower", "raise", "predict"]
RemedyName = Literal[
    "cap_max_tokens", "lower_max_num_seqs", "flag_prefix_defeat", "recommend_fp8_kv", "predict_max_num_seqs"
]
ObjectiveName = Literal["NoPreemption", "Goodput"]
KnobValue = Annotated[int | str | None, Field(json_schema_extra={"x-kubernetes-int-or-string": True})]
Name = Annotated[str, Field(min_length=1, max_length=253)]


def cel(rule: str, message: str, *more: tuple[str, str]) -> dict[str, Any]:
    """CEL validation rules the API server enforces (cross-field checks a JSON schema cannot express): a
    rule and its message, then more (rule, message) pairs."""
    rules = [(rule, message), *more]
    return {"x-kubernetes-validations": [{"rule": r, "message": m} for r, m in rules]}


class CamelModel(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")

    def dump(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


class SecretKeyRef(CamelModel):
    """A key of a Secret in the policy's namespace."""

    name: Name
    key: str = Field("token", min_length=1)


class PodEndpoints(CamelModel):
    """Every pod of the workload, found through the EndpointSlices of a Service that selects them: each ready
    pod's /metrics is read and pooled, and a kvtune engine's knobs are set on each pod's admin API."""

    model_config = ConfigDict(
        json_schema_extra=cel(
            "self.metricsPath.startsWith('/')",
            "metricsPath is a path: it starts with /",
            ("!has(self.proxyAdminPort) || has(self.proxyPort)", "proxyAdminPort goes with proxyPort"),
        )
    )

    service: Name = Field(description="the Service whose EndpointSlices list the pods")
    metrics_port: int = Field(ge=1, le=65535, description="the port of each pod's /metrics")
    admin_port: int | None = Field(
        None, ge=1, le=65535, description="kvtune engines: each pod's admin API port (default metricsPort)"
    )
    scheme: Literal["http", "https"] = "http"
    metrics_path: str = Field("/metrics", min_length=1)
    proxy_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="vllm / sglang with a kvtune proxy sidecar in each pod: the proxy's port (its /metrics is "
        "merged with the pod's engine metrics; the max_tokens cap goes to its admin API on every pod)",
    )
    proxy_admin_port: int | None = Field(
        None, ge=1, le=65535, description="the proxy's --admin-port, when it has one (default proxyPort)"
    )

    @model_validator(mode="after")
    def _path(self) -> PodEndpoints:
        if not self.metrics_path.startswith("/"):
            raise ValueError("metricsPath is a path: it starts with /")
        if self.proxy_admin_port is not None and self.proxy_port is None:
            raise ValueError("proxyAdminPort goes with proxyPort")
        return self

    def proxy_admin(self) -> int | None:
        """The port of each pod's proxy admin API (None without a proxy sidecar)."""
        return self.proxy_admin_port or self.proxy_port


PROXY_URL_NEEDS_TOKEN = (
    "proxyAdminUrl needs proxyAdminTokenSecretRef (the proxy's admin API takes a bearer token)"
)
PROXY_TOKEN_NEEDS_PROXY = "proxyAdminTokenSecretRef goes with proxyAdminUrl or podEndpoints.proxyPort"
PROXY_PORT_NEEDS = (
    "podEndpoints.proxyPort is for a vllm or sglang target with a kvtune proxy sidecar: it needs "
    "proxyAdminTokenSecretRef (each pod's proxy admin API takes that bearer token)"
)
PROXY_URL_OR_PORT = (
    "proxyAdminUrl reaches one proxy: with podEndpoints.proxyPort the operator reaches every pod's proxy; "
    "set one of them"
)


class TargetRef(CamelModel):
    """The workload to tune and how to reach its knobs."""

    model_config = ConfigDict(
        json_schema_extra=cel(
            "self.engine != 'kvtune' || ((has(self.adminUrl) || has(self.podEndpoints)) && has(self.adminTokenSecretRef))",
            "a kvtune engine needs adminTokenSecretRef, and adminUrl or podEndpoints",
            (
                "!has(self.adminUrl) || !has(self.podEndpoints)",
                "adminUrl reaches one pod: with podEndpoints the operator reaches every pod at its adminPort",
            ),
            ("!has(self.proxyAdminUrl) || has(self.proxyAdminTokenSecretRef)", PROXY_URL_NEEDS_TOKEN),
            (
                "!has(self.proxyAdminTokenSecretRef) || has(self.proxyAdminUrl) || "
                "(has(self.podEndpoints) && has(self.podEndpoints.proxyPort))",
                PROXY_TOKEN_NEEDS_PROXY,
            ),
            (
                "!has(self.proxyAdminUrl) || self.engine != 'kvtune'",
                "a kvtune engine caps max_tokens itself: proxyAdminUrl is for vllm and sglang targets",
            ),
            (
                "!has(self.podEndpoints) || !has(self.podEndpoints.proxyPort) || "
                "(self.engine != 'kvtune' && has(self.proxyAdminTokenSecretRef))",
                PROXY_PORT_NEEDS,
            ),
            (
                "!has(self.proxyAdminUrl) || !has(self.podEndpoints) || !has(self.podEndpoints.proxyPort)",
                PROXY_URL_OR_PORT,
            ),
        )
    )

    kind: Literal["Deployment", "StatefulSet"] = Field(
        "Deployment",
        description="the workload (apps/v1); one patch of its pod template restarts every replica",
    )
    name: Name
    container: str | None = Field(None, description="container name (default: the first container)")
    engine: EngineType
    admin_url: str | None = Field(None, description="kvtune engines: base URL of the admin API")
    admin_token_secret_ref: SecretKeyRef | None = Field(
        None, description="kvtune engines: admin bearer token"
    )
    proxy_admin_url: str | None = Field(
        None,
        min_length=1,
        description="vllm / sglang behind a kvtune proxy: base URL of the proxy's admin API (the max_tokens "
        "cap is set there, live, no restart)",
    )
    proxy_admin_token_secret_ref: SecretKeyRef | None = Field(
        None,
        description="the kvtune proxy's admin bearer token (every pod's proxy, with podEndpoints.proxyPort)",
    )
    pod_endpoints: PodEndpoints | None = Field(
        None, description="many replicas: read and act on every pod, found through a Service's EndpointSlices"
    )
    admission_flag: AdmissionFlagChoice = Field(
        "Auto",
        description="vllm: the flag lowered to bound admission. Auto: --max-num-active-seqs when the container "
        "already sets it or the vLLM version (its /version, else the image tag) is 0.32 or later, else "
        "--max-num-seqs",
    )

    @model_validator(mode="after")
    def _kvtune_needs_admin(self) -> TargetRef:
        reachable = self.admin_url is not None or self.pod_endpoints is not None
        if self.engine == "kvtune" and (not reachable or self.admin_token_secret_ref is None):
            raise ValueError("a kvtune engine needs adminTokenSecretRef, and adminUrl or podEndpoints")
        if self.admin_url is not None and self.pod_endpoints is not None:
            raise ValueError(
                "adminUrl reaches one pod: with podEndpoints the operator reaches every pod at its adminPort"
            )
        proxy_port = self.pod_endpoints.proxy_port if self.pod_endpoints is not None else None
        if self.proxy_admin_url is not None and self.proxy_admin_token_secret_ref is None:
            raise ValueError(PROXY_URL_NEEDS_TOKEN)
        if (
            self.proxy_admin_token_secret_ref is not None
            and self.proxy_admin_url is None
            and proxy_port is None
        ):
            raise ValueError(PROXY_TOKEN_NEEDS_PROXY)
        if self.proxy_admin_url is not None and self.engine == "kvtune":
            raise ValueError(
                "a kvtune engine caps max_tokens itself: proxyAdminUrl is for vllm and sglang targets"
            )
        if proxy_port is not None and (self.engine == "kvtune" or self.proxy_admin_token_secret_ref is None):
            raise ValueError(PROXY_PORT_NEEDS)
        if proxy_port is not None and self.proxy_admin_url is not None:
            raise ValueError(PROXY_URL_OR_PORT)
        return self


class PrometheusRef(CamelModel):
    url: str = Field(min_length=1)
    selector: str = Field(min_length=1, description='label selector, e.g. {job="vllm",pod=~"llama-.*"}')
    by_pod: bool = Field(
        False, description="read each pod's series apart (by the pod label) and pool them, instead of one sum"
    )


class MetricsSourceSpec(CamelModel):
    """Exactly one of: the engine's own /metrics, or a Prometheus HTTP API with a selector. Beside an
    engine's /metrics, a kvtune proxy's /metrics (its prefix-defeat and cap series) may be read and merged;
    a Prometheus selector covers the proxy's series itself when it matches the proxy's pods."""

    model_config = ConfigDict(
        json_schema_extra=cel(
            "has(self.metricsUrl) != has(self.prometheus)",
            "set exactly one of metricsUrl and prometheus",
            ("!has(self.proxyMetricsUrl) || has(self.metricsUrl)", "proxyMetricsUrl goes with metricsUrl"),
        )
    )

    metrics_url: str | None = Field(None, min_length=1)
    proxy_metrics_url: str | None = Field(
        None, min_length=1, description="a kvtune proxy's /metrics, merged with metricsUrl"
    )
    prometheus: PrometheusRef | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> MetricsSourceSpec:
        if (self.metrics_url is None) == (self.prometheus is None):
            raise ValueError("set exactly one of metricsUrl and prometheus")
        if self.proxy_metrics_url is not None and self.metrics_url is None:
            raise ValueError("proxyMetricsUrl goes with metricsUrl")
        return self


class Bounds(CamelModel):
    model_config = ConfigDict(
        json_schema_extra=cel("self.minMaxNumSeqs <= self.maxMaxNumSeqs", "minMaxNumSeqs > maxMaxNumSeqs")
    )

    min_max_num_seqs: int = Field(TuningPolicy.min_max_num_seqs, ge=1)
    max_max_num_seqs: int = Field(TuningPolicy.max_max_num_seqs, ge=1)
    cap_floor: int = Field(TuningPolicy.cap_floor, ge=1, description="the max_tokens cap never goes below")

    @model_validator(mode="after")
    def _ordered(self) -> Bounds:
        if self.min_max_num_seqs > self.max_max_num_seqs:
            raise ValueError("minMaxNumSeqs > maxMaxNumSeqs")
        return self


class ScalingSpec(CamelModel):
    """The replica signal for the cluster's autoscaler (KEDA or an HPA on an external metric): the operator
    exports the replicas the observed demand needs; it never sets them."""

    min_replicas: int = Field(ScalingPolicy.min_replicas, ge=1)
    max_replicas: int = Field(ScalingPolicy.max_replicas, ge=1)
    goodput_loss_warning: float = Field(
        ScalingPolicy.goodput_loss_warning,
        ge=0.01,
        le=0.99,
        description="say so (status, Event) when NoPreemption's pick loses more than this share of goodput",
    )

    @model_validator(mode="after")
    def _ordered(self) -> ScalingSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError("minReplicas > maxReplicas")
        return self

    def to_policy(self) -> ScalingPolicy:
        return ScalingPolicy(self.min_replicas, self.max_replicas, self.goodput_loss_warning)


CLOCK = r"^([01][0-9]|2[0-3]):[0-5][0-9]$"  # a time of day, HH:MM
RESTART_BUDGET_ENGINES = (
    "restartBudget is for vllm and sglang targets: a kvtune engine changes max_num_seqs live, no restart"
)


class MaintenanceWindowSpec(CamelModel):
    """A daily time range in UTC inside which the changes that restart the pods are made."""

    model_config = ConfigDict(
        json_schema_extra=cel(
            "self.start != self.end", "a maintenance window needs an end different from its start"
        )
    )

    start: str = Field(pattern=CLOCK, max_length=5, description="HH:MM UTC: the window opens")
    end: str = Field(
        pattern=CLOCK,
        max_length=5,
        description="HH:MM UTC: the window closes; before start, it spans midnight",
    )

    @model_validator(mode="after")
    def _not_empty(self) -> MaintenanceWindowSpec:
        if self.start == self.end:
            raise ValueError("a maintenance window needs an end different from its start")
        return self


class RestartBudgetSpec(CamelModel):
    """At most maxRestarts changes that restart the workload's pods (a patch of its pod template) in any
    periodSeconds, and optionally only inside a daily maintenance window. A change the budget does not allow
    is held (condition ChangeHeld, Event ChangeHeld) and made when it allows, if still called for."""

    max_restarts: int = Field(
        ge=1, le=100, description="the most changes that restart the pods in any period"
    )
    period_seconds: int = Field(
        DAY_S, ge=60, description="the period, sliding: never more than maxRestarts in any span this long"
    )
    maintenance_window: MaintenanceWindowSpec | None = Field(
        None, description="make those changes only inside this daily UTC time range (omit: at any time)"
    )

    def to_budget(self) -> RestartBudget:
        window = self.maintenance_window
        return RestartBudget(
            self.max_restarts,
            float(self.period_seconds),
            MaintenanceWindow.of(window.start, window.end) if window is not None else None,
        )


class KVTuningPolicySpec(CamelModel):
    model_config = ConfigDict(
        json_schema_extra=cel(
            "has(self.metrics) || has(self.target.podEndpoints)",
            "set metrics, or target.podEndpoints to read every pod's own /metrics",
            (
                "!has(self.target.podEndpoints) || !has(self.metrics) || !has(self.metrics.metricsUrl)",
                "metricsUrl reads one engine: with target.podEndpoints omit metrics (each pod is read) or "
                "use prometheus",
            ),
            (
                "self.objective != 'Goodput' || has(self.p95QueueWaitBoundSeconds)",
                "the Goodput objective needs p95QueueWaitBoundSeconds",
            ),
            (
                "self.target.engine != 'kvtune' || has(self.target.podEndpoints) || !has(self.metrics) || "
                "!has(self.metrics.prometheus) || !has(self.metrics.prometheus.byPod) || "
                "!self.metrics.prometheus.byPod",
                "prometheus.byPod on a kvtune engine needs target.podEndpoints, to reach every pod's admin API",
            ),
            ("!has(self.restartBudget) || self.target.engine != 'kvtune'", RESTART_BUDGET_ENGINES),
        )
    )

    target: TargetRef
    metrics: MetricsSourceSpec | None = Field(
        None, description="where samples come from (omit with target.podEndpoints: each pod's /metrics)"
    )
    mode: ModeName = "Recommend"
    bounds: Bounds = Field(default_factory=lambda: Bounds.model_validate({}))
    interval_seconds: int = Field(15, ge=1, description="seconds between two metric samples")
    evaluation_window_seconds: int | None = Field(
        None,
        ge=1,
        description="how long an action is watched before it is judged (after the rollout it started). Unset: "
        "300 for vllm and sglang (a change is a rolling restart of GPU pods), 60 for kvtune",
    )
    cooldown_seconds: int | None = Field(
        None,
        ge=0,
        description="least time between two actions. Unset: 1800 for vllm and sglang (at most one restart of "
        "the fleet every half hour), 60 for kvtune",
    )
    restart_budget: RestartBudgetSpec | None = Field(
        None,
        description="vllm / sglang: at most maxRestarts changes that restart the pods per periodSeconds, "
        "optionally only inside a maintenance window (omit: bounded by cooldownSeconds only)",
    )
    max_step: int = Field(TuningPolicy.max_step, ge=1, description="largest max_num_seqs change at once")
    allow_fp8: bool = Field(False, alias="allowFP8", description="apply FP8 KV (accuracy caveat)")
    shared_prefix_tokens: int = Field(0, ge=0, description="declared shared prompt prefix (0: none)")
    prediction: bool = Field(
        True,
        description="fit the live workload and move max_num_seqs to the what-if model's pick in one step, "
        "verified in one evaluation window (measured stepping after two misses); false: measured stepping only",
    )
    objective: ObjectiveName = Field(
        "NoPreemption",
        description="NoPreemption: the largest max_num_seqs predicted never to preempt. Goodput: the highest "
        "predicted goodput whose p95 queue wait stays within p95QueueWaitBoundSeconds, preempting or not",
    )
    p95_queue_wait_bound_seconds: float | None = Field(
        None, ge=0.001, description="Goodput's latency bound: the p95 time a request waits to be admitted"
    )
    round_to: int | None = Field(
        None,
        ge=1,
        description="max_num_seqs moves in multiples of this. Unset: 8 for vllm (its CUDA graphs are captured "
        "for batch sizes in multiples of 8; vLLM #57355), 1 for vLLM's CPU build (a container whose image says "
        "cpu and asks for no GPU) and elsewhere",
    )
    scaling: ScalingSpec | None = Field(
        None,
        description="export the replicas the demand needs (kvtune_operator_desired_replicas) for KEDA or an HPA; "
        "omit: no replica signal",
    )

    @model_validator(mode="after")
    def _goodput_needs_a_bound(self) -> KVTuningPolicySpec:
        if self.objective == "Goodput" and self.p95_queue_wait_bound_seconds is None:
            raise ValueError("the Goodput objective needs p95QueueWaitBoundSeconds")
        if self.restart_budget is not None and self.target.engine == "kvtune":
            raise ValueError(RESTART_BUDGET_ENGINES)
        return self

    def resolved_timing(self) -> Timing:
        """The evaluation window and cooldown in force: the spec's, else the engine's defaults."""
        default = default_timing(self.target.engine)
        window, cooldown = self.evaluation_window_seconds, self.cooldown_seconds
        return Timing(
            float(window) if window is not None else default.evaluation_window_s,
            float(cooldown) if cooldown is not None else default.cooldown_s,
        )

    def resolved_round_to(self) -> int:
        if self.round_to is not None:
            return self.round_to
        return default_round_to(self.target.engine, "cuda" if self.target.engine == "vllm" else "cpu")

    @model_validator(mode="after")
    def _where_pods_are_read(self) -> KVTuningPolicySpec:
        pods, metrics = self.target.pod_endpoints, self.metrics
        if metrics is None and pods is None:
            raise ValueError("set metrics, or target.podEndpoints to read every pod's own /metrics")
        if pods is not None and metrics is not None and metrics.metrics_url is not None:
            raise ValueError(
                "metricsUrl reads one engine: with target.podEndpoints omit metrics (each pod is read) or "
                "use prometheus"
            )
        by_pod = metrics is not None and metrics.prometheus is not None and metrics.prometheus.by_pod
        if by_pod and self.target.engine == "kvtune" and pods is None:
            raise ValueError("prometheus.byPod on a kvtune engine needs target.podEndpoints, to reach every "
                             "pod's admin API")  # fmt: skip
        return self

    def to_policy(self) -> TuningPolicy:
        return TuningPolicy(
            mode=Mode(self.mode),
            min_max_num_seqs=self.bounds.min_max_num_seqs,
            max_max_num_seqs=self.bounds.max_max_num_seqs,
            cap_floor=self.bounds.cap_floor,
            evaluation_window_s=self.resolved_timing().evaluation_window_s,
            cooldown_s=self.resolved_timing().cooldown_s,
            max_step=self.max_step,
            allow_fp8=self.allow_fp8,
            shared_prefix_tokens=self.shared_prefix_tokens,
            predict=self.prediction,
            objective=self.objective,
            p95_wait_bound_s=self.p95_queue_wait_bound_seconds,
            round_to=self.resolved_round_to(),
            scaling=self.scaling.to_policy() if self.scaling is not None else None,
            restart_budget=self.restart_budget.to_budget() if self.restart_budget is not None else None,
        )


class Condition(CamelModel):
    type: ConditionType
    status: ConditionStatus
    reason: str = Field(min_length=1)
    message: str = ""
    last_transition_time: datetime

    @staticmethod
    def of(state: ConditionState) -> Condition:
        return Condition(type=state.type, status=state.status, reason=state.reason, message=state.message,
                         last_transition_time=state.since)  # fmt: skip

    def state(self) -> ConditionState:
        return ConditionState(self.type, self.status, self.reason, self.message, self.last_transition_time)


class KnobValues(CamelModel):
    max_num_seqs: int | None = None
    max_tokens_cap: int | None = None
    kv_cache_dtype: str | None = None


NO_CAP = 0  # in DesiredValues: the operator wants no max_tokens cap (status cannot hold a meaningful null)


class DesiredValues(CamelModel):
    """The knob values the operator set and owns: re-applied whenever the engine does not hold them (an
    engine restart, another replica, a restarted operator)."""

    max_num_seqs: int | None = Field(None, ge=1)
    max_tokens_cap: int | None = Field(None, ge=0, description="0: no cap")
    kv_cache_dtype: str | None = None

    @staticmethod
    def of(desired: tuple[tuple[str, int | str | None], ...]) -> DesiredValues | None:
        if not desired:
            return None
        values = dict(desired)
        if "max_tokens_cap" in values and values["max_tokens_cap"] is None:
            values["max_tokens_cap"] = NO_CAP
        return DesiredValues.model_validate(values)

    def pairs(self) -> tuple[tuple[str, int | str | None], ...]:
        values: dict[str, int | str | None] = dict(self.model_dump(exclude_none=True))
        if values.get("max_tokens_cap") == NO_CAP:
            values["max_tokens_cap"] = None
        return tuple(sorted(values.items()))


UNSET = 0  # in OriginalValues: the knob was not set (no max_tokens cap; vLLM's flag absent from its args)


class OriginalValues(CamelModel):
    """The value each knob held before the operator first changed it: what `kvtune.dev/undo` puts back."""

    max_num_seqs: int | None = Field(None, ge=0, description="0: the engine's flag was not set")
    max_tokens_cap: int | None = Field(None, ge=0, description="0: no cap")
    kv_cache_dtype: str | None = None

    @staticmethod
    def of(values: Mapping[str, int | str | None]) -> OriginalValues | None:
        """The first values as status holds them: a numeric knob that was not set is UNSET; a cache dtype
        that was not known is left out (nothing to put back)."""
        kept = {
            k: UNSET if v is None else v for k, v in values.items() if v is not None or k != "kv_cache_dtype"
        }
        return OriginalValues.model_validate(kept) if kept else None

    def values(self) -> dict[str, int | str | None]:
        return {k: None if v == UNSET else v for k, v in self.model_dump(exclude_none=True).items()}


class UndoStatus(CamelModel):
    """The last undo the operator carried out (or is still trying)."""

    request: str = Field(description="the kvtune.dev/undo annotation's value it answered")
    time: datetime
    done: bool
    message: str = ""


class JudgedFiguresModel(CamelModel):
    preemption_rate: float | None = None
    goodput: float | None = None
    kv_usage_max: float | None = None
    waiting_mean: float | None = None

    @staticmethod
    def of(figures: JudgedFigures) -> JudgedFiguresModel:
        return JudgedFiguresModel(
            preemption_rate=figures.preemption_rate,
            goodput=figures.goodput,
            kv_usage_max=figures.kv_usage_max,
            waiting_mean=figures.waiting_mean,
        )

    def judged_figures(self) -> JudgedFigures:
        return JudgedFigures(self.preemption_rate, self.goodput, self.kv_usage_max, self.waiting_mean)


def _time(at: float) -> datetime:
    return datetime.fromtimestamp(at, UTC)


class HistoryItem(CamelModel):
    """One action, rollback, recommendation or flag: what, why, the evidence, figures before and after."""

    at: float = Field(description="epoch seconds (exact, for resuming)")
    time: datetime
    kind: HistoryKind
    remedy: RemedyName
    knob: str | None = None
    before: KnobValue = None
    after: KnobValue = None
    reason: str = ""
    evidence: str = ""
    before_figures: JudgedFiguresModel
    after_figures: JudgedFiguresModel | None = None

    @staticmethod
    def of(entry: HistoryEntry) -> HistoryItem:
        return HistoryItem(
            at=entry.at,
            time=_time(entry.at),
            kind=cast(HistoryKind, entry.kind),
            remedy=entry.remedy.value,
            knob=entry.knob,
            before=entry.before,
            after=entry.after,
            reason=entry.reason,
            evidence=entry.evidence,
            before_figures=JudgedFiguresModel.of(entry.before_figures),
            after_figures=JudgedFiguresModel.of(entry.after_figures) if entry.after_figures else None,
        )

    def entry(self) -> HistoryEntry:
        return HistoryEntry(
            self.at, self.kind, Remedy(self.remedy), self.knob, self.before, self.after, self.reason,
            self.evidence, self.before_figures.judged_figures(),
            self.after_figures.judged_figures() if self.after_figures else None,
        )  # fmt: skip


class PendingModel(CamelModel):
    at: float
    remedy: RemedyName
    knob: str
    before: KnobValue = None
    after: KnobValue = None
    direction: Direction
    before_figures: JudgedFiguresModel
    held_at: float | None = Field(None, description="epoch seconds the new limit was first seen holding")


class TunerStateModel(CamelModel):
    """The tuner's memory apart from history (which status holds on its own)."""

    rung: RemedyName | None = None
    pending: PendingModel | None = None
    last_action_at: float | None = None
    unsafe_max_num_seqs: int | None = None
    unsafe_since: float | None = None
    exhausted: list[RemedyName] = Field(default_factory=list)
    reported: list[str] = Field(default_factory=list)
    restarts: list[float] = Field(
        default_factory=list,
        description="epoch seconds of the changes that restarted the pods (restartBudget)",
    )


class ForecastModel(CamelModel):
    """A prediction the tuner acted on (or held): the value, what the what-if model predicts there and at
    the value that was in force, and the fitted workload it came from."""

    max_num_seqs: int
    predicted_preemptions_per_minute: float
    predicted_goodput: float = Field(description="generated tokens per second")
    predicted_p95_queue_wait_seconds: float
    from_max_num_seqs: int
    from_predicted_preemptions_per_minute: float
    from_predicted_goodput: float
    objective: ObjectiveName
    reason: str = ""
    workload: str = Field("", description="the fitted workload in one line")

    @staticmethod
    def of(f: Forecast) -> ForecastModel:
        return ForecastModel(
            max_num_seqs=f.value, predicted_preemptions_per_minute=f.preemptions_per_min,
            predicted_goodput=f.goodput, predicted_p95_queue_wait_seconds=f.p95_wait_s,
            from_max_num_seqs=f.current, from_predicted_preemptions_per_minute=f.current_preemptions_per_min,
            from_predicted_goodput=f.current_goodput, objective=cast(ObjectiveName, f.objective),
            reason=f.reason, workload=f.workload,
        )  # fmt: skip

    def forecast(self) -> Forecast:
        return Forecast(
            self.max_num_seqs, self.predicted_preemptions_per_minute, self.predicted_goodput,
            self.predicted_p95_queue_wait_seconds, self.from_max_num_seqs,
            self.from_predicted_preemptions_per_minute, self.from_predicted_goodput, self.objective,
            self.reason, self.workload,
        )  # fmt: skip


class PredictionStatus(CamelModel):
    """The predicted move: the objective in force, the forecast, what the window after it showed, and
    whether the tuner fell back to measured stepping."""

    objective: str = Field(description="the objective in force, with its bound or risk margin")
    round_to: int
    forecast: ForecastModel | None = None
    verdict: str | None = Field(None, description="what the evaluation window said of the forecast")
    misses: int = Field(0, ge=0)
    stepping: bool = Field(False, description="two misses: measured stepping from then on")
    observed_preemptions_per_minute: float | None = Field(
        None, description="at the last evaluation, over its window"
    )
    since: float | None = Field(None, description="epoch seconds the forecast's own evidence starts")

    @staticmethod
    def of(p: PredictionState, objective: str, round_to: int, observed: float | None) -> PredictionStatus:
        return PredictionStatus(
            objective=objective, round_to=round_to,
            forecast=ForecastModel.of(p.forecast) if p.forecast else None, verdict=p.verdict,
            misses=p.misses, stepping=p.stepping, observed_preemptions_per_minute=observed, since=p.since,
        )  # fmt: skip

    def state(self) -> PredictionState:
        return PredictionState(
            self.forecast.forecast() if self.forecast else None, self.verdict, self.misses, self.stepping,
            (), self.since,
        )  # fmt: skip


POD_STATUS_LIMIT = 32  # status.pods keeps the worst pods first; a large workload's healthy tail is left out


class PodStatus(CamelModel):
    """One pod over the last window: the evidence the workload's one decision pooled."""

    name: str
    preemptions: float = Field(description="preemptions in the window")
    kv_usage_max: float | None = None
    running_max: float | None = None
    max_num_seqs: int | None = Field(None, description="the max_num_seqs the pod holds")
    last_seen: datetime


class WorkloadWatch(CamelModel):
    """What the operator follows on a workload whose args it patches: the rollout it waits for before it
    judges or acts again, and the other field manager that reverted its change (after a bounded number of
    reverts the value becomes a recommendation, until the policy is edited)."""

    rollout_generation: int | None = Field(
        default=None, description="the workload generation whose rollout is awaited"
    )
    rollout_since: float | None = Field(default=None, description="epoch seconds the wait began")
    rollout_stalled: bool = Field(
        default=False, description="the rollout stopped progressing: the operator does not act"
    )
    rollout_summary: str | None = None
    reverts: int = Field(default=0, ge=0, description="times another field manager put the args back")
    reverted_by: str | None = Field(
        default=None, description="the field manager that last did (from managedFields)"
    )
    reverted_to: int | None = Field(default=None, description="the value it put back")
    revert_generation: int | None = Field(
        default=None, description="the workload generation of the last revert"
    )
    yielded_value: int | None = Field(
        default=None, description="the value the operator stopped re-applying (kept as a recommendation)"
    )
    yielded_policy_generation: int | None = Field(
        default=None, description="the policy generation it yielded at: editing the policy lets it act again"
    )


class ScalingStatus(CamelModel):
    """The replica signal at the last evaluation window, and what it rests on."""

    desired_replicas: int | None = Field(None, description="None: no count can be said; the autoscaler holds")
    replicas: int = Field(description="pods the evaluation's samples came from")
    demand: str = Field("", description="the workload's whole arrival: clients, or requests per second")
    demand_evidence: str = Field("", description="what the demand was read from: the requests in the engines")
    demand_capacity_ratio: float | None = Field(None, description="demand ÷ the most one replica holds")
    max_num_seqs_per_replica: int | None = Field(None, description="the per-replica setting at that count")
    reason: str = ""
    held: str | None = Field(None, description="why the signal did not move")
    no_preemption_cost: str | None = Field(
        None, description="NoPreemption's pick loses more goodput than goodputLossWarning: the alternatives"
    )
    goodput_loss: float | None = None
    autoscalers: list[str] = Field(
        default_factory=list, description="the autoscalers that drive the workload"
    )
    evaluated_at: datetime | None = None


class TimingStatus(CamelModel):
    """The evaluation window and cooldown in force: a policy that states neither runs on its engine's
    defaults, and status says which it took."""

    evaluation_window_seconds: float
    cooldown_seconds: float
    defaulted: list[str] = Field(
        default_factory=list, description="the spec fields left unset, whose engine default is in force"
    )

    @staticmethod
    def of(spec: KVTuningPolicySpec) -> TimingStatus:
        timing = spec.resolved_timing()
        unset = {
            "evaluationWindowSeconds": spec.evaluation_window_seconds,
            "cooldownSeconds": spec.cooldown_seconds,
        }
        return TimingStatus(
            evaluation_window_seconds=timing.evaluation_window_s,
            cooldown_seconds=timing.cooldown_s,
            defaulted=[name for name, value in unset.items() if value is None],
        )


class KVTuningPolicyStatus(CamelModel):
    model_config = ConfigDict(extra="ignore")  # tolerate fields other writers add

    observed_generation: int | None = None
    last_evaluation_time: datetime | None = None
    note: str | None = Field(None, description="what the tuner did or waits for at the last evaluation")
    conditions: list[Condition] = Field(default_factory=list)
    current: KnobValues | None = None
    recommended: KnobValues | None = None
    desired: DesiredValues | None = Field(
        None, description="values the operator set and re-applies when the engine loses them"
    )
    history: list[HistoryItem] = Field(default_factory=list, max_length=HISTORY_LIMIT)
    tuner_state: TunerStateModel | None = None
    pods: list[PodStatus] = Field(
        default_factory=list, max_length=POD_STATUS_LIMIT, description="per pod, the worst first"
    )
    worst_pod: str | None = Field(None, description="most preemptions in the window, then highest KV usage")
    admission_flag: str | None = Field(None, description="vllm: the flag the operator patches, and why")
    mode: ModeName | None = Field(
        None, description="the mode the policy runs in: spec.mode, or less (condition ModeCapped says why)"
    )
    original: OriginalValues | None = Field(
        None, description="each knob's value before the operator first changed it (what an undo restores)"
    )
    undo: UndoStatus | None = None
    workload: WorkloadWatch | None = Field(
        None, description="vllm / sglang: the rollout awaited and the reverts seen of the operator's patches"
    )
    prediction: PredictionStatus | None = None
    scaling: ScalingStatus | None = None
    timing: TimingStatus | None = Field(
        None,
        description="the evaluationWindowSeconds and cooldownSeconds in force (the spec's or the engine's)",
    )


class KVTuningPolicy(CamelModel):
    """The whole object (metadata left free-form, as the API server owns it)."""

    model_config = ConfigDict(extra="ignore")

    api_version: Literal["kvtune.dev/v1alpha1"] = "kvtune.dev/v1alpha1"
    kind: Literal["KVTuningPolicy"] = "KVTuningPolicy"
    spec: KVTuningPolicySpec
    status: KVTuningPolicyStatus | None = None


def state_to_status(state: TunerState) -> tuple[TunerStateModel, list[HistoryItem]]:
    pending = state.pending
    model = TunerStateModel(
        rung=state.rung.value if state.rung else None,
        pending=PendingModel(
            at=pending.at,
            remedy=pending.remedy.value,
            knob=pending.knob,
            before=pending.before,
            after=pending.after,
            direction=cast(Direction, pending.direction),
            before_figures=JudgedFiguresModel.of(pending.before_figures),
            held_at=pending.held_at,
        )
        if pending
        else None,
        last_action_at=state.last_action_at,
        unsafe_max_num_seqs=state.unsafe_max_num_seqs,
        unsafe_since=state.unsafe_since,
        exhausted=sorted(r.value for r in state.exhausted),
        reported=sorted(state.reported),
        restarts=list(state.restarts),
    )
    return model, [HistoryItem.of(entry) for entry in state.history]


def state_from_status(status: KVTuningPolicyStatus | None) -> TunerState:
    """The tuner state a previous run left in status (a fresh state when there is none)."""
    if status is None or status.tuner_state is None:
        return TunerState(
            history=tuple(item.entry() for item in status.history) if status else (),
            desired=status.desired.pairs() if status and status.desired else (),
        )
    saved = status.tuner_state
    pending = saved.pending
    return TunerState(
        rung=Remedy(saved.rung) if saved.rung else None,
        pending=Pending(
            pending.at, Remedy(pending.remedy), pending.knob, pending.before, pending.after,
            pending.direction, pending.before_figures.judged_figures(), pending.held_at,
        )
        if pending
        else None,
        last_action_at=saved.last_action_at,
        unsafe_max_num_seqs=saved.unsafe_max_num_seqs,
        unsafe_since=saved.unsafe_since,
        exhausted=frozenset(Remedy(r) for r in saved.exhausted),
        reported=frozenset(saved.reported),
        history=tuple(item.entry() for item in status.history)[-HISTORY_LIMIT:],
        desired=status.desired.pairs() if status.desired else (),
        prediction=status.prediction.state() if status.prediction else PredictionState(),
        restarts=tuple(saved.restarts),
    )  # fmt: skip
