"""The kvtune engine's Deployment that the pod-engines test scales (test_pod_engines.py): its name,
namespace, kwok pool and container port, and its manifest, which the autoscaling harness (autoscale_world.py)
reuses for its own workload."""

from __future__ import annotations

from tests.e2e.workloads import POOL_LABEL

NAME, NAMESPACE, POOL = "scaled-kvtune", "pod-engines", "pod-engines"
PORT = 8000  # the container's port: every pod's engine listens on it, at the pod's own address


def kvtune_deployment(replicas: int, name: str = NAME) -> dict[str, object]:
    """The kvtune engine's Deployment shape (test_kvtune_deployment's), its pods on POOL's kwok node."""
    return {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": name}}, "template": {
            "metadata": {"labels": {"app": name}},
            "spec": {"nodeSelector": {POOL_LABEL: POOL}, "containers": [{
                "name": "engine", "image": "ghcr.io/kvtune/kvtune-engine:0.1.0",
                "args": ["serve", "--tiny", "--port", str(PORT), "--admin-token-file", "/var/run/kvtune/admin/token"],
                "ports": [{"name": "http", "containerPort": PORT}]}]}}},
    }  # fmt: skip
