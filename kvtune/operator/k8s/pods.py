"""A workload's pods and their metrics: which pods are ready (the target Service's EndpointSlices), each
pod's own /metrics, with its kvtune proxy sidecar's beside it (or its series in Prometheus, by the `pod`
label), and the pooled sample of them all that
the diagnosis reads (`PooledSource`, through `pooling.pool`).

Like every source, nothing raises out of `read()`: a pod that cannot be read is named, and only a workload
with no readable pod is NoData.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from kvtune.operator.decide.pooling import Pooled, PoolState, pool
from kvtune.operator.decide.ports import MetricSource
from kvtune.operator.decide.sample import NoData, Sample, SampleResult
from kvtune.operator.io.sources import EngineWithProxy, MetricsEndpoint
from kvtune.operator.k8s.kube_api import KubeApi, KubeError

SERVICE_LABEL = "kubernetes.io/service-name"
MAX_PARALLEL_READS = 16

Clock = Callable[[], float]
PodReadings = dict[str, SampleResult]  # pod name -> its sample, or why it could not be read


@dataclass(frozen=True)
class Pod:
    name: str
    address: str


def ready_pods(slices: list[dict[str, Any]], service: str) -> list[Pod]:
    """The ready endpoints of `service` in its EndpointSlices, one per pod (a dual-stack pod in two slices
    once), by name. An endpoint whose readiness is unknown counts as ready, as the API advises consumers."""
    pods: dict[str, Pod] = {}
    for found in slices:
        labels = (found.get("metadata") or {}).get("labels") or {}
        if labels.get(SERVICE_LABEL) != service:  # a server that ignores the label selector lists others too
            continue
        if found.get("addressType") not in ("IPv4", "IPv6"):
            continue
        for endpoint in found.get("endpoints") or []:
            if (endpoint.get("conditions") or {}).get("ready") is False:
                continue
            addresses = endpoint.get("addresses") or []
            if not addresses:
                continue
            ref = endpoint.get("targetRef") or {}
            name = ref.get("name") if ref.get("kind") == "Pod" and ref.get("name") else addresses[0]
            pods.setdefault(str(name), Pod(str(name), str(addresses[0])))
    return sorted(pods.values(), key=lambda pod: pod.name)


def discover(api: KubeApi, namespace: str, service: str) -> list[Pod] | NoData:
    """The service's ready pods now, or NoData saying why there are none."""
    now = time.time()
    where = f"endpointslices of service {namespace}/{service}"
    try:
        slices = api.list_endpoint_slices(namespace, service)
    except KubeError as err:
        return NoData(where, f"cannot list: {err}", now)
    pods = ready_pods(slices, service)
    return pods if pods else NoData(where, "no ready pod", now)


def pod_url(scheme: str, pod: Pod, port: int, path: str = "") -> str:
    host = f"[{pod.address}]" if ":" in pod.address else pod.address
    return f"{scheme}://{host}:{port}{path}"


class PodSource(Protocol):
    def read_pods(self) -> PodReadings | NoData: ...

    @property
    def proxy_problem(self) -> str | None: ...


def pod_metrics(
    pod: Pod, scheme: str, port: int, path: str, proxy_port: int | None, clock: Clock
) -> MetricSource:
    """One pod's engine /metrics, merged with its kvtune proxy sidecar's /metrics when it has one (the
    proxy's capped-request and prefix-defeat counters then pool like the engine's own)."""
    engine = MetricsEndpoint(pod_url(scheme, pod, port, path), clock=clock)
    if proxy_port is None:
        return engine
    return EngineWithProxy(engine, MetricsEndpoint(pod_url(scheme, pod, proxy_port, "/metrics"), clock=clock))


class PodEndpointsSource:
    """Each pod's own /metrics (and its proxy sidecar's), scraped in parallel (a slow pod costs one timeout,
    not one per pod)."""

    def __init__(
        self,
        pods: list[Pod],
        scheme: str,
        port: int,
        path: str,
        clock: Clock = time.time,
        proxy_port: int | None = None,
    ) -> None:
        self.endpoints = {pod.name: pod_metrics(pod, scheme, port, path, proxy_port, clock) for pod in pods}

    @property
    def proxy_problem(self) -> str | None:
        """Which pods' proxy /metrics could not be read at the last read, and why (None: all were)."""
        problems = [
            f"pod {name}: {endpoint.proxy_problem}"
            for name, endpoint in sorted(self.endpoints.items())
            if endpoint.proxy_problem
        ]
        return "; ".join(problems) or None

    def read_pods(self) -> PodReadings | NoData:
        if not self.endpoints:
            return NoData("pod endpoints", "no ready pod", time.time())
        with ThreadPoolExecutor(max_workers=min(MAX_PARALLEL_READS, len(self.endpoints))) as pool_:
            results = pool_.map(lambda endpoint: endpoint.read(), self.endpoints.values())
            return dict(zip(self.endpoints, results, strict=True))


class PooledSource:
    """A MetricSource over many pods: one pooled Sample a read, from the pool state of the last read
    (`state`, kept by the caller between evaluations). `last` is the latest pooling, for status and Events;
    `unread` names the pods that could not be read."""

    def __init__(self, pods: PodSource, state: PoolState, horizon: float, clock: Clock = time.time) -> None:
        self.pods = pods
        self.state = state
        self.horizon = horizon
        self.clock = clock
        self.last: Pooled | None = None
        self.unread: dict[str, str] = {}

    @property
    def proxy_problem(self) -> str | None:
        """The pods whose proxy sidecar's /metrics did not answer at the last read."""
        return self.pods.proxy_problem

    def read(self) -> SampleResult:
        readings = self.pods.read_pods()
        now = self.clock()
        if isinstance(readings, NoData):
            return readings
        samples: Mapping[str, Sample] = {n: r for n, r in readings.items() if isinstance(r, Sample)}
        self.unread = {n: f"{r.source}: {r.reason}" for n, r in readings.items() if isinstance(r, NoData)}
        if not samples:
            listed = "; ".join(f"{name}: {why}" for name, why in sorted(self.unread.items()))
            return NoData(f"{len(readings)} pods", f"no pod could be read ({listed})", now)
        self.last = pool(self.state, samples, set(readings), now, self.horizon, f"{len(samples)} pods")
        self.state = self.last.state
        return self.last.sample
