"""What one policy's spec is wired to: the metric source it reads and the actuator that changes its
engine's knobs (an admin API, every pod's, a Deployment's args, a proxy in front), with their bearer tokens
from Secrets. An actuator that cannot be built (a Secret missing) becomes an `UnavailableActuator`, so the
diagnosis and the recommendations go on.
"""

from __future__ import annotations

from kvtune.operator.decide.ports import Actuator, ActuatorInfo, ActuatorResult, MetricSource
from kvtune.operator.decide.sample import NoData
from kvtune.operator.io.actuators import ENGINE_KNOBS, PROXY_KNOBS, ComposedActuator, KvtuneAdminActuator
from kvtune.operator.io.prometheus_batch import BATCHERS
from kvtune.operator.io.sources import EngineWithProxy, MetricsEndpoint, PrometheusSource
from kvtune.operator.k8s.crd import KVTuningPolicySpec, SecretKeyRef
from kvtune.operator.k8s.kube_api import KubeApi, KubeError
from kvtune.operator.k8s.pods import Pod, pod_url
from kvtune.operator.k8s.secret_cache import SecretCache
from kvtune.operator.k8s.workload import pods_admin_actuator, pods_proxy_actuator
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
