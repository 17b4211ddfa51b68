"""The fleet on the local control plane (`kvtune bench fleet`): kwok nodes, the namespaces, each policy's
Deployment (its pods Running under kwok, their `status.podIP` set to their replayed address, as a kubelet
and a CNI would), Service, EndpointSlice and KVTuningPolicy, and the replay server answering every pod's
address inside the run's pod network. The e2e harness (tests/e2e) is handed in by the caller, which
imports it from the checkout.
"""

from __future__ import annotations

import ipaddress
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes import client

from kvtune.bench.fleet_layout import FLEET_LABEL, Fleet, deployment, endpoint_slice, fleet, policy, service

RELEASE, SYSTEM = "kvtune", "kvtune-system"
NODE_PODS = 1000  # pods the scheduler places on one kwok node
POD_WAIT_S = 900.0  # kwok makes every pod Running: a hang deadline, ended as soon as they are


def pod_addresses(network_module: Any, network: Any) -> list[str]:
    """Every address of the run's pod network's /24 but the host's end, added to the namespace's end of the
    veth where pod_network() has not (it adds a few, for the e2e engines)."""
    links = json.loads(network_module.ip("-n", network.name, "-j", "addr", "show").stdout)
    (inner,) = [link for link in links if link["ifname"] != "lo"]
    present = {info["local"] for info in inner.get("addr_info", []) if info.get("family") == "inet"}
    wanted = [str(host) for host in network.subnet.hosts() if str(host) != network.host_address]
    prefix = network.subnet.prefixlen
    for address in wanted:
        if address not in present:
            network_module.ip(
                "-n", network.name, "addr", "add", f"{address}/{prefix}", "dev", inner["ifname"]
            )
    return sorted(wanted, key=ipaddress.IPv4Address)


def nodes(e2e: Any, cluster: Any, pods: int) -> int:
    """Enough kwok nodes labelled for the fleet for `pods` pods; returns how many."""
    count = max(1, -(-pods // NODE_PODS))
    for k in range(count):
        e2e.kwok_node(cluster, f"fleet-node-{k}", "fleet", pods=NODE_PODS)
    return count


def namespaces(e2e: Any, api: client.ApiClient, fleet: Fleet) -> None:
    """The fleet's namespaces, each with its default ServiceAccount (which a pod needs to be admitted)."""
    core = client.CoreV1Api(api)
    for name in fleet.namespaces:
        body: Any = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}  # fmt: skip
        core.create_namespace(body)  # the client takes dicts

    def accounts() -> bool:
        listed: Any = core.list_service_account_for_all_namespaces(field_selector="metadata.name=default")
        return set(fleet.namespaces) <= {account.metadata.namespace for account in listed.items}

    e2e.wait_for("the default ServiceAccount of every fleet namespace", accounts)


def running_pods(api: client.ApiClient) -> dict[tuple[str, str], list[str]]:
    """(namespace, policy) -> its Running pods' names, sorted."""
    found: dict[tuple[str, str], list[str]] = {}
    listed: Any = client.CoreV1Api(api).list_pod_for_all_namespaces(
        label_selector=FLEET_LABEL, _preload_content=False
    )
    for pod in json.loads(listed.data)["items"]:
        if pod.get("status", {}).get("phase") != "Running" or pod["metadata"].get("deletionTimestamp"):
            continue
        key = (pod["metadata"]["namespace"], pod["metadata"]["labels"][FLEET_LABEL])
        found.setdefault(key, []).append(pod["metadata"]["name"])
    return {key: sorted(names) for key, names in found.items()}


def workloads(e2e: Any, api: client.ApiClient, fleet: Fleet) -> None:
    """Deployments and Services; once kwok runs every pod, each pod's IP set to its address and the
    Services' EndpointSlices listing them."""
    apps, core = client.AppsV1Api(api), client.CoreV1Api(api)
    discovery = client.DiscoveryV1Api(api)
    for plan in fleet.policies:
        manifests: tuple[Any, Any] = (deployment(plan), service(plan))  # the client takes dicts
        apps.create_namespaced_deployment(plan.namespace, manifests[0])
        core.create_namespaced_service(plan.namespace, manifests[1])
    wanted = {(plan.namespace, plan.name): len(plan.addresses) for plan in fleet.policies}

    def all_running() -> dict[tuple[str, str], list[str]] | None:
        found = running_pods(api)
        return found if all(len(found.get(key, [])) == count for key, count in wanted.items()) else None

    running = e2e.wait_for(f"kwok to run {fleet.pods} pods", all_running, timeout=POD_WAIT_S, every=2.0)
    for plan in fleet.policies:
        names = running[(plan.namespace, plan.name)]
        for name, address in zip(names, plan.addresses, strict=True):
            body = {"status": {"podIP": address, "podIPs": [{"ip": address}]}}
            core.patch_namespaced_pod_status(name, plan.namespace, body,
                                             _content_type="application/merge-patch+json")  # fmt: skip
        listing: Any = endpoint_slice(plan, names)
        discovery.create_namespaced_endpoint_slice(plan.namespace, listing)


def policies(api: client.ApiClient, fleet: Fleet, prometheus: str | None) -> None:
    custom = client.CustomObjectsApi(api)
    for plan in fleet.policies:
        custom.create_namespaced_custom_object("kvtune.dev", "v1alpha1", plan.namespace, "kvtuningpolicies",
                                               policy(plan, fleet.interval_s, prometheus))  # fmt: skip


def start_replay(
    network: Any, fleet: Fleet, recordings: dict[str, Path], versions: dict[str, str], folder: Path
) -> subprocess.Popen[str]:
    """The replay server inside the pod network, once it has bound every pod's endpoint; `versions`: the
    recorded engines' versions that their GET /version answers."""
    plan = folder / "replay-plan.json"
    given = {name: {"path": str(path), **({"version": versions[name]} if name in versions else {})}
             for name, path in recordings.items()}  # fmt: skip
    plan.write_text(json.dumps({"recordings": given, "endpoints": fleet.endpoints()}))
    log = (folder / "replay.log").open("w")
    argv = [sys.executable, "-m", "kvtune.bench.fleet_replay_server", str(plan)]
    server: subprocess.Popen[str] = network.run(
        subprocess.Popen, argv, stdout=subprocess.PIPE, stderr=log, text=True
    )
    assert server.stdout is not None
    line = server.stdout.readline().strip()  # its first line says it serves, or it has exited
    if not line.startswith("serving"):
        server.kill()
        raise RuntimeError(f"the replay server did not start: {(folder / 'replay.log').read_text()[-2000:]}")
    return server


def keep_only_read_series(cluster: Any) -> None:
    """Drop at scrape every series the operator does not read (a keep relabelling on the chart's
    PodMonitor): the Prometheus beside the control plane on a 2-core box then holds 5,000 pods, as a
    cluster's Prometheus on nodes of its own would."""
    from kvtune.operator.io.sources import READ_NAMES

    keep = [{"sourceLabels": ["__name__"], "regex": READ_NAMES, "action": "keep"}]
    patch = [{"op": "add", "path": "/spec/podMetricsEndpoints/0/metricRelabelings", "value": keep}]
    cluster.kubectl("patch", "podmonitor", f"{RELEASE}-engines", "-n", SYSTEM, "--type", "json",
                    "-p", json.dumps(patch))  # fmt: skip


@dataclass(frozen=True)
class FleetShape:
    policies: int
    pods_per_policy: int
    policies_per_namespace: int
    interval_s: int
    recordings: dict[str, Path]  # name -> its .prom, dealt to the policies in turn
    versions: dict[str, str]  # name -> what its engine's GET /version answered (where it has one)
    source: str = (
        "pods"  # "pods": each pod's /metrics; "prometheus": a Prometheus 3 scraping them (a PodMonitor)
    )
    workers: int | None = None  # the chart's `workers` (evaluations at once); None: the chart's default
    keep_read_series: bool = False  # the PodMonitor keeps only the series the operator reads


@dataclass(frozen=True)
class FleetWorld:
    cluster: Any  # tests.e2e.cluster.Cluster
    fleet: Fleet
    network: Any  # tests.e2e.pod_network.PodNetwork
    made_in_s: float
    prometheus: str | None  # its URL, with the prometheus source


@contextmanager
def fleet_on_cluster(e2e: Any, network_module: Any, folder: Path, shape: FleetShape) -> Iterator[FleetWorld]:
    """A fresh control plane and pod network with the chart installed (watching the fleet's namespaces) and
    the whole fleet in place, every pod answered by the replay server; the operator is the caller's to
    start (`e2e.chart_operator(world.cluster, RELEASE, SYSTEM, ...)`). With the prometheus source, the
    monitoring stack too, and the chart's PodMonitor over the fleet's pods at the policies' interval."""
    monitored = shape.source == "prometheus"
    with (
        network_module.pod_network() as network,
        e2e.control_plane(folder / "control-plane", monitoring=monitored) as cluster,
    ):
        addresses = pod_addresses(network_module, network)
        plan = fleet(shape.policies, shape.pods_per_policy, shape.policies_per_namespace, addresses,
                     list(shape.recordings), shape.interval_s)  # fmt: skip
        began = time.monotonic()
        nodes(e2e, cluster, plan.pods)
        namespaces(e2e, cluster.api, plan)
        selector = {"matchExpressions": [{"key": FLEET_LABEL, "operator": "Exists"}]}
        pod_monitor = ("--set", "monitoring.podMonitor.enabled=true",
                       "--set", f"monitoring.podMonitor.interval={shape.interval_s}s",
                       "--set-json", f"monitoring.podMonitor.selector={json.dumps(selector)}") if monitored else ()  # fmt: skip
        cluster.helm("install", RELEASE, str(e2e.CHART), "--namespace", SYSTEM, "--create-namespace",
                     "--set", f"image.repository={e2e.REGISTRY}/kvtune-operator",
                     "--set-json", f"watchNamespaces={json.dumps(list(plan.namespaces))}", *pod_monitor,
                     *(("--set", f"workers={shape.workers}") if shape.workers else ()))  # fmt: skip
        if monitored and shape.keep_read_series:
            keep_only_read_series(cluster)
        workloads(e2e, cluster.api, plan)
        replay = start_replay(network, plan, shape.recordings, shape.versions, folder)
        try:
            prometheus = cluster.monitoring["prometheus"] if monitored else None
            policies(cluster.api, plan, prometheus)
            yield FleetWorld(cluster, plan, network, time.monotonic() - began, prometheus)
        finally:
            replay.terminate()
            replay.wait(30)
