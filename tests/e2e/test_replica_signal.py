"""The replica signal against the real API, with the operator as the chart's ServiceAccount: it lists the
autoscalers of its workload (RBAC included), says the replicas the load needs in status, withdraws the
signal with an AutoscalerConflict condition and Event when a second autoscaler targets the same Deployment,
and never writes spec.replicas: a count set through the scale subresource, as an autoscaler sets it, stands
through the operator's evaluations, and no field manager of kvtune's owns it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from kvtune.harness.server import ServerProcess
from kvtune.operator.k8s.kube_api import FIELD_MANAGER
from tests.e2e.cluster import Cluster, Operator, kwok_node, wait_for
from tests.e2e.workloads import (
    endpoint_slice,
    engine_port,
    pods_policy,
    preempting_load,
    service,
    vllm_deployment,
)

NAME = "sized-vllm"
SERVICE = "sized-vllm-engine"
POOL = "sized-vllm"
# a hang deadline: the first signal needs a fit (finished requests) and one replica-count search, seconds
# each on a busy 2-core machine
SIGNAL_TIMEOUT_S = 240.0


def hpa(namespace: str, name: str, metric: str) -> dict[str, Any]:
    """An HPA on an external metric, as production-stack's or a platform team's would be."""
    return {
        "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": NAME},
                 "minReplicas": 1, "maxReplicas": 6,
                 "metrics": [{"type": "External", "external": {"metric": {"name": metric},
                                                               "target": {"type": "AverageValue", "averageValue": "1"}}}]},
    }  # fmt: skip


@pytest.fixture(scope="module")
def sized(
    cluster: Cluster, acting_release: dict[str, str], operator: Operator, engines: list[ServerProcess]
) -> Iterator[str]:
    """A vLLM Deployment of 3 under a preempting load, its policy asking for the replica signal."""
    namespace = acting_release["watch"]
    port = engine_port(engines)
    kwok_node(cluster, f"{POOL}-0", POOL)
    pods = {f"{NAME}-pod-{i}": engine.url.split("//")[1].split(":")[0] for i, engine in enumerate(engines)}
    cluster.apply(vllm_deployment(NAME, namespace, POOL), service(namespace, SERVICE, port),
                  endpoint_slice(namespace, SERVICE, port, pods))  # fmt: skip
    policy = pods_policy(NAME, namespace, NAME, SERVICE, port)
    policy["spec"].update({"mode": "Recommend", "evaluationWindowSeconds": 5, "p95QueueWaitBoundSeconds": 2,
                           "scaling": {"minReplicas": 1, "maxReplicas": 6}})  # fmt: skip
    with preempting_load(engines):
        cluster.apply(policy)
        yield namespace
    cluster.kubectl("delete", "kvtp", NAME, "-n", namespace, "--ignore-not-found", "--wait=true")
    cluster.kubectl("delete", "hpa", "--all", "-n", namespace, "--ignore-not-found")


def scaling(cluster: Cluster, namespace: str) -> dict[str, Any]:
    status: dict[str, Any] = cluster.policy(namespace, NAME).get("status", {}).get("scaling") or {}
    return status


def test_one_autoscaler_is_told_the_replicas_the_load_needs(cluster: Cluster, sized: str) -> None:
    cluster.apply(hpa(sized, "kvtune-replicas", "kvtune_operator_desired_replicas"))

    seen: list[dict[str, Any]] = []

    def signalled() -> dict[str, Any] | None:
        found = scaling(cluster, sized)
        seen[:] = [found]
        ready = found.get("autoscalers") == ["HorizontalPodAutoscaler/kvtune-replicas"]
        return found if ready and found.get("demandCapacityRatio") else None

    try:
        found = wait_for("the replica signal in status", signalled, timeout=SIGNAL_TIMEOUT_S)
    except AssertionError as err:
        raise AssertionError(f"{err}; status.scaling at the end: {seen}") from None
    assert found.get("desiredReplicas"), found
    assert found["replicas"] == 3 and found["demand"].endswith(("clients", "requests/s")), found
    assert found["desiredReplicas"] >= 1 and found["maxNumSeqsPerReplica"] >= 1
    assert cluster.condition(sized, NAME, "AutoscalerConflict")["status"] == "False"


def test_a_second_autoscaler_withdraws_the_signal_with_a_condition(cluster: Cluster, sized: str) -> None:
    cluster.apply(hpa(sized, "queue-depth", "vllm:num_requests_waiting"))
    conflict = wait_for("AutoscalerConflict", lambda: (c := cluster.condition(sized, NAME, "AutoscalerConflict"))
                        and c["status"] == "True" and c)  # fmt: skip
    assert "HorizontalPodAutoscaler/queue-depth" in conflict["message"]
    assert "withdrawn" in (scaling(cluster, sized).get("held") or "")
    reasons = [e["reason"] for e in cluster.events(sized, NAME)]
    assert "AutoscalerConflict" in reasons
    cluster.kubectl("delete", "hpa", "queue-depth", "-n", sized)
    wait_for(
        "the conflict to clear",
        lambda: cluster.condition(sized, NAME, "AutoscalerConflict")["status"] == "False",
    )


def test_the_operator_never_writes_spec_replicas(cluster: Cluster, sized: str) -> None:
    apps = client.AppsV1Api(cluster.api)
    apps.patch_namespaced_deployment_scale(NAME, sized, {"spec": {"replicas": 5}})
    cluster.evaluations(sized, NAME, 3)
    deployment = cluster.get("deployment", NAME, sized)
    assert deployment["spec"]["replicas"] == 5
    owners = [entry for entry in deployment["metadata"]["managedFields"] if entry["manager"] == FIELD_MANAGER]
    assert all("f:replicas" not in str(entry.get("fieldsV1", {}).get("f:spec", {})) for entry in owners)
