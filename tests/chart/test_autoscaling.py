"""Replicas through the cluster's autoscaler (issue 36): `autoscaling.targets` renders a KEDA ScaledObject or an
autoscaling/v2 HPA per target, reading kvtune_operator_desired_replicas, never both and nothing by default;
the values a target needs fail the render by name; the operator may list both kinds of autoscaler and write
neither (kvtune never writes spec.replicas). KEDA's CRD is not among the schemas here: the ScaledObject is
checked field by field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from kvtune.operator.io.own_metrics import OperatorMetrics
from tests.chart.helm import by_kind, render, template

NS = "inference"
LLAMA = {"namespace": NS, "policy": "llama", "deployment": "llama-vllm", "minReplicas": 2, "maxReplicas": 8}
QWEN = {"namespace": NS, "policy": "qwen", "deployment": "qwen-vllm"}  # the bounds' defaults: 1 and 16
PROMETHEUS = "http://prometheus-operated.monitoring:9090"
SCALE_DOWN = {
    "scaleDown": {
        "stabilizationWindowSeconds": 120,
        "policies": [{"type": "Pods", "value": 1, "periodSeconds": 60}],
    }
}


def values(
    keda: bool = False, hpa: bool = False, targets: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    return {
        "watchNamespaces": [NS],
        "autoscaling": {
            "targets": [LLAMA, QWEN] if targets is None else targets,
            "keda": {"enabled": keda, "prometheusAddress": PROMETHEUS},
            "hpa": {"enabled": hpa},
        },
    }


def autoscalers(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return by_kind(objects, "ScaledObject") + by_kind(objects, "HorizontalPodAutoscaler")


def refused(values: dict[str, Any], tmp_path: Path) -> str:
    done = template(values, tmp_path)
    assert done.returncode != 0, "rendered, should have failed"
    return done.stderr


def test_nothing_is_rendered_by_default_nor_with_targets_and_no_autoscaler(tmp_path: Path) -> None:
    assert autoscalers(render({}, tmp_path)) == []
    assert autoscalers(render(values(), tmp_path)) == []


def test_keda_renders_one_scaled_object_per_target_on_the_operators_series(tmp_path: Path) -> None:
    objects = render(values(keda=True), tmp_path)
    assert by_kind(objects, "HorizontalPodAutoscaler") == []
    llama, qwen = by_kind(objects, "ScaledObject")
    assert llama["apiVersion"] == "keda.sh/v1alpha1"
    assert llama["metadata"]["namespace"] == NS and llama["metadata"]["name"] == "kvtune-llama"
    assert llama["metadata"]["labels"]["app.kubernetes.io/instance"] == "kvtune"
    assert llama["spec"] == {
        "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "llama-vllm"},
        "minReplicaCount": 2,
        "maxReplicaCount": 8,
        "pollingInterval": 15,
        "cooldownPeriod": 300,
        "advanced": {"horizontalPodAutoscalerConfig": {"behavior": SCALE_DOWN}},
        "triggers": [
            {
                "type": "prometheus",
                # AverageValue over threshold 1: ceil(value) replicas, the signal itself
                "metricType": "AverageValue",
                "metadata": {
                    "serverAddress": PROMETHEUS,
                    "query": 'max(kvtune_operator_desired_replicas{namespace="inference",policy="llama"})',
                    "threshold": "1",
                    # a withdrawn (absent) series is an error, so the HPA holds rather than read 0
                    "ignoreNullValues": "false",
                },
            }
        ],
    }
    assert qwen["metadata"]["name"] == "kvtune-qwen"
    assert qwen["spec"]["scaleTargetRef"]["name"] == "qwen-vllm"
    assert (qwen["spec"]["minReplicaCount"], qwen["spec"]["maxReplicaCount"]) == (1, 16)
    query = qwen["spec"]["triggers"][0]["metadata"]["query"]
    assert query == 'max(kvtune_operator_desired_replicas{namespace="inference",policy="qwen"})'


def test_the_scale_down_behaviour_follows_the_values(tmp_path: Path) -> None:
    slow = values(keda=True, targets=[LLAMA])
    slow["autoscaling"]["scaleDown"] = {
        "stabilizationWindowSeconds": 600,
        "podsPerPeriod": 2,
        "periodSeconds": 300,
    }
    (scaled,) = by_kind(render(slow, tmp_path), "ScaledObject")
    assert scaled["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"] == {
        "scaleDown": {
            "stabilizationWindowSeconds": 600,
            "policies": [{"type": "Pods", "value": 2, "periodSeconds": 300}],
        }
    }


def test_hpa_renders_one_valid_hpa_per_target_on_the_external_metric(tmp_path: Path) -> None:
    objects = render(values(hpa=True), tmp_path)
    assert by_kind(objects, "ScaledObject") == []
    llama, qwen = by_kind(objects, "HorizontalPodAutoscaler")
    for hpa in (llama, qwen):
        kubernetes_validate.validate(hpa, kubernetes_validate.latest_version(), strict=True)
    assert llama["apiVersion"] == "autoscaling/v2"
    assert llama["metadata"]["namespace"] == NS and llama["metadata"]["name"] == "kvtune-llama"
    assert llama["spec"] == {
        "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "llama-vllm"},
        "minReplicas": 2,
        "maxReplicas": 8,
        "metrics": [
            {
                "type": "External",
                "external": {
                    "metric": {
                        "name": "kvtune_operator_desired_replicas",
                        "selector": {"matchLabels": {"namespace": NS, "policy": "llama"}},
                    },
                    "target": {"type": "AverageValue", "averageValue": "1"},
                },
            }
        ],
        "behavior": SCALE_DOWN,
    }
    assert (qwen["spec"]["minReplicas"], qwen["spec"]["maxReplicas"]) == (1, 16)
    assert qwen["spec"]["metrics"][0]["external"]["metric"]["selector"]["matchLabels"]["policy"] == "qwen"


def test_the_series_read_is_the_one_the_operator_exports_with_its_labels() -> None:
    metrics = OperatorMetrics()
    assert "kvtune_operator_desired_replicas" in {family.name for family in metrics.registry.collect()}
    metrics.desired_replicas.labels(namespace=NS, policy="llama").set(3)  # exactly these two labels


def test_keda_and_hpa_together_fail_the_render(tmp_path: Path) -> None:
    stderr = refused(values(keda=True, hpa=True), tmp_path)
    assert "autoscaling.keda.enabled and autoscaling.hpa.enabled are both true" in stderr
    assert "two autoscalers on one Deployment fight over its replicas" in stderr


@pytest.mark.parametrize("field", ["namespace", "policy", "deployment"])
def test_a_target_without_a_required_field_fails_the_render_naming_it(field: str, tmp_path: Path) -> None:
    target = {key: value for key, value in LLAMA.items() if key != field}
    stderr = refused(values(keda=True, targets=[QWEN, target]), tmp_path)
    assert f"autoscaling.targets[1] has no {field}" in stderr, stderr


@pytest.mark.parametrize(
    ("target", "message"),
    [
        (
            {**LLAMA, "minReplicas": 9},
            "autoscaling.targets[0] (inference/llama): minReplicas is above maxReplicas",
        ),
        ({**LLAMA, "namespace": "elsewhere"}, "namespace elsewhere is not watched by this release"),
    ],
)
def test_a_target_that_cannot_work_fails_the_render(
    target: dict[str, Any], message: str, tmp_path: Path
) -> None:
    assert message in refused(values(hpa=True, targets=[target]), tmp_path)


def test_two_targets_on_one_deployment_fail_the_render(tmp_path: Path) -> None:
    twice = [LLAMA, {**QWEN, "deployment": LLAMA["deployment"]}]
    stderr = refused(values(keda=True, targets=twice), tmp_path)
    assert "Deployment inference/llama-vllm is already a target" in stderr


def test_cluster_wide_a_target_may_be_in_any_namespace(tmp_path: Path) -> None:
    anywhere = {**values(keda=True, targets=[{**LLAMA, "namespace": "team-c"}]), "watchNamespaces": []}
    (scaled,) = by_kind(render({**anywhere, "clusterWide": True}, tmp_path), "ScaledObject")
    assert scaled["metadata"]["namespace"] == "team-c"


@pytest.mark.parametrize(
    "target",
    [{**LLAMA, "replicas": 3}, {**LLAMA, "minReplicas": 0}, {**LLAMA, "deployment": "Llama_vLLM"}],
)
def test_the_schema_refuses_a_malformed_target(target: dict[str, Any], tmp_path: Path) -> None:
    assert "values don't meet the specifications of the schema" in refused(
        values(keda=True, targets=[target]), tmp_path
    )


def test_the_operator_may_list_both_kinds_of_autoscaler_and_write_neither(tmp_path: Path) -> None:
    namespaced = by_kind(render({"watchNamespaces": [NS, "team-b"]}, tmp_path), "Role")
    cluster_wide = by_kind(render({"clusterWide": True}, tmp_path), "ClusterRole")
    operator_roles = [role for role in namespaced + cluster_wide if role["metadata"]["name"] == "kvtune"]
    assert len(operator_roles) == 3
    for role in operator_roles:
        grants = {
            (group, resource): rule["verbs"]
            for rule in role["rules"]
            for group in rule["apiGroups"]
            for resource in rule["resources"]
        }
        assert grants[("autoscaling", "horizontalpodautoscalers")] == ["list"]
        assert grants[("keda.sh", "scaledobjects")] == ["list"]
        # spec.replicas is the autoscaler's: no scale subresource, and the Deployment's patch is its template's
        assert not any(resource.endswith("/scale") for _, resource in grants)
