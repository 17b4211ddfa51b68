"""The chart installs, upgrades and uninstalls with Helm 3 and with Helm 4 on the real API server, and a
release Helm 3 installed is upgraded and uninstalled by Helm 4 (the path of a user who moves to Helm 4).

Each pair runs in namespaces of its own, with a release of its own (monitoring off, so nothing here is
scraped or reconciled by whatever else the e2e run starts): `helm install` as the README writes it
(`--set-json`, `--create-namespace`) watching two namespaces; `helm upgrade -f values.yaml` dropping one,
adding a replica and allowing Apply; `helm uninstall`. After each, what the API server holds is what the
release's manifest says, polled until it is."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml
from kubernetes.dynamic import DynamicClient
from kubernetes.dynamic.exceptions import NotFoundError

from tests.chart.helm_versions import require
from tests.e2e.cluster import CHART, REGISTRY, Cluster, wait_for

KVTUNE_CRD = "kvtuningpolicies.kvtune.dev"
PAIRS = [
    ("helm3", "helm3"),
    ("helm4", "helm4"),
    ("helm3", "helm4"),
]  # (installs, then upgrades and uninstalls)


def run_helm(cluster: Cluster, helm: str, *args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([helm, *args], capture_output=True, text=True, timeout=180, env=cluster.env())
    assert done.returncode == 0, (
        f"`{helm} {' '.join(args)}` failed ({done.returncode}): {done.stderr.strip()}"
    )
    return done


def manifest(cluster: Cluster, helm: str, release: str, namespace: str) -> set[tuple[str, str, str, str]]:
    """(apiVersion, kind, namespace, name) of every object the release's current revision holds."""
    text = run_helm(cluster, helm, "get", "manifest", release, "--namespace", namespace).stdout
    objects = [doc for doc in yaml.safe_load_all(text) if doc]
    return {(o["apiVersion"], o["kind"], o["metadata"].get("namespace", namespace), o["metadata"]["name"])
            for o in objects}  # fmt: skip


def present(api: DynamicClient, objects: set[tuple[str, str, str, str]]) -> set[tuple[str, str, str, str]]:
    """Those of `objects` the API server holds."""
    found = set()
    for api_version, kind, namespace, name in objects:
        resource = api.resources.get(api_version=api_version, kind=kind)
        try:
            resource.get(name=name, namespace=namespace if resource.namespaced else None)
        except NotFoundError:
            continue
        found.add((api_version, kind, namespace, name))
    return found


def deployment_args(cluster: Cluster, name: str, namespace: str) -> list[str]:
    deployment = cluster.get("deployment", name, namespace)
    args: list[str] = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    return args


def revisions(cluster: Cluster, helm: str, release: str, namespace: str) -> list[tuple[int, str]]:
    history = run_helm(cluster, helm, "history", release, "--namespace", namespace, "-o", "json").stdout
    return [(entry["revision"], entry["status"]) for entry in json.loads(history)]


@pytest.mark.parametrize(("installer", "upgrader"), PAIRS, ids=[f"{a}-then-{b}" for a, b in PAIRS])
def test_install_upgrade_and_uninstall(
    cluster: Cluster, installer: str, upgrader: str, tmp_path: Path
) -> None:
    install_helm, install_version = require(installer)
    upgrade_helm, upgrade_version = require(upgrader)
    print(f"installing with helm {install_version}, upgrading and uninstalling with helm {upgrade_version}")
    release = f"kvtune-{installer}-{upgrader}"  # it contains the chart's name: the objects are named after it
    namespace = f"{release}-system"
    kept, dropped = cluster.namespace(f"{release}-a"), cluster.namespace(f"{release}-b")
    api = DynamicClient(cluster.api)

    run_helm(cluster, install_helm, "install", release, str(CHART), "--namespace", namespace,
             "--create-namespace", "--set", f"image.repository={REGISTRY}/kvtune-operator",
             "--set", "monitoring.enabled=false",
             "--set-json", f"watchNamespaces={json.dumps([kept, dropped])}",
             "--wait", "--timeout", "90s")  # fmt: skip
    installed = manifest(cluster, install_helm, release, namespace)
    assert present(api, installed) == installed
    for watched in (kept, dropped):
        assert {("Role", watched), ("RoleBinding", watched), ("KopfPeering", watched)} <= {
            (kind, ns) for _, kind, ns, name in installed if name == release
        }
    args = deployment_args(cluster, release, namespace)
    assert args[args.index("--max-mode") + 1] == "Recommend", args
    assert [args[i + 1] for i, arg in enumerate(args) if arg == "--namespace"] == [kept, dropped], args
    assert not any(kind == "PodDisruptionBudget" for _, kind, _, _ in installed)

    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({
        "image": {"repository": f"{REGISTRY}/kvtune-operator"}, "monitoring": {"enabled": False},
        "watchNamespaces": [kept], "replicas": 2, "maxMode": "Apply",
    }))  # fmt: skip
    run_helm(cluster, upgrade_helm, "upgrade", release, str(CHART), "--namespace", namespace,
             "-f", str(values), "--wait", "--timeout", "90s")  # fmt: skip
    upgraded = manifest(cluster, upgrade_helm, release, namespace)
    assert {ns for _, _, ns, _ in installed - upgraded} == {dropped}, installed - upgraded
    assert {kind for _, kind, _, _ in upgraded - installed} == {"PodDisruptionBudget"}, upgraded - installed
    wait_for(f"the upgrade's objects, and none of those it dropped ({dropped})",
             lambda: present(api, installed | upgraded) == upgraded)  # fmt: skip
    args = deployment_args(cluster, release, namespace)
    assert args[args.index("--max-mode") + 1] == "Apply", args
    assert [args[i + 1] for i, arg in enumerate(args) if arg == "--namespace"] == [kept], args
    assert cluster.get("deployment", release, namespace)["spec"]["replicas"] == 2
    assert revisions(cluster, upgrade_helm, release, namespace) == [(1, "superseded"), (2, "deployed")]

    run_helm(cluster, upgrade_helm, "uninstall", release, "--namespace", namespace)
    wait_for(f"every object of release {release} gone", lambda: not present(api, installed | upgraded))
    gone = subprocess.run([upgrade_helm, "status", release, "--namespace", namespace], capture_output=True,
                          text=True, timeout=60, env=cluster.env())  # fmt: skip
    assert gone.returncode != 0 and "not found" in gone.stderr, gone  # no revision kept
    assert cluster.kubectl("get", "crd", KVTUNE_CRD).returncode == 0  # Helm never deletes crds/
