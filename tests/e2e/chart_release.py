"""A release of the chart watching one namespace, and the manifests such a release acts on: a vLLM-shaped
Deployment or StatefulSet and a KVTuningPolicy. Shared by the RBAC, peering and fault tests
(test_rbac.py, test_peering.py, test_faults.py, test_faults_takeover.py, faults.py)."""

from __future__ import annotations

import json
from typing import Any

from tests.e2e.cluster import CHART, REGISTRY, Cluster


def install(
    cluster: Cluster, release: str, namespace: str, secrets: tuple[str, ...] = (), max_mode: str = "Apply"
) -> None:
    """A release watching `namespace`, with the README's image repository; allowed to act (maxMode=Apply, as
    the README's "Letting it act" says) unless `max_mode` says otherwise."""
    cluster.namespace(namespace)
    cluster.helm("install", release, str(CHART), "--namespace", f"{release}-system", "--create-namespace",
                 "--set", f"image.repository={REGISTRY}/kvtune-operator", "--set", f"maxMode={max_mode}",
                 "--set-json", f"watchNamespaces={json.dumps([namespace])}",
                 "--set-json", f"adminTokenSecrets={json.dumps(list(secrets))}")  # fmt: skip


def workload(kind: str, name: str, namespace: str, image: str, args: list[str]) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "replicas": 1, "selector": {"matchLabels": {"app": name}},
        "template": {"metadata": {"labels": {"app": name}}, "spec": {
            "nodeSelector": {"kvtune-e2e/pool": "rbac"},
            "containers": [{"name": "vllm", "image": image, "args": args}]}},
    }  # fmt: skip
    if kind == "StatefulSet":
        spec["serviceName"] = name
    return {
        "apiVersion": "apps/v1",
        "kind": kind,
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }


def policy(name: str, namespace: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "kvtune.dev/v1alpha1", "kind": "KVTuningPolicy",
            "metadata": {"name": name, "namespace": namespace}, "spec": spec}  # fmt: skip
