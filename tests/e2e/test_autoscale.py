"""Issue 36's must-hold lines, live: kvtune's replica signal sizing a Deployment of real engines through the
real KEDA and HPA (`local_cluster.py up --monitoring --keda`).

A Deployment of kvtune engines (kwok pods, each given a real engine at its pod IP by PodEngines) that run
one request at a time, so one replica's ceiling is one client; the chart with its ScaledObject on the
policy's `kvtune_operator_desired_replicas`, which Prometheus 3 scrapes from the operator through the chart's
ServiceMonitor; a closed-loop load spread over the engines that exist by fewest requests in flight, stepped
1x -> 3x -> 1x of that ceiling. After the step up the Deployment reaches, within two evaluation windows plus
the rollout, a count whose next window has no preemption and a p95 queue wait within the policy's bound; the
count turns at most once per load step; after the step down it scales back in. KEDA's HPA sets the
replicas; the operator never writes them. Run with -s for the timeline.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any

import pytest

from kvtune.harness.local_http import free_port
from kvtune.operator.k8s.kube_api import FIELD_MANAGER
from tests.e2e.autoscale_world import (
    ClosedLoad,
    RequestShape,
    Timeline,
    WindowReading,
    Workload,
    direction_changes,
    expose_operator_metrics,
    observe_window,
    scaled_engines,
)
from tests.e2e.cluster import (
    CHART,
    REGISTRY,
    Cluster,
    Operator,
    chart_operator,
    control_plane,
    wait_for,
)
from tests.e2e.pod_engines import PodEngines
from tests.e2e.pod_network import PodNetwork

RELEASE, SYSTEM, NAMESPACE = "kvtune", "kvtune-system", "autoscaled"
DEPLOYMENT, POLICY, SECRET = "scaled-kvtune", "scaled", "scaled-kvtune-admin"
WORKLOAD = Workload(NAMESPACE, DEPLOYMENT, "scaled-kvtune-engine", POLICY, SECRET)
# one request's worth of KV: at most 20 + 240 tokens, 17 blocks of 16, read from the engines' length buckets
# (12% wide) as up to about 290; two requests need at least 28 blocks. A replica runs one request at a time
# (max_num_seqs 1, the pool its ceiling), so one replica's ceiling is one client
KV_CACHE_TOKENS, MAX_NUM_SEQS = 304, 1
SHAPE = RequestShape(prompt_len=(10, 20), output_len=(200, 240))
WINDOW_S = 15  # the policy's evaluation window: one client finishes more than the fit's 20 requests in it
# the policy's p95 queue-wait bound, a bucket edge of the engines' queue-time histogram: a second client on a
# replica waits out a request of 200-240 tokens (about 0.45 s on this machine alone, longer when shared), a
# client alone never waits
BOUND_S = 0.3
ONE_X = 1  # clients: one replica's ceiling
MAX_REPLICAS = 4
SCALE_DOWN = {"stabilizationWindowSeconds": 15, "podsPerPeriod": 1, "periodSeconds": 10}
CHAIN_S = 20  # Prometheus' 1 s scrape, KEDA's query and the HPA controller's 5 s sync, after the signal moves
WAIT_S = 300.0  # a hang deadline: every wait ends at its event
FIRST_SIGNAL_S = 8 * WINDOW_S  # the operator's start, then an evaluation window of it: a hang deadline


@pytest.fixture(scope="module")
def autoscaled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A control plane of this module's own, `up --monitoring --keda`, and `down` after."""
    with control_plane(tmp_path_factory.mktemp("autoscale-control-plane"), monitoring=True, keda=True) as up:
        yield up


@pytest.fixture(scope="module")
def release(autoscaled: Cluster) -> str:
    """The chart allowed to act, its ServiceMonitor scraped every second, and one KEDA target: the policy's
    Deployment between 1 and MAX_REPLICAS, scaling in one pod per 10 s after 15 s of agreement."""
    autoscaled.namespace(NAMESPACE)
    target = {"namespace": NAMESPACE, "policy": POLICY, "deployment": DEPLOYMENT, "minReplicas": 1,
              "maxReplicas": MAX_REPLICAS}  # fmt: skip
    autoscaled.helm("install", RELEASE, str(CHART), "--namespace", SYSTEM, "--create-namespace",
                    "--set", f"image.repository={REGISTRY}/kvtune-operator", "--set", "maxMode=Apply",
                    "--set-json", f"watchNamespaces={json.dumps([NAMESPACE])}",
                    "--set-json", f"adminTokenSecrets={json.dumps([SECRET])}",
                    "--set", "monitoring.serviceMonitor.interval=1s",
                    "--set", "autoscaling.keda.enabled=true", "--set", "autoscaling.keda.pollingInterval=5",
                    "--set", f"autoscaling.keda.prometheusAddress={autoscaled.monitoring['prometheus']}",
                    "--set-json", f"autoscaling.targets={json.dumps([target])}",
                    "--set-json", f"autoscaling.scaleDown={json.dumps(SCALE_DOWN)}")  # fmt: skip
    return RELEASE


@pytest.fixture(scope="module")
def operator(
    autoscaled: Cluster, release: str, pods: PodNetwork, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Operator]:
    """The release's operator as a process (its ServiceAccount), its /metrics where the chart's ServiceMonitor
    scrapes it."""
    port = free_port()
    running = chart_operator(autoscaled, release, SYSTEM, tmp_path_factory.mktemp("operator") / "operator.log",
                             metrics_port=port).start()  # fmt: skip
    expose_operator_metrics(autoscaled, release, SYSTEM, pods.host_address, port)
    yield running
    running.stop()
    print(f"operator log: {running.log}")


@pytest.fixture(scope="module")
def engines(
    autoscaled: Cluster, operator: Operator, pods: PodNetwork, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PodEngines]:
    """The Deployment at one replica, an engine per pod, and the Service's slice kept to the engines. No
    waiting limit: an engine past its ceiling queues its arrivals (the demand the operator must see) rather
    than refusing them with 429 at 4 x max_num_seqs waiting."""
    flags = ("--kv-cache-tokens", str(KV_CACHE_TOKENS), "--max-num-seqs", str(MAX_NUM_SEQS),
             "--max-waiting-requests", "-1")  # fmt: skip
    with scaled_engines(
        autoscaled, pods, WORKLOAD, tmp_path_factory.mktemp("autoscaled-engines"), flags
    ) as running:
        yield running


def scaling(cluster: Cluster) -> dict[str, Any]:
    found: dict[str, Any] = cluster.policy(NAMESPACE, POLICY).get("status", {}).get("scaling") or {}
    return found


def holds(reading: WindowReading) -> bool:
    """No preemption, and the engines' own p95 queue wait within the bound (BOUND_S is a bucket edge)."""
    bucket = reading.p95_queue_bucket
    return reading.preemptions == 0 and reading.requests > 0 and bucket is not None and bucket <= BOUND_S


def evaluated_at(found: dict[str, Any]) -> float:
    stamp = found.get("evaluatedAt")
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp() if stamp else 0.0


def evaluated_after(cluster: Cluster, moment: float) -> Callable[[], dict[str, Any] | None]:
    """status.scaling once the operator has evaluated at or after `moment` (epoch seconds)."""

    def check() -> dict[str, Any] | None:
        found = scaling(cluster)
        return found if evaluated_at(found) >= moment else None

    return check


def settle(cluster: Cluster, engines: PodEngines, timeline: Timeline, load: ClosedLoad,
           wanted: Callable[[int], bool]) -> tuple[int, WindowReading]:  # fmt: skip
    """Until the Deployment stands at the operator's count (one `wanted`), every pod's engine answers, and
    an evaluation of a window wholly after that still says the count; then the count and the next window,
    in which neither the engines nor the count changed (else it waits again)."""
    deadline = time.monotonic() + WAIT_S

    def there() -> int | None:
        desired = scaling(cluster).get("desiredReplicas")
        count = timeline.replicas()
        return count if desired == count and wanted(count) else None

    while True:
        left = max(1.0, deadline - time.monotonic())
        count = wait_for("the Deployment at the operator's count", there, timeout=left)
        engines.wait_for_engines(count, timeout=left)
        up = time.time()
        fresh = wait_for("an evaluation of a window with every engine up", evaluated_after(cluster, up + WINDOW_S),
                         timeout=max(1.0, deadline - time.monotonic()))  # fmt: skip
        if fresh.get("desiredReplicas") != count or timeline.replicas() != count:
            continue
        try:
            reading = observe_window(engines, load, WINDOW_S)
        except AssertionError:
            if time.monotonic() > deadline:
                raise  # the count kept moving
            continue
        if timeline.replicas() == count:
            return count, reading


def test_the_replica_signal_sizes_a_deployment_through_keda(
    autoscaled: Cluster, engines: PodEngines, operator: Operator
) -> None:
    timeline = Timeline(autoscaled, engines, NAMESPACE, DEPLOYMENT, POLICY)
    load = ClosedLoad(lambda: [e.url for e in engines.engines().values()], SHAPE, ONE_X)
    readings: list[tuple[str, WindowReading]] = []
    try:
        autoscaled.apply(WORKLOAD.policy_manifest(WINDOW_S, BOUND_S, MAX_NUM_SEQS, MAX_REPLICAS))
        timeline.start()
        load.start()
        timeline.mark(f"load 1x ({ONE_X} client)")
        try:
            first = wait_for("the first replica signal", lambda: scaling(autoscaled).get("desiredReplicas") and
                             scaling(autoscaled), timeout=FIRST_SIGNAL_S)  # fmt: skip
        except AssertionError as missed:
            raise AssertionError(f"{missed}; status.scaling: {scaling(autoscaled)}") from None
        print(f"first signal at 1x: {first}")
        (scaled_object,) = [item["metadata"]["name"] for item in json.loads(autoscaled.kubectl(
            "get", "scaledobjects.keda.sh", "-n", NAMESPACE, "-o", "json").stdout)["items"]]  # fmt: skip
        hpa = wait_for(f"KEDA's HPA keda-hpa-{scaled_object}", lambda: json.loads(autoscaled.kubectl(
            "get", "hpa", f"keda-hpa-{scaled_object}", "-n", NAMESPACE, "-o", "json", check=False).stdout or "{}"),
            timeout=WAIT_S)  # fmt: skip
        assert hpa["spec"]["scaleTargetRef"]["name"] == DEPLOYMENT, hpa["spec"]
        one, at_one = settle(autoscaled, engines, timeline, load, lambda count: count == 1)
        readings.append(("1x, 1 replica", at_one))
        ratio_at_one = scaling(autoscaled).get("demandCapacityRatio")
        print(f"1x on one replica: {at_one.line()}; operator: {scaling(autoscaled)}")

        stepped_up = timeline.mark(f"load 3x ({3 * ONE_X} clients)")
        load.set_clients(3 * ONE_X)
        peak, at_peak = settle(autoscaled, engines, timeline, load, lambda count: count > 1)
        readings.append((f"3x, {peak} replicas", at_peak))
        reached = timeline.first(lambda count: count == peak, stepped_up)
        ready_at = timeline.first(lambda count: count == peak, stepped_up, column=2)
        assert reached is not None and ready_at is not None, timeline.render()

        stepped_down = timeline.mark(f"load 1x ({ONE_X} client)")
        load.set_clients(ONE_X)
        back, at_back = settle(autoscaled, engines, timeline, load, lambda count: count < peak)
        readings.append((f"1x again, {back} replicas", at_back))
        ended = timeline.mark("end")
    finally:
        load.stop()
        timeline.stop()
        print("\n" + timeline.render())
        for what, reading in readings:
            print(f"{what}: {reading.line()}")
    print(f"3x reached {peak} replicas {reached - stepped_up:.1f} s after the step "
          f"(bound: 2 windows {2 * WINDOW_S} s + the signal's chain {CHAIN_S} s); engines all answering "
          f"{ready_at - stepped_up:.1f} s after it (rollout included); demand/capacity at 1x {ratio_at_one}")  # fmt: skip

    assert one == 1 and holds(at_one), f"1x is not within one replica's ceiling: {at_one.line()}"
    assert holds(at_peak), f"{peak} replicas do not hold 3x: {at_peak.line()}"
    assert reached - stepped_up <= 2 * WINDOW_S + CHAIN_S, timeline.render()
    assert back < peak and holds(at_back), at_back.line()
    falling = timeline.between(stepped_down, ended)
    assert max(falling) == peak, f"the count rose after the load fell: {falling}\n{timeline.render()}"
    for began, until in ((stepped_up, stepped_down), (stepped_down, ended)):
        counts = timeline.between(began, until)
        assert direction_changes(counts) <= 1, (counts, timeline.render())
    deployment = autoscaled.get("deployment", DEPLOYMENT, NAMESPACE)
    owners = [e for e in deployment["metadata"]["managedFields"] if e["manager"] == FIELD_MANAGER]
    assert all("f:replicas" not in str(e.get("fieldsV1", {}).get("f:spec", {})) for e in owners), owners
