"""What the autoscaling e2e test and `kvtune bench autoscale` drive and watch: a closed-loop load spread over
the engines that exist now by fewest requests in flight (as a least-request router spreads it), the engines'
own queue-wait and preemption counters over a window, the Service's EndpointSlice kept to the engines that answer (a pod is
ready when its engine is, not when kwok says so), and the replicas over time.

The load records each request's time to first token, an upper bound of its queue wait (the wait plus a
prefill of a few dozen tokens), since the engines' queue-time histogram starts at a 0.3 s bucket.
"""

from __future__ import annotations

import asyncio
import math
import random
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

import httpx
from kubernetes import client

from kvtune.harness.engine_process import write_tiny_model_in_subprocess
from kvtune.harness.load import stream_completion
from tests.e2e.cluster import Cluster, kwok_node
from tests.e2e.pod_engines import PodEngines
from tests.e2e.pod_network import PodNetwork
from tests.e2e.scaled_deployment import kvtune_deployment
from tests.e2e.workloads import ADMIN_TOKEN, endpoint_slice, pods_policy, service

QUEUE_BUCKET = re.compile(r'^vllm:request_queue_time_seconds_bucket\{[^}]*le="([^"]+)"[^}]*\} (\S+)$', re.M)
PREEMPTIONS = re.compile(r"^vllm:num_preemptions_total(?:\{[^}]*\})? (\S+)$", re.M)


@dataclass(frozen=True)
class Workload:
    """The scaled workload's objects: a Deployment of kvtune engines, its Service, the policy over its pods
    and the engines' admin-token Secret, in one namespace."""

    namespace: str
    deployment: str
    service: str
    policy: str
    secret: str
    port: int = 8000

    def policy_manifest(
        self, window_s: float, bound_s: float, max_num_seqs: int, max_replicas: int
    ) -> dict[str, Any]:
        """Recommend mode with max_num_seqs pinned to the engines' own: the tuner has nothing to change, so the
        replica signal is never held for a pending change, and each evaluation window says a count."""
        found = pods_policy(self.policy, self.namespace, self.deployment, self.service, self.port, engine="kvtune",
                            adminTokenSecretRef={"name": self.secret})  # fmt: skip
        found["spec"].update({"mode": "Recommend", "evaluationWindowSeconds": window_s,
                              "bounds": {"minMaxNumSeqs": max_num_seqs, "maxMaxNumSeqs": max_num_seqs},
                              "p95QueueWaitBoundSeconds": bound_s,
                              "scaling": {"minReplicas": 1, "maxReplicas": max_replicas}})  # fmt: skip
        return found


def expose_operator_metrics(
    cluster: Cluster, release: str, system: str, host_address: str, port: int
) -> None:
    """The release's metrics Service pointed at an operator run as a process on this machine, at the host's
    end of the pod network (test_monitoring_stack's way), so the chart's ServiceMonitor scrapes it."""
    cluster.apply({
        "apiVersion": "v1", "kind": "Endpoints", "metadata": {"name": f"{release}-metrics", "namespace": system},
        "subsets": [{"addresses": [{"ip": host_address}],
                     "ports": [{"name": "metrics", "port": port, "protocol": "TCP"}]}],
    }, {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": f"{release}-metrics-e2e", "namespace": system,
                     "labels": {"kubernetes.io/service-name": f"{release}-metrics",
                                "endpointslice.kubernetes.io/managed-by": "kvtune-e2e"}},
        "addressType": "IPv4", "ports": [{"name": "metrics", "port": port, "protocol": "TCP"}],
        "endpoints": [{"addresses": [host_address], "conditions": {"ready": True}}],
    })  # fmt: skip


@contextmanager
def scaled_engines(
    cluster: Cluster, pods: PodNetwork, workload: Workload, folder: Path, engine_flags: Sequence[str]
) -> Iterator[PodEngines]:
    """The Deployment at one replica on a kwok node of its own, a real engine per pod (`engine_flags`), and
    the Service's EndpointSlice kept to the engines that answer."""
    token = folder / "token"
    token.write_text(ADMIN_TOKEN + "\n")
    model = write_tiny_model_in_subprocess(folder / "tiny")
    ns, name = workload.namespace, workload.deployment
    cluster.apply({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": workload.secret, "namespace": ns},
                   "stringData": {"token": ADMIN_TOKEN}})  # fmt: skip
    kwok_node(cluster, f"{name}-0", name)
    manifest: dict[str, Any] = kvtune_deployment(replicas=1, name=name)
    manifest["metadata"]["namespace"] = ns
    manifest["spec"]["template"]["spec"]["nodeSelector"] = {"kvtune-e2e/pool": name}
    cluster.apply(manifest, service(ns, workload.service, workload.port))
    with PodEngines(cluster, pods, ns, f"app={name}", model, token, folder / "engines", port=workload.port,
                    engine_flags=engine_flags) as running:  # fmt: skip
        running.wait_for_engines(1)
        mirror = SliceMirror(cluster, running, ns, workload.service, workload.port).start()
        try:
            yield running
        finally:
            mirror.stop()


@dataclass(frozen=True)
class RequestShape:
    """Each request's prompt and output lengths (token counts drawn uniformly)."""

    prompt_len: tuple[int, int]
    output_len: tuple[int, int]
    model: str = "tiny"


@dataclass(frozen=True)
class Sent:
    """One request: when it was sent (monotonic), to which engine, and what came back."""

    at: float
    url: str
    ok: bool
    ttft: float | None
    error: str | None


class ClosedLoad:
    """`clients` workers (changed at any time with `set_clients`), each sending one streamed request after
    another, each to the engine of `targets()` with the fewest of this load's requests in flight (ties in
    turn), as a least-request router spreads them. A closed loop's demand is its clients: once there are as
    many free slots as clients no request waits, however slowly a shared machine runs the engines. Runs in a
    thread of its own between `start()` and `stop()`."""

    def __init__(
        self, targets: Callable[[], list[str]], shape: RequestShape, clients: int, seed: int = 7
    ) -> None:
        self.targets, self.shape, self.clients = targets, shape, clients
        self.rng = random.Random(seed)
        self.sent: list[Sent] = []
        self.in_flight: dict[str, int] = {}
        self.stopping = threading.Event()
        self.thread = threading.Thread(
            target=lambda: asyncio.run(self.drive()), name="closed load", daemon=True
        )
        self.turn = 0

    def set_clients(self, clients: int) -> None:
        self.clients = clients

    def start(self) -> ClosedLoad:
        self.thread.start()
        return self

    def stop(self, timeout: float = 60.0) -> None:
        self.stopping.set()
        self.thread.join(timeout)

    def since(self, began: float, ended: float | None = None) -> list[Sent]:
        return [s for s in list(self.sent) if s.at >= began and (ended is None or s.at < ended)]

    def body(self) -> dict[str, Any]:
        prompt = [self.rng.randrange(32, 127) for _ in range(self.rng.randint(*self.shape.prompt_len))]
        return {"model": self.shape.model, "prompt": prompt, "max_tokens": self.rng.randint(*self.shape.output_len),
                "ignore_eos": True, "temperature": 0.0, "stream": True}  # fmt: skip

    def pick(self) -> str | None:
        urls = sorted(self.targets())
        if not urls:
            return None
        self.turn += 1
        return min(
            urls, key=lambda url: (self.in_flight.get(url, 0), (urls.index(url) - self.turn) % len(urls))
        )

    async def client(self, http: httpx.AsyncClient, index: int) -> None:
        while not self.stopping.is_set() and index < self.clients:
            url, at = self.pick(), time.monotonic()
            if url is None:
                self.sent.append(Sent(at, "", False, None, "no engine to send to"))
                await asyncio.sleep(0.5)
                continue
            self.in_flight[url] = self.in_flight.get(url, 0) + 1
            try:
                result = await stream_completion(http, url, self.body())
            finally:
                self.in_flight[url] -= 1
            self.sent.append(Sent(at, url, result.ok, result.ttft, result.error))
            if not result.ok:
                await asyncio.sleep(0.5)  # an engine that went: its pod is leaving the targets

    async def drive(self) -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=httpx.Timeout(120, connect=10), limits=limits) as http:
            workers: dict[int, asyncio.Task[None]] = {}
            while not self.stopping.is_set():
                for index in range(self.clients):
                    if index not in workers or workers[index].done():
                        workers[index] = asyncio.create_task(self.client(http, index))
                await asyncio.sleep(0.1)  # set_clients takes effect within this
            await asyncio.wait(workers.values(), timeout=60)


@dataclass(frozen=True)
class Counters:
    """An engine's queue-time histogram (cumulative per bucket) and preemptions, as its /metrics says."""

    buckets: dict[float, float]
    preemptions: float


def read_counters(url: str) -> Counters:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    buckets: dict[float, float] = {}
    for bound, value in QUEUE_BUCKET.findall(text):
        buckets[float(bound)] = buckets.get(float(bound), 0.0) + float(value)
    return Counters(buckets, sum(float(v) for v in PREEMPTIONS.findall(text)))


@dataclass(frozen=True)
class WindowReading:
    """What the engines and the clients saw over one window: preemptions, the engines' p95 queue wait (the
    upper edge of its bucket), and the clients' p95 time to first token."""

    seconds: float
    engines: int
    requests: int
    failed: int
    preemptions: float
    p95_queue_bucket: float | None
    p95_ttft: float | None

    def line(self) -> str:
        bucket = "n/a" if self.p95_queue_bucket is None else f"<= {self.p95_queue_bucket:g} s"
        ttft = "n/a" if self.p95_ttft is None else f"{self.p95_ttft:.3f} s"
        return (f"{self.engines} engines, {self.requests} requests ({self.failed} failed) in {self.seconds:.0f} s: "
                f"{self.preemptions:.0f} preemptions, p95 queue wait {bucket} (engines' histogram), "
                f"p95 time to first token {ttft}")  # fmt: skip


def percentile(values: list[float], share: float) -> float | None:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(share * len(ordered)) - 1)] if ordered else None


def p95_bucket(before: dict[float, float], after: dict[float, float]) -> float | None:
    delta = {bound: after[bound] - before.get(bound, 0.0) for bound in sorted(after)}
    total = delta.get(math.inf, max(delta.values(), default=0.0))
    if total <= 0:
        return None
    return next(bound for bound in sorted(delta) if delta[bound] >= 0.95 * total)


def observe_window(engines: PodEngines, load: ClosedLoad, seconds: float) -> WindowReading:
    """The engines that run now, over the next `seconds` (one measurement window: its length is the
    evidence's, not a wait for an event). An engine that goes meanwhile is a failure of the window."""
    running = {name: engine.url for name, engine in engines.engines().items()}
    before = {name: read_counters(url) for name, url in running.items()}
    began = time.monotonic()
    engines.stopping.wait(seconds)
    ended = time.monotonic()
    after = {name: read_counters(url) for name, url in running.items()}
    assert set(engines.engines()) == set(running), (
        f"the engines changed inside the window: {engines.describe()}"
    )
    buckets_before: dict[float, float] = {}
    buckets_after: dict[float, float] = {}
    for name in running:
        for bound, value in before[name].buckets.items():
            buckets_before[bound] = buckets_before.get(bound, 0.0) + value
        for bound, value in after[name].buckets.items():
            buckets_after[bound] = buckets_after.get(bound, 0.0) + value
    sent = load.since(
        began, ended - 2.0
    )  # a request sent in the last seconds may not have its first token yet
    return WindowReading(
        ended - began, len(running), len(sent), sum(not s.ok for s in sent),
        sum(after[n].preemptions - before[n].preemptions for n in running),
        p95_bucket(buckets_before, buckets_after), percentile([s.ttft for s in sent if s.ttft is not None], 0.95),
    )  # fmt: skip


class SliceMirror:
    """The Service's EndpointSlice, rewritten whenever the set of answering engines changes: the
    EndpointSlice controller's job for a selector Service, with readiness meaning the engine answers
    (kwok marks a pod Ready before its engine has booted)."""

    def __init__(
        self, cluster: Cluster, engines: PodEngines, namespace: str, service: str, port: int
    ) -> None:
        self.cluster, self.engines = cluster, engines
        self.namespace, self.service, self.port = namespace, service, port
        self.stopping = threading.Event()
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self.mirror, name=f"slice of {service}", daemon=True)

    def start(self) -> SliceMirror:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopping.set()
        with self.engines.lock:
            self.engines.lock.notify_all()
        self.thread.join(30)
        if self.errors:
            raise self.errors[0]

    def mirror(self) -> None:
        written: dict[str, str] | None = None
        try:
            while not self.stopping.is_set():
                now = {name: engine.host for name, engine in self.engines.engines().items()}
                if now != written:
                    self.cluster.apply(endpoint_slice(self.namespace, self.service, self.port, now))
                    written = now
                with self.engines.lock:
                    self.engines.lock.wait(1.0)  # woken at every change of the engines; 1 s a safety net
        except BaseException as err:
            self.errors.append(err)


@dataclass
class Timeline:
    """The Deployment's spec.replicas, its answering engines and the operator's desiredReplicas, sampled
    every half second by a thread and kept where any of them changed; load steps are marked in it."""

    cluster: Cluster
    engines: PodEngines
    namespace: str
    deployment: str
    policy: str
    began: float = field(default_factory=time.monotonic)
    rows: list[tuple[float, int, int, int | None, str]] = field(default_factory=list)
    stopping: threading.Event = field(default_factory=threading.Event)
    errors: list[BaseException] = field(default_factory=list)

    def start(self) -> Timeline:
        threading.Thread(target=self.sample, name="replica timeline", daemon=True).start()
        return self

    def stop(self) -> None:
        self.stopping.set()
        if self.errors:
            raise self.errors[0]

    def mark(self, note: str) -> float:
        now = time.monotonic()
        last = self.rows[-1] if self.rows else (0.0, 0, 0, None, "")
        self.rows.append((now - self.began, last[1], last[2], last[3], note))
        return now

    def replicas(self) -> int:
        found = client.AppsV1Api(self.cluster.api).read_namespaced_deployment(self.deployment, self.namespace)
        return int(found.spec.replicas or 0)

    def scaling(self) -> dict[str, Any]:
        found: dict[str, Any] = (
            self.cluster.policy(self.namespace, self.policy).get("status", {}).get("scaling") or {}
        )
        return found

    def sample(self) -> None:
        """A row wherever a count changed; where the operator's count did, what it read the demand from."""
        try:
            while not self.stopping.is_set():
                scaling = self.scaling()
                row = (self.replicas(), len(self.engines.engines()), scaling.get("desiredReplicas"))
                if not self.rows or self.rows[-1][1:4] != row:
                    said = not self.rows or self.rows[-1][3] != row[2]
                    why = (
                        f"{scaling.get('demand')}: {scaling.get('demandEvidence')}" if said and row[2] else ""
                    )
                    self.rows.append((time.monotonic() - self.began, *row, why))
                self.stopping.wait(0.5)
        except BaseException as err:
            self.errors.append(err)

    def between(self, began: float, ended: float) -> list[int]:
        """spec.replicas over [began, ended] (monotonic), the count in force at `began` first."""
        start, end = began - self.began, ended - self.began
        before = [r[1] for r in self.rows if r[0] <= start]
        inside = [r[1] for r in self.rows if start < r[0] <= end]
        return ([before[-1]] if before else []) + inside

    def first(self, check: Callable[[int], bool], after: float, column: int = 1) -> float | None:
        """When (monotonic) spec.replicas (column 1; 2: the answering engines) first satisfied `check` at or
        after `after`."""
        rows = [r for r in self.rows if r[0] >= after - self.began]
        return next((self.began + r[0] for r in rows if check(int(r[column] or 0))), None)

    def render(self) -> str:
        lines = ["   t (s)  spec.replicas  engines  desiredReplicas  note"]
        lines += [f"{t:8.1f}  {spec:13d}  {up:7d}  {desired if desired is not None else '-':>15}  {note}"
                  for t, spec, up, desired, note in self.rows]  # fmt: skip
        return "\n".join(lines)


def direction_changes(counts: list[int]) -> int:
    """How often a count sequence turned from rising to falling or back."""
    steps = [b - a for a, b in pairwise(counts) if b != a]
    return sum(1 for a, b in pairwise(steps) if (a > 0) != (b > 0))
