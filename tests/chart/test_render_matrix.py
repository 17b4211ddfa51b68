"""`helm lint`, and `helm template` over the matrix of installs: every built-in object valid against the
Kubernetes schemas (kubernetes-validate, strict: an unknown field fails), every custom resource (ours, and
the ServiceMonitor, PodMonitor and PrometheusRule against the Prometheus Operator's own CRDs) valid against
its CRD's openAPIV3Schema with unknown fields refused (the API server would prune them silently), the
PrometheusRule's groups through `promtool check rules`."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.chart.crd_schemas import CRD_FILES, chart_crds, closed
from tests.chart.helm import CHART, by_kind, helm, render
from tests.chart.matrix import MATRIX
from tests.observability.tools import require

KUBERNETES_VERSION = kubernetes_validate.latest_version()


@pytest.fixture(scope="module", params=sorted(MATRIX), ids=sorted(MATRIX))
def rendered(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> list[dict[str, Any]]:
    values, api_versions = MATRIX[request.param]
    return render(values, tmp_path_factory.mktemp(request.param), api_versions)


def test_helm_lint_passes() -> None:
    done = helm("lint", "--strict", CHART)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 chart(s) linted, 0 chart(s) failed" in done.stdout


def test_the_crds_are_valid_custom_resource_definitions() -> None:
    kinds = set()
    for path in CRD_FILES:
        for crd in yaml.safe_load_all(path.read_text()):
            kubernetes_validate.validate(crd, KUBERNETES_VERSION, strict=True)  # raises when invalid
            kinds.add((crd["spec"]["names"]["kind"], crd["spec"]["scope"]))
    assert not any(
        crd["spec"]["group"] == "monitoring.coreos.com"
        for crd in yaml.safe_load_all("---\n".join(path.read_text() for path in CRD_FILES))
    )  # the Prometheus Operator's are its own
    assert {("KopfPeering", "Namespaced"), ("ClusterKopfPeering", "Cluster")} <= kinds
    assert ("KVTuningPolicy", "Namespaced") in kinds


def test_every_built_in_object_is_valid_for_kubernetes(rendered: list[dict[str, Any]]) -> None:
    custom = chart_crds()
    for obj in rendered:
        if (obj["apiVersion"], obj["kind"]) in custom:
            continue
        name = f"{obj['kind']}/{obj['metadata']['name']}"
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as err:
            pytest.fail(
                f"{name} is not valid for Kubernetes {KUBERNETES_VERSION}: {err.message} at {err.path}"
            )


def test_every_custom_resource_matches_its_crd(rendered: list[dict[str, Any]]) -> None:
    custom = chart_crds()
    for obj in rendered:
        key = (obj["apiVersion"], obj["kind"])
        if key not in custom:
            continue
        errors = list(jsonschema.Draft7Validator(closed(custom[key])).iter_errors(obj))
        assert not errors, f"{obj['kind']}/{obj['metadata']['name']}: {[e.message for e in errors]}"


def test_the_prometheus_rules_pass_promtool(rendered: list[dict[str, Any]], tmp_path: Path) -> None:
    for rule in by_kind(rendered, "PrometheusRule"):
        assert rule["apiVersion"] == "monitoring.coreos.com/v1"
        groups_file = tmp_path / "groups.yaml"
        groups_file.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
        done = subprocess.run(
            [
                require("promtool"),
                "check",
                "rules",
                "--lint=duplicate-rules",
                "--lint-fatal",
                str(groups_file),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        count = sum(len(group["rules"]) for group in rule["spec"]["groups"])
        assert count and f"SUCCESS: {count} rules found" in done.stdout


def test_every_monitoring_object_is_checked_against_the_prometheus_operators_crds(
    rendered: list[dict[str, Any]],
) -> None:
    custom = chart_crds()
    for obj in rendered:
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            assert (obj["apiVersion"], obj["kind"]) in custom, obj["kind"]


def test_the_service_monitor_scrapes_the_operators_metrics_service(rendered: list[dict[str, Any]]) -> None:
    for monitor in by_kind(rendered, "ServiceMonitor"):
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
        services = [
            service
            for service in by_kind(rendered, "Service")
            if monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
        ]
        assert [s["metadata"]["name"] for s in services] == ["kvtune-metrics"]
        ports = {port["name"]: port["port"] for port in services[0]["spec"]["ports"]}
        (endpoint,) = monitor["spec"]["endpoints"]
        assert (endpoint["port"], endpoint["path"], ports[endpoint["port"]]) == ("metrics", "/metrics", 9100)
        assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["kvtune-system"]}


def test_a_misspelt_policy_field_is_refused_not_pruned() -> None:
    """The CRD check is only worth having if a field the API server would silently drop fails it."""
    schema = closed(chart_crds()[("kvtune.dev/v1alpha1", "KVTuningPolicy")])
    policy = {
        "apiVersion": "kvtune.dev/v1alpha1",
        "kind": "KVTuningPolicy",
        "metadata": {"name": "llama"},
        "spec": {
            "target": {"name": "llama", "engine": "vllm", "proxyAdminURL": "http://llama:8002"},
            "metrics": {"metricsUrl": "http://llama:8000/metrics"},
        },
    }
    errors = [error.message for error in jsonschema.Draft7Validator(schema).iter_errors(policy)]
    assert errors == ["Additional properties are not allowed ('proxyAdminURL' was unexpected)"]
    del policy["spec"]["target"]["proxyAdminURL"]
    assert not list(jsonschema.Draft7Validator(schema).iter_errors(policy))
