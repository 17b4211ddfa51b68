"""What one policy's spec is wired to: the metric source it reads and the actuator that changes its
engine's knobs (an admin API, every pod's, a Deployment's args, a proxy in front), with their bearer tokens
from Secrets. An actuator that cannot be built (a Secret missing) becomes an `UnavailableActuator`, so the
diagnosis and the recommendations go on.

A policy whose target runs as many pods (`target.podEndpoints`, or `metrics.prometheus.byPod`) is wired to a
workload: which pods there are this evaluation, the pooled source that reads them, the fan-out actuators that set a kvtune
engine's knobs, or a kvtune proxy sidecar's cap, on each of them, and the per-pod evidence that goes into
status. One value is decided for the whole workload."""

from __future__ import annotations

import time
from collections.abc import Mapping
from datetime import UTC, datetime

from kvtune.contract.knobs import KNOB_MAX_NUM_SEQS
from kvtune.operator.decide.pooling import PodEvidence, PoolState, evidence, histograms_due
from kvtune.operator.decide.ports import Actuator, ActuatorInfo, ActuatorResult, KnobReadings, MetricSource
from kvtune.operator.decide.sample import NoData
from kvtune.operator.io.actuators import (
    ENGINE_KNOBS,
    PROXY_KNOBS,
    ComposedActuator,
    FanOutActuator,
    KvtuneAdminActuator,
)
from kvtune.operator.io.prometheus_batch import BATCHERS
from kvtune.operator.io.sources import EngineWithProxy, MetricsEndpoint, PrometheusSource
from kvtune.operator.k8s.crd import (
    POD_STATUS_LIMIT,
    KVTuningPolicySpec,
    PodEndpoints,
    PodStatus,
    SecretKeyRef,
)
from kvtune.operator.k8s.kube_api import KubeApi, KubeError
from kvtune.operator.k8s.pods import Pod, PodEndpointsSource, PodSource, PooledSource, discover, pod_url
from kvtune.operator.k8s.secret_cache import SecretCache
from kvtune.operator.k8s.workload_actuator import WorkloadArgsActuator
from kvtune.operator.k8s.workload_watch import AdvisoryWorkload


class UnavailableActuator:
    """Stands in when the real actuator cannot be built (a missing Secret): diagnosis and recommendations
    continue, nothing is applied. It holds no knob, so inside a ComposedActuator the knobs it stands for
    become recommendations and the ladder moves on to the knobs the other parts can change."""

    knobs: frozenset[str] = frozenset()

    def __init__(self, error: str) -> None:
        self.error = error

    def current(self) -> ActuatorResult:
        return ActuatorResult(False, {}, self.error)

    def apply(self, knob: str, value: int | str | None, cause: str = "") -> ActuatorResult:
        return ActuatorResult(False, {}, self.error)

    def describe(self) -> ActuatorInfo:
        return ActuatorInfo(unavailable=self.error)


def source_for(spec: KVTuningPolicySpec) -> MetricSource:
    metrics = spec.metrics
    assert metrics is not None  # the model requires metrics unless the target's pods are read
    if metrics.prometheus is not None:
        return PrometheusSource(metrics.prometheus.url, metrics.prometheus.selector,
                                batcher=BATCHERS.for_url(metrics.prometheus.url))  # fmt: skip
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


def args_actuator_of(actuator: Actuator) -> WorkloadArgsActuator | None:
    """The part that patches a Deployment's or StatefulSet's args, if the policy has one."""
    parts = actuator.parts if isinstance(actuator, ComposedActuator) else [actuator]
    return next((part for part in parts if isinstance(part, WorkloadArgsActuator)), None)


def advisory(actuator: Actuator, args: WorkloadArgsActuator, manager: str) -> Actuator:
    """`actuator` with its workload part reading but no longer changing the args (yielded to `manager`)."""
    if isinstance(actuator, ComposedActuator):
        return ComposedActuator(
            [AdvisoryWorkload(args, manager) if part is args else part for part in actuator.parts]
        )
    return AdvisoryWorkload(args, manager)


def by_pod(spec: KVTuningPolicySpec) -> bool:
    metrics = spec.metrics
    return metrics is not None and metrics.prometheus is not None and metrics.prometheus.by_pod


def is_workload(spec: KVTuningPolicySpec) -> bool:
    """Whether the policy reads its target pod by pod (else one engine, as before)."""
    return spec.target.pod_endpoints is not None or by_pod(spec)


def workload_pods(api: KubeApi, namespace: str, spec: KVTuningPolicySpec) -> list[Pod] | NoData | None:
    """The target's ready pods from its Service's EndpointSlices (None without target.podEndpoints)."""
    endpoints = spec.target.pod_endpoints
    return None if endpoints is None else discover(api, namespace, endpoints.service)


class NoPods:
    """A PodSource when the pods could not be listed: every read says why."""

    proxy_problem: str | None = None  # no pod listed, so no proxy sidecar read

    def __init__(self, why: NoData) -> None:
        self.why = why

    def read_pods(self) -> NoData:
        return self.why


HISTOGRAM_PERIOD_S = 60.0  # how often Prometheus is asked for the pods' histograms, at most


def histogram_period_s(evaluation_window_s: float, interval_s: float) -> float:
    """How often a policy reading Prometheus by pod asks for the histograms: once a minute or once a fifth
    of its evaluation window, whichever is sooner (a 300 s vLLM window's deltas then move in steps of 60
    to 90 s, `histograms_due`), and never more often than its interval. The reads between carry a quarter
    of a pod's series or fewer."""
    return max(interval_s, min(HISTOGRAM_PERIOD_S, evaluation_window_s / 5))


def workload_source(
    spec: KVTuningPolicySpec, pods: list[Pod] | NoData | None, state: PoolState, horizon: float
) -> PooledSource:
    """Prometheus by pod when the policy says so, else each listed pod's own /metrics; pooled."""
    per_pod: PodSource
    if by_pod(spec):
        assert spec.metrics is not None and spec.metrics.prometheus is not None
        interval = float(spec.interval_seconds)
        period = histogram_period_s(spec.resolved_timing().evaluation_window_s, interval)
        per_pod = PrometheusSource(spec.metrics.prometheus.url, spec.metrics.prometheus.selector,
                                   batcher=BATCHERS.for_url(spec.metrics.prometheus.url),
                                   histograms=histograms_due(state, time.time(), period, interval),
                                   known_pods=frozenset(state.pods))  # fmt: skip
    elif isinstance(pods, NoData):
        per_pod = NoPods(pods)
    else:
        endpoints = spec.target.pod_endpoints
        assert endpoints is not None and pods is not None  # is_workload: podEndpoints when not byPod
        per_pod = PodEndpointsSource(pods, endpoints.scheme, endpoints.metrics_port, endpoints.metrics_path,
                                     proxy_port=endpoints.proxy_port)  # fmt: skip
    return PooledSource(per_pod, state, horizon)


def fan_out(
    pods: list[Pod] | NoData, scheme: str, port: int, token: str, knobs: frozenset[str], name: str
) -> FanOutActuator:
    """The admin API at `port` of every pod (one token for all: the pods share the Secret), as one."""
    listed = [] if isinstance(pods, NoData) else pods
    parts = {
        pod.name: KvtuneAdminActuator(pod_url(scheme, pod, port), token, knobs=knobs, name=name)
        for pod in listed
    }
    return FanOutActuator(parts, knobs)


def pods_admin_actuator(pods: list[Pod] | NoData, endpoints: PodEndpoints, token: str) -> FanOutActuator:
    """Each pod's kvtune engine admin API: every knob is live there."""
    port = endpoints.admin_port or endpoints.metrics_port
    return fan_out(pods, endpoints.scheme, port, token, ENGINE_KNOBS, "admin API")


def pods_proxy_actuator(pods: list[Pod] | NoData, endpoints: PodEndpoints, token: str) -> FanOutActuator:
    """Each pod's kvtune proxy sidecar admin API: the max_tokens cap, live, on every pod (vLLM's own
    max_num_seqs is the one Deployment patch, composed beside this)."""
    port = endpoints.proxy_admin()
    assert port is not None  # called only with podEndpoints.proxyPort
    return fan_out(pods, endpoints.scheme, port, token, PROXY_KNOBS, "proxy admin API")


def held_max_num_seqs(found: PodEvidence, held: Mapping[str, KnobReadings]) -> int | None:
    """What the pod's admin API said it holds (authoritative), else its own max_num_seqs gauge."""
    value = held.get(found.name, {}).get(KNOB_MAX_NUM_SEQS)
    return value if value is not None else found.max_num_seqs


def pod_statuses(
    state: PoolState, since: float | None, held: Mapping[str, KnobReadings]
) -> tuple[list[PodStatus], PodEvidence | None]:
    """status.pods (the worst first, bounded) and the worst pod, over the window from `since`."""
    found = evidence(state, since)
    statuses = [
        PodStatus(
            name=pod.name,
            preemptions=pod.preemptions,
            kv_usage_max=pod.kv_usage_max,
            running_max=pod.running_max,
            max_num_seqs=held_max_num_seqs(pod, held),
            last_seen=datetime.fromtimestamp(pod.last_seen, UTC),
        )
        for pod in found[:POD_STATUS_LIMIT]
    ]
    return statuses, (found[0] if found else None)
