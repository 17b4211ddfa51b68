"""The operator tests' shared fixtures: the Kubernetes emulator (kmock, with our resources declared and a
kubeconfig pointing at it), a metrics server answering recorded expositions, and a workload of pods behind
EndpointSlices. The plain builders they use live in kmock_world.py and pods_world.py."""

from __future__ import annotations

from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import kmock
import pytest

from tests.operator.helpers import local_url, serving
from tests.operator.kmock_world import NS, MetricsHandler, OptimisticEmulator
from tests.operator.pods_world import SLICES, Workload, free_port


@pytest.fixture
def metrics_server() -> Iterator[ThreadingHTTPServer]:
    files = ["kvtune_preempting_t0.prom", "kvtune_preempting_t1.prom"]
    with serving(MetricsHandler, files=files, admin_tokens=[]) as server:
        yield server


@pytest.fixture
def metrics_url(metrics_server: ThreadingHTTPServer) -> str:
    return local_url(metrics_server)


@pytest.fixture
def kmock_options(kmock_options: dict[str, Any]) -> dict[str, Any]:
    """Every operator test's emulator keeps the API server's optimistic concurrency (OptimisticEmulator), so
    no test need name it in a kmock marker."""
    return {**kmock_options, "cls": OptimisticEmulator}


@pytest.fixture
def kube(kmock: OptimisticEmulator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> OptimisticEmulator:
    """The emulator with our resources declared, and a kubeconfig pointing at it (as kopf and our client
    would find in a cluster's kubeconfig)."""
    kmock.answered = []
    kmock.resources["kvtune.dev/v1alpha1/kvtuningpolicies"] = kmock.ResourceInfo(
        kind="KVTuningPolicy", namespaced=True, subresources={"status"},
        verbs={"get", "list", "watch", "patch", "update"},
    )  # fmt: skip
    kmock.resources["apps/v1/deployments"] = kmock.ResourceInfo(
        kind="Deployment", namespaced=True, verbs={"get", "list", "watch", "patch"}
    )
    kmock.resources["v1/events"] = kmock.ResourceInfo(kind="Event", namespaced=True)
    kmock.resources["v1/secrets"] = kmock.ResourceInfo(kind="Secret", namespaced=True)
    # kopf's backbone: it must discover namespaces (kmock 0.8 cannot parse /api/v1/namespaces, so the test
    # turns kopf's namespace and CRD scanning off and names the namespace)
    kmock.resources["v1/namespaces"] = kmock.ResourceInfo(kind="Namespace", namespaced=False)
    config = tmp_path / "kubeconfig"
    config.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: kmock\n"
        f"clusters: [{{name: kmock, cluster: {{server: '{str(kmock.url).rstrip('/')}'}}}}]\n"
        "users: [{name: tester, user: {token: test-token}}]\n"
        "contexts: [{name: kmock, context: {cluster: kmock, user: tester, namespace: inference}}]\n"
    )
    monkeypatch.setenv("KUBECONFIG", str(config))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    return kmock


@pytest.fixture
def workload(kube: OptimisticEmulator) -> Iterator[Workload]:
    kube.resources["discovery.k8s.io/v1/endpointslices"] = kmock.ResourceInfo(
        kind="EndpointSlice", namespaced=True, verbs={"list", "watch"}
    )
    # another Service's slice in the namespace: its pod (nothing listens there) is never read
    kube.objects[SLICES, NS, "other-xyz"] = {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": "other-xyz", "namespace": NS, "labels": {"kubernetes.io/service-name": "other"}},
        "addressType": "IPv4", "ports": [{"port": 9}],
        "endpoints": [{"addresses": ["127.0.0.9"], "targetRef": {"kind": "Pod", "name": "other-0"}}],
    }  # fmt: skip
    found = Workload(kube, free_port(["127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"]))
    yield found
    found.close()
