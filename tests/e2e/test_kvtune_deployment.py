"""A kvtune Deployment of 3 replicas: the operator (a process, as the chart's ServiceAccount) finds the pods
through the Service's EndpointSlices, reads the admin token from the Secret the policy names (the only
Secret its Role lets it read), and sets the one value it decides on every engine's admin API, live: the
Deployment is never patched, so nothing restarts."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvtune.harness.server import ServerProcess
from tests.e2e.cluster import Cluster, Operator, kwok_node, wait_for
from tests.e2e.workloads import (
    ADMIN_TOKEN,
    MAX_NUM_SEQS,
    endpoint_slice,
    engine_port,
    pods_policy,
    preempting_load,
    service,
)

NAME = "tiny-kvtune"


def admin(engine: ServerProcess, method: str = "GET", body: dict[str, Any] | None = None) -> dict[str, Any]:
    answer = httpx.request(method, f"{engine.url}/admin/config", json=body, timeout=10,
                           headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})  # fmt: skip
    answer.raise_for_status()
    found: dict[str, Any] = answer.json()
    return found


@pytest.fixture(scope="module")
def world(
    cluster: Cluster, acting_release: dict[str, str], operator: Operator, engines: list[ServerProcess]
) -> Iterator[dict[str, Any]]:
    namespace = acting_release["watch"]
    port = engine_port(engines)
    kwok_node(cluster, "kvtune-main", "kvtune")
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": NAME, "namespace": namespace},
        "spec": {"replicas": 3, "selector": {"matchLabels": {"app": NAME}}, "template": {
            "metadata": {"labels": {"app": NAME}},
            "spec": {"nodeSelector": {"kvtune-e2e/pool": "kvtune"}, "containers": [{
                "name": "engine", "image": "ghcr.io/kvtune/kvtune-engine:0.1.0",
                "args": ["serve", "--tiny", "--port", "8000", "--admin-token-file", "/var/run/kvtune/admin/token"]}]}}},
    }  # fmt: skip
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": acting_release["secret"], "namespace": namespace},
              "data": {"token": base64.b64encode(ADMIN_TOKEN.encode()).decode()}}  # fmt: skip
    pods = {f"{NAME}-pod-{i}": engine.url.split("//")[1].split(":")[0] for i, engine in enumerate(engines)}
    cluster.apply(
        deployment, secret, service(namespace, NAME, port), endpoint_slice(namespace, NAME, port, pods)
    )
    cluster.kubectl("rollout", "status", f"deployment/{NAME}", "-n", namespace, "--timeout", "90s")
    with preempting_load(engines):
        yield {"namespace": namespace, "port": port}
    cluster.kubectl("delete", "kvtp", NAME, "-n", namespace, "--ignore-not-found", "--wait=true")
    for engine in engines:  # the engines are the vLLM tests' too: back to where they started
        admin(engine, "PATCH", {"max_num_seqs": MAX_NUM_SEQS})


def test_the_admin_api_is_fanned_out_to_every_pod(
    cluster: Cluster, world: dict[str, Any], engines: list[ServerProcess], acting_release: dict[str, str]
) -> None:
    namespace = world["namespace"]
    before = cluster.get("deployment", NAME, namespace)
    cluster.apply(pods_policy(NAME, namespace, NAME, NAME, world["port"], engine="kvtune",
                              adminTokenSecretRef={"name": acting_release["secret"]}))  # fmt: skip
    (applied,) = wait_for("the operator to act", lambda: [
        e["message"] for e in cluster.events(namespace, NAME) if e["reason"] == "TuningApplied"])  # fmt: skip
    held = {admin(engine)["max_num_seqs"] for engine in engines}
    assert len(held) == 1 and held.pop() < MAX_NUM_SEQS, (held, applied)
    value = admin(engines[0])["max_num_seqs"]
    assert f"max_num_seqs: {MAX_NUM_SEQS} -> {value}" in applied
    status = wait_for("per-pod evidence in status", lambda: (s := cluster.policy(namespace, NAME)["status"])
                      .get("desired", {}).get("maxNumSeqs") == value and len(s.get("pods") or []) == 3 and s)  # fmt: skip
    assert {pod["name"] for pod in status["pods"]} == {f"{NAME}-pod-{i}" for i in range(3)}
    after = cluster.get("deployment", NAME, namespace)
    assert after["metadata"]["generation"] == before["metadata"]["generation"]  # live: no patch, no restart
    assert "workload" not in status  # no args to patch, no rollout to follow
    failures = [e["message"] for e in cluster.events(namespace, NAME) if e["type"] == "Warning"]
    assert not [m for m in failures if "forbidden" in m.lower()], failures
