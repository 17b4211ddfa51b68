"""The README's install section, run as written, in order, on a control plane of its own (it installs the
same release and namespaces as the README, which the other e2e tests' release already holds): a cluster
with kube-prometheus-stack's CRDs and a vLLM Deployment `llama-vllm` in namespace `inference`, as a reader
would have them, and a Prometheus at the address the README's policy names, scraping the Deployment's pods
(the three engines, under a load that preempts, labelled with the pods' names as a PodMonitor would). Then:

- the install block installs the release it says, in Recommend, and the operator the pod would run (as a
  process with the chart's ServiceAccount, its pod's args) comes up;
- the policy block creates the policy in Recommend, and the operator writes what it would change into its
  status and an Event, changing nothing;
- the uninstall block ends (the operator still runs, so kopf's finalizers come off), and leaves what the
  README says it leaves;
- every row of the install matrix, rendered by `helm template`, is accepted by the API server
  (`kubectl apply --dry-run=server`, strict field validation) with the monitoring CRDs present.

The tests of this module run in order: each continues from the state the one before left."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtune.harness.server import ServerProcess
from tests.chart.helm import CHART, template
from tests.chart.matrix import MATRIX
from tests.chart.release_build import digest
from tests.e2e.cluster import (
    REGISTRY,
    Cluster,
    Operator,
    chart_operator,
    control_plane,
    kwok_node,
    readme_release,
    serve_monitoring_crds,
    wait_for,
    wait_until_peered,
)
from tests.e2e.pod_network import PodNetwork
from tests.e2e.workloads import container, preempting_load, vllm_deployment
from tests.observability.live_stack import Process
from tests.observability.tools import require

WORKLOAD = "llama-vllm"  # the README policy's target
POLICY = "llama"
PROMETHEUS_HOST = "prometheus-operated.monitoring"  # the README policy's Prometheus, as the pod reaches it
PROMETHEUS_INDEX = 7  # its address in the pods' network
RECOMMEND_WAIT_S = 300.0  # the policy ticks every 15 s (its default): a recommendation in ~1 min is normal
COLUMNS = ["NAME", "MODE", "RUNNING", "READY", "CURRENT", "RECOMMENDED", "PREEMPTING", "AGE"]
README_CONDITIONS = ("Preempting", "KVSaturated", "PrefixCacheDefeated", "FP8Recommended", "Stable")


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A control plane of this module's own, `up` from nothing (about 10 s) and `down` after."""
    with control_plane(tmp_path_factory.mktemp("readme-control-plane")) as started:
        yield started


def prometheus_config(targets: dict[str, str], namespace: str) -> dict[str, Any]:
    """A scrape of each pod (pod name -> address) with the labels the Prometheus Operator gives a PodMonitor's
    targets (namespace, pod, container)."""
    return {
        "global": {"scrape_interval": "2s", "scrape_timeout": "2s"},
        "scrape_configs": [{
            "job_name": f"podMonitor/{namespace}/{WORKLOAD}/0",
            "honor_labels": True,
            "static_configs": [{"targets": [address], "labels": {"namespace": namespace, "pod": pod,
                                                                 "container": "vllm"}}
                               for pod, address in sorted(targets.items())],
        }],
    }  # fmt: skip


@pytest.fixture(scope="module")
def world(
    fresh: Cluster, pods: PodNetwork, engines: list[ServerProcess], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    """What the reader has before the README: kube-prometheus-stack's CRDs, the namespace vLLM runs in and
    its Deployment (rolled out), a Prometheus scraping its pods; and the operator's view of that cluster's
    DNS (an /etc/hosts of its own naming the Prometheus)."""
    folder = tmp_path_factory.mktemp("readme")
    release = readme_release()
    namespace = release["watch"]
    serve_monitoring_crds(fresh)
    fresh.namespace(namespace)
    kwok_node(fresh, "gpu-0", WORKLOAD)
    fresh.apply(vllm_deployment(WORKLOAD, namespace, WORKLOAD))
    fresh.kubectl("rollout", "status", f"deployment/{WORKLOAD}", "-n", namespace, "--timeout", "90s")
    pod_names = sorted(
        pod["metadata"]["name"] for pod in fresh_items(fresh, "pods", namespace, f"app={WORKLOAD}")
    )
    assert len(pod_names) == len(engines), pod_names
    targets = {pod: engine.url.split("//")[1] for pod, engine in zip(pod_names, engines, strict=True)}

    config = folder / "prometheus.yml"
    config.write_text(yaml.safe_dump(prometheus_config(targets, namespace)))
    address = f"{pods.address(PROMETHEUS_INDEX)}:9090"
    prometheus = pods.run(Process, "prometheus", [require("prometheus"), f"--config.file={config}",
                                                  f"--storage.tsdb.path={folder / 'tsdb'}",
                                                  f"--web.listen-address={address}"],
                          folder / "prometheus.log")  # fmt: skip
    hosts = folder / "hosts"  # this machine's, and the cluster DNS name of the Prometheus
    hosts.write_text(
        f"{Path('/etc/hosts').read_text()}\n{pods.address(PROMETHEUS_INDEX)} {PROMETHEUS_HOST}\n"
    )
    running: list[Operator] = []
    try:
        prometheus.wait_ready(f"http://{address}/-/ready")
        yield {"release": release, "namespace": namespace, "hosts": hosts, "folder": folder,
               "operators": running, "pods": pod_names, "engines": engines}  # fmt: skip
    finally:
        for operator in running:
            operator.stop()
        prometheus.stop()


def with_hosts(hosts: Path) -> list[str]:
    """A command prefix: the command runs in a mount namespace of its own where /etc/hosts is `hosts` (the
    cluster DNS a pod would have, for this one process)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.fail("`unshare` (util-linux) is not on PATH: the e2e run gives the README's operator the "
                    "cluster's name for Prometheus with it", pytrace=False)  # fmt: skip
    return [unshare, "--mount", "--propagation", "private", "--", "sh", "-c",
            'mount --bind "$0" /etc/hosts && exec "$@"', str(hosts)]  # fmt: skip


def fresh_items(
    cluster: Cluster, kind: str, namespace: str | None, selector: str = ""
) -> list[dict[str, Any]]:
    where = ["-n", namespace] if namespace else []
    found = cluster.kubectl("get", kind, *where, *(["-l", selector] if selector else []), "-o", "json").stdout
    items: list[dict[str, Any]] = json.loads(found)["items"]
    return items


def names(cluster: Cluster, kind: str, namespace: str | None) -> set[str]:
    return {item["metadata"]["name"] for item in fresh_items(cluster, kind, namespace)}


def test_the_install_block_installs_the_release_it_describes(fresh: Cluster, world: dict[str, Any]) -> None:
    release, namespace = world["release"], world["namespace"]
    name, system = release["name"], release["namespace"]
    before_generation = fresh.get("deployment", WORKLOAD, namespace)["metadata"]["generation"]

    printed = fresh.readme("install").stdout
    assert f'is installed as "{name}" in namespace {system}' in printed, printed
    assert f"{REGISTRY}/kvtune-operator:" in printed, printed
    assert f"watches KVTuningPolicies in: {namespace}" in printed, printed

    status = json.loads(fresh.helm("status", name, "-n", system, "-o", "json").stdout)
    assert status["info"]["status"] == "deployed"
    assert {"kvtuningpolicies.kvtune.dev", "kopfpeerings.kopf.dev"} <= names(fresh, "crds", None)
    operator = fresh.get("deployment", name, system)
    (pod,) = operator["spec"]["template"]["spec"]["containers"]
    version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    assert pod["image"] == f"{REGISTRY}/kvtune-operator:{version}@{digest('operator')}"  # pinned by digest
    assert pod["args"][pod["args"].index("--max-mode") + 1] == "Recommend"  # the chart's default ceiling
    assert pod["args"][pod["args"].index("--namespace") + 1] == namespace
    # the check `helm install` prints: the operator's Deployment rolls out
    for command in [line.strip() for line in printed.splitlines() if "rollout status" in line]:
        fresh.kubectl(*command.split()[1:], "--timeout", "90s")
    assert names(fresh, "roles", namespace) == {name} and names(fresh, "rolebindings", namespace) == {name}
    assert names(fresh, "kopfpeerings.kopf.dev", namespace) == {name}
    assert names(fresh, "services", system) == {f"{name}-metrics"}
    assert len(names(fresh, "configmaps", system)) >= 3  # the dashboards (and kube-root-ca.crt)
    # kube-prometheus-stack's CRDs are there: the operator's ServiceMonitor (its labels kept) and the rules
    (monitor,) = fresh_items(fresh, "servicemonitors", system)
    assert all(endpoint.get("honorLabels") for endpoint in monitor["spec"]["endpoints"]), monitor["spec"]
    assert names(fresh, "prometheusrules", system) == {name}
    assert fresh.get("deployment", WORKLOAD, namespace)["metadata"]["generation"] == before_generation

    # the operator the release's pod would run, here as a process with its ServiceAccount's token
    running = chart_operator(fresh, name, system, world["folder"] / "operator.log",
                             wrapper=with_hosts(world["hosts"])).start()  # fmt: skip
    world["operators"].append(running)
    wait_until_peered(fresh, running, namespace, running.peering)


def recommendation(cluster: Cluster, namespace: str) -> Callable[[], str | None]:
    """The policy's first TuningRecommended Event, once its status holds a recommendation too."""

    def check() -> str | None:
        if not (cluster.policy(namespace, POLICY).get("status") or {}).get("recommended"):
            return None
        events = cluster.events(namespace, POLICY)
        return next((e["message"] for e in events if e["reason"] == "TuningRecommended"), None)

    return check


def test_the_policy_block_recommends_and_changes_nothing(fresh: Cluster, world: dict[str, Any]) -> None:
    namespace = world["namespace"]
    before = fresh.get("deployment", WORKLOAD, namespace)

    with preempting_load(world["engines"]):  # vLLM under a load that preempts, while the policy is judged
        printed = fresh.readme("policy").stdout
        recommended = wait_for(
            "a recommendation in the policy's status and an Event",
            recommendation(fresh, namespace),
            timeout=RECOMMEND_WAIT_S,
        )
        status = fresh.policy(namespace, POLICY)["status"]  # as the tick that recommended left it
        row = fresh.kubectl("get", "kvtp", "-n", namespace).stdout.splitlines()[1].split()
    header, *rows = [line for line in printed.splitlines() if line.strip()][-2:]
    assert header.split() == COLUMNS, printed
    assert rows and rows[0].split()[:2] == [POLICY, "Recommend"], printed
    assert fresh.policy(namespace, POLICY)["spec"]["mode"] == "Recommend"

    value = status["recommended"]["maxNumSeqs"]
    assert status["mode"] == "Recommend" and value < 64, status
    assert " recommended: " in recommended and "worst pod llama-vllm-" in recommended, recommended
    assert any(f"worst pod {pod}:" in recommended for pod in world["pods"]), recommended  # by the pod label
    assert set(README_CONDITIONS) <= {c["type"] for c in status["conditions"]}, status["conditions"]
    preempting = next(c for c in status["conditions"] if c["type"] == "Preempting")
    assert preempting["status"] == "True", preempting
    worst = {pod["name"] for pod in status.get("pods") or []}
    assert worst <= set(world["pods"]) and worst, status.get("pods")  # each pod apart, by its own name
    assert row[:4] == [POLICY, "Recommend", "Recommend", "True"] and row[5] == str(value), row

    after = fresh.get("deployment", WORKLOAD, namespace)  # Recommend changes nothing
    assert after["metadata"]["generation"] == before["metadata"]["generation"]
    assert container(after, "vllm")["args"] == container(before, "vllm")["args"]
    assert not [e for e in fresh.events(namespace, POLICY) if e["reason"] == "TuningApplied"]


def test_the_uninstall_block_ends_and_leaves_what_the_readme_says(
    fresh: Cluster, world: dict[str, Any]
) -> None:
    namespace, system = world["namespace"], world["release"]["namespace"]
    (running,) = world["operators"]
    assert running.running(), running.output()[-3000:]  # it takes kopf's finalizers off the deleted policies
    before = fresh.get("deployment", WORKLOAD, namespace)

    fresh.readme("uninstall")

    gone = fresh.helm("status", world["release"]["name"], "-n", system, check=False)
    assert gone.returncode != 0 and "not found" in gone.stderr, gone
    assert not names(fresh, "deployments", system) and not names(fresh, "roles", namespace)
    assert not names(fresh, "servicemonitors", system) and not names(fresh, "prometheusrules", system)
    crds = names(fresh, "crds", None)
    assert "kvtuningpolicies.kvtune.dev" not in crds  # the block's optional last line
    assert {"kopfpeerings.kopf.dev", "clusterkopfpeerings.kopf.dev"} <= crds  # shared: never deleted for you
    after = fresh.get("deployment", WORKLOAD, namespace)  # deleting a policy undoes nothing: vLLM as it was
    assert container(after, "vllm")["args"] == container(before, "vllm")["args"]
    running.stop()


def test_every_row_of_the_install_matrix_is_accepted_by_the_api_server(
    fresh: Cluster, world: dict[str, Any], tmp_path: Path
) -> None:
    """`helm template` of each row (the chart tests' matrix), applied with --dry-run=server: admission,
    the built-in schemas and the CRDs' (kvtune's, kopf's, the Prometheus Operator's), unknown fields
    refused. The CRDs are applied as the README's upgrade does."""
    system = world["release"]["namespace"]
    fresh.kubectl("apply", "--server-side", "-f", str(CHART / "crds"))
    for crd in ("kvtuningpolicies.kvtune.dev", "kopfpeerings.kopf.dev"):
        fresh.kubectl("wait", "--for=condition=Established", f"crd/{crd}", "--timeout=60s")
    watched = {str(ns) for values, _ in MATRIX.values() for ns in values.get("watchNamespaces", [])}  # type: ignore[attr-defined]
    for namespace in sorted(watched | {system}):
        fresh.namespace(namespace)
    accepted = {}
    for row, (values, api_versions) in sorted(MATRIX.items()):
        folder = tmp_path / row
        folder.mkdir()
        rendered = template(values, folder, api_versions)
        assert rendered.returncode == 0, (row, rendered.stderr)
        objects = [doc for doc in yaml.safe_load_all(rendered.stdout) if doc]
        # helm puts an object that names no namespace in the release's; the others name theirs
        placed = [o for o in objects if o["metadata"].get("namespace")]
        unplaced = [o for o in objects if not o["metadata"].get("namespace")]
        lines = []
        for group, where in [(g, w) for g, w in ((placed, ()), (unplaced, ("-n", system))) if g]:
            done = fresh.kubectl("apply", "--dry-run=server", "--validate=strict", *where, "-f", "-",
                                 stdin=yaml.safe_dump_all(group), check=False)  # fmt: skip
            assert done.returncode == 0, f"{row}: {done.stderr}"
            lines += done.stdout.splitlines()
        assert len(lines) == len(objects) and all("(server dry run)" in line for line in lines), (row, lines)
        accepted[row] = len(lines)
    assert set(accepted) == set(MATRIX)
    print(f"install matrix rows accepted (objects each): {accepted}")
