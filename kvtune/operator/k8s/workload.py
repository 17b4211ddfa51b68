"""A policy whose target runs as many pods (`target.podEndpoints`, or `metrics.prometheus.byPod`): which
pods there are this evaluation, the pooled source that reads them, the fan-out actuators that set a kvtune
engine's knobs, or a kvtune proxy sidecar's cap, on each of them, and the per-pod evidence that goes into
status. One value is decided for the whole workload; `reconcile.evaluate` wires these in.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from datetime import UTC, datetime

from kvtune.contract.knobs import KNOB_MAX_NUM_SEQS
from kvtune.operator.decide.pooling import PodEvidence, PoolState, evidence, histograms_due
from kvtune.operator.decide.ports import KnobReadings
from kvtune.operator.decide.sample import NoData
from kvtune.operator.io.actuators import (
    ENGINE_KNOBS,
    PROXY_KNOBS,
    FanOutActuator,
    KvtuneAdminActuator,
)
from kvtune.operator.io.prometheus_batch import BATCHERS
from kvtune.operator.io.sources import PrometheusSource
from kvtune.operator.k8s.crd import POD_STATUS_LIMIT, KVTuningPolicySpec, PodEndpoints, PodStatus
from kvtune.operator.k8s.kube_api import KubeApi
from kvtune.operator.k8s.pods import Pod, PodEndpointsSource, PodSource, PooledSource, discover, pod_url


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
