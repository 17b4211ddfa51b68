"""The chart on a real API server: `helm install` as the README says; a release whose every object the API
server accepts (CRDs, RBAC, the operator's Deployment, which rolls out, its Service, the peering object, the
dashboards' ConfigMaps); without an image repository, a refusal that names it and installs nothing; the
ServiceMonitor and PrometheusRule once the Prometheus Operator's CRDs (its own, at the pinned release) are
served; `helm upgrade` with changed values; `helm uninstall` keeping the CRDs, as documented.

The tests of this module run in order on one release (install, then upgrades, then uninstall)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.chart.monitoring_crds import monitoring_crds as prometheus_operator_crds
from tests.e2e.cluster import CHART, REGISTRY, Cluster, serve_monitoring_crds

NAMESPACE = "chart-e2e"
RELEASE = "kvtune-chart"  # the chart's objects are named after it
IMAGE = ("--set", f"image.repository={REGISTRY}/kvtune-operator")
KVTUNE_CRDS = ("kvtuningpolicies.kvtune.dev", "kopfpeerings.kopf.dev", "clusterkopfpeerings.kopf.dev")


def names(cluster: Cluster, kind: str, namespace: str | None = NAMESPACE, selector: str = "") -> set[str]:
    where = ["-n", namespace] if namespace else []
    found = cluster.kubectl("get", kind, *where, *(["-l", selector] if selector else []), "-o", "json").stdout
    return {item["metadata"]["name"] for item in json.loads(found)["items"]}


def rolled_out(cluster: Cluster, deployment: str, namespace: str = NAMESPACE) -> None:
    cluster.kubectl("rollout", "status", f"deployment/{deployment}", "-n", namespace, "--timeout", "90s")


@pytest.fixture(scope="module")
def monitoring_crds(cluster: Cluster) -> Iterator[None]:
    """The Prometheus Operator's group, served only by the tests that ask for it, and removed after."""
    yield
    for crd in prometheus_operator_crds():
        cluster.kubectl("delete", "crd", crd["metadata"]["name"], "--ignore-not-found", "--wait=true")


def test_the_readme_install_command_works(cluster: Cluster, release: dict[str, str]) -> None:
    """The README's `helm install` (run by the `release` fixture, word for word) gave a deployed release
    whose operator rolls out, and `kubectl get kvtp` answers in the watched namespace."""
    status = json.loads(
        cluster.helm("status", release["name"], "-n", release["namespace"], "-o", "json").stdout
    )
    assert status["info"]["status"] == "deployed"
    rolled_out(cluster, release["name"], release["namespace"])
    assert names(cluster, "roles", release["watch"]) == {release["name"]}
    assert cluster.kubectl("get", "kvtp", "-n", release["watch"]).returncode == 0


def test_without_an_image_repository_the_install_is_refused_and_leaves_nothing(cluster: Cluster) -> None:
    """Nothing publishes the image: the chart refuses to install without the reader's repository, rather
    than leave a pod in ImagePullBackOff."""
    refused = cluster.helm("install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--create-namespace",
                           check=False)  # fmt: skip
    assert refused.returncode != 0
    assert "image.repository is not set: build the image" in refused.stderr, refused.stderr
    missing = cluster.helm("status", RELEASE, "-n", NAMESPACE, check=False)
    assert missing.returncode != 0 and "not found" in missing.stderr, missing


def test_install_without_the_monitoring_crds(cluster: Cluster, monitoring_crds: None) -> None:
    assert "monitoring.coreos.com" not in cluster.kubectl("api-versions").stdout
    cluster.helm("install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--create-namespace", *IMAGE)
    assert set(KVTUNE_CRDS) <= names(cluster, "crds", None)
    assert names(cluster, "serviceaccounts") >= {RELEASE}
    assert names(cluster, "roles") == {RELEASE} and names(cluster, "rolebindings") == {RELEASE}
    assert names(cluster, "deployments") == {RELEASE}
    assert names(cluster, "services") == {f"{RELEASE}-metrics"}
    assert names(cluster, "kopfpeerings.kopf.dev") == {RELEASE}
    assert len(names(cluster, "configmaps", selector="grafana_dashboard=1")) == 3
    rolled_out(cluster, RELEASE)  # the pod template (security context, probes, volumes) is admitted and runs


def test_with_the_monitoring_crds_the_service_monitor_and_rules_are_accepted(
    cluster: Cluster, monitoring_crds: None
) -> None:
    serve_monitoring_crds(cluster)
    cluster.helm("upgrade", RELEASE, str(CHART), "--namespace", NAMESPACE, "--reuse-values")
    assert names(cluster, "servicemonitors.monitoring.coreos.com") == {RELEASE}
    (rule,) = json.loads(cluster.kubectl("get", "prometheusrules.monitoring.coreos.com", "-n", NAMESPACE,
                                         "-o", "json").stdout)["items"]  # fmt: skip
    alerts = [r["alert"] for group in rule["spec"]["groups"] for r in group["rules"] if "alert" in r]
    assert alerts, rule["spec"]["groups"]


def test_upgrade_with_changed_values(cluster: Cluster) -> None:
    cluster.helm("upgrade", RELEASE, str(CHART), "--namespace", NAMESPACE, "--reuse-values",
                 "--set", "replicas=2", "--set", "metricsPort=9200")  # fmt: skip
    deployment = cluster.get("deployment", RELEASE, NAMESPACE)
    assert deployment["spec"]["replicas"] == 2
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--metrics-port") + 1] == "9200"
    assert cluster.get("service", f"{RELEASE}-metrics", NAMESPACE)["spec"]["ports"][0]["port"] == 9200
    assert names(cluster, "poddisruptionbudgets") == {RELEASE}  # more than one replica: a PDB
    rolled_out(cluster, RELEASE)
    history = json.loads(cluster.helm("history", RELEASE, "-n", NAMESPACE, "-o", "json").stdout)
    assert [h["revision"] for h in history] == [1, 2, 3]


def test_uninstall_keeps_the_crds(cluster: Cluster, monitoring_crds: None) -> None:
    cluster.kubectl("apply", "-f", "-", stdin=json.dumps({
        "apiVersion": "kvtune.dev/v1alpha1", "kind": "KVTuningPolicy",
        "metadata": {"name": "kept", "namespace": NAMESPACE},
        "spec": {"target": {"name": "llama", "engine": "vllm"}, "metrics": {"metricsUrl": "http://llama:8000"}},
    }))  # fmt: skip
    cluster.helm("uninstall", RELEASE, "--namespace", NAMESPACE, "--wait", "--timeout", "90s")
    assert not names(cluster, "deployments") and not names(cluster, "roles")
    assert not names(cluster, "servicemonitors.monitoring.coreos.com")
    assert set(KVTUNE_CRDS) <= names(cluster, "crds", None)
    assert names(cluster, "kvtp") == {"kept"}  # the policy, its history with it, survives the uninstall
    cluster.kubectl("delete", "kvtp", "kept", "-n", NAMESPACE)
