"""The KVTuningPolicy CRD enforced by a real API server: every CEL rule refuses a spec that breaks it with the
CRD's own message, the schema refuses bad values, a good spec is accepted with its defaults filled in, and
`kubectl get kvtp` shows the printer columns."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
import yaml
from kubernetes import client

from tests.e2e.cluster import CHART, Cluster

NAMESPACE = "crd-e2e"
GOOD = {"target": {"name": "llama", "engine": "vllm"}, "metrics": {"metricsUrl": "http://llama:8000/metrics"}}
PODS = {"service": "llama", "metricsPort": 8000}
KVTUNE = {
    "name": "llama",
    "engine": "kvtune",
    "adminUrl": "http://llama:8000",
    "adminTokenSecretRef": {"name": "a"},
}
PROM = {"url": "http://prometheus:9090", "selector": '{job="vllm"}'}
TOKEN = {"name": "proxy-admin"}

# one spec per CEL rule of the CRD, breaking that rule only, and the message the CRD gives for it
BROKEN_RULES: list[tuple[dict[str, Any], str]] = [
    ({"target": {"name": "llama", "engine": "vllm", "podEndpoints": {**PODS, "metricsPath": "metrics"}}},
     "metricsPath is a path: it starts with /"),
    ({"target": {"name": "llama", "engine": "vllm", "podEndpoints": {**PODS, "proxyAdminPort": 8002}}},
     "proxyAdminPort goes with proxyPort"),
    ({**GOOD, "target": {"name": "llama", "engine": "kvtune"}},
     "a kvtune engine needs adminTokenSecretRef, and adminUrl or podEndpoints"),
    ({"target": {**KVTUNE, "podEndpoints": PODS}},
     "adminUrl reaches one pod: with podEndpoints the operator reaches every pod at its adminPort"),
    ({**GOOD, "target": {"name": "llama", "engine": "vllm", "proxyAdminUrl": "http://proxy:8001"}},
     "proxyAdminUrl needs proxyAdminTokenSecretRef"),
    ({**GOOD, "target": {"name": "llama", "engine": "vllm", "proxyAdminTokenSecretRef": TOKEN}},
     "proxyAdminTokenSecretRef goes with proxyAdminUrl or podEndpoints.proxyPort"),
    ({**GOOD, "target": {**KVTUNE, "proxyAdminUrl": "http://proxy:8001", "proxyAdminTokenSecretRef": TOKEN}},
     "a kvtune engine caps max_tokens itself: proxyAdminUrl is for vllm and sglang targets"),
    ({"target": {"name": "llama", "engine": "kvtune", "adminTokenSecretRef": {"name": "a"},
                 "podEndpoints": {**PODS, "proxyPort": 8001}}},
     "podEndpoints.proxyPort is for a vllm or sglang target with a kvtune proxy sidecar"),
    ({"target": {"name": "llama", "engine": "vllm", "proxyAdminUrl": "http://proxy:8001",
                 "proxyAdminTokenSecretRef": TOKEN, "podEndpoints": {**PODS, "proxyPort": 8001}}},
     "proxyAdminUrl reaches one proxy: with podEndpoints.proxyPort the operator reaches every pod's proxy"),
    ({**GOOD, "metrics": {"metricsUrl": "http://llama:8000/metrics", "prometheus": PROM}},
     "set exactly one of metricsUrl and prometheus"),
    ({**GOOD, "metrics": {"prometheus": PROM, "proxyMetricsUrl": "http://proxy:8001/metrics"}},
     "proxyMetricsUrl goes with metricsUrl"),
    ({**GOOD, "bounds": {"minMaxNumSeqs": 64, "maxMaxNumSeqs": 8}}, "minMaxNumSeqs > maxMaxNumSeqs"),
    ({"target": KVTUNE, "metrics": GOOD["metrics"], "restartBudget": {"maxRestarts": 1}},
     "restartBudget is for vllm and sglang targets"),
    ({**GOOD, "restartBudget": {"maxRestarts": 1, "maintenanceWindow": {"start": "02:00", "end": "02:00"}}},
     "a maintenance window needs an end different from its start"),
    ({"target": {"name": "llama", "engine": "vllm"}},
     "set metrics, or target.podEndpoints to read every pod's own /metrics"),
    ({"target": {"name": "llama", "engine": "vllm", "podEndpoints": PODS}, "metrics": GOOD["metrics"]},
     "metricsUrl reads one engine: with target.podEndpoints omit metrics"),
    ({"target": KVTUNE, "metrics": {"prometheus": {**PROM, "byPod": True}}},
     "prometheus.byPod on a kvtune engine needs target.podEndpoints"),
    ({**GOOD, "objective": "Goodput"}, "the Goodput objective needs p95QueueWaitBoundSeconds"),
]  # fmt: skip
# values the structural schema refuses, and what the API server says
BAD_VALUES: list[tuple[tuple[str, ...], object, str]] = [
    (("mode",), "Bogus", 'spec.mode: Unsupported value: "Bogus"'),
    (("target", "engine"), "tgi", 'spec.target.engine: Unsupported value: "tgi"'),
    (("target", "kind"), "DaemonSet", 'spec.target.kind: Unsupported value: "DaemonSet"'),
    (("intervalSeconds",), 0, "spec.intervalSeconds: Invalid value: 0: spec.intervalSeconds in body should be "
                               "greater than or equal to 1"),
    (("maxStep",), "ten", 'spec.maxStep: Invalid value: "string": spec.maxStep in body must be of type integer'),
]  # fmt: skip


def policy(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "kvtune.dev/v1alpha1", "kind": "KVTuningPolicy",
            "metadata": {"name": name, "namespace": NAMESPACE}, "spec": spec}  # fmt: skip


def refusal(cluster: Cluster, spec: dict[str, Any]) -> str:
    done = cluster.kubectl("create", "-f", "-", stdin=json.dumps(policy("refused", spec)), check=False)
    assert done.returncode != 0, f"the API server accepted {spec}"
    return done.stderr


@pytest.fixture(scope="module")
def crd_namespace(cluster: Cluster, release: dict[str, str]) -> str:
    """The CRD comes with the README's release (helm installs crds/ first)."""
    return cluster.namespace(NAMESPACE)


def cel_messages() -> set[str]:
    crd = yaml.safe_load((CHART / "crds" / "kvtuningpolicy.yaml").read_text())
    found: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            found.update(rule["message"] for rule in node.get("x-kubernetes-validations", []))
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(crd)
    return found


def test_every_cel_rule_refuses_with_its_message(cluster: Cluster, crd_namespace: str) -> None:
    covered = set()
    for spec, message in BROKEN_RULES:
        refused = refusal(cluster, spec)
        assert message in refused, (spec, refused)
        covered |= {full for full in cel_messages() if full.startswith(message)}
    assert covered == cel_messages(), f"CEL rules with no e2e case: {cel_messages() - covered}"


def test_the_schema_refuses_bad_values(cluster: Cluster, crd_namespace: str) -> None:
    for path, value, message in BAD_VALUES:
        spec = copy.deepcopy(GOOD)
        node = spec
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        refused = refusal(cluster, spec)
        assert message in refused, (path, value, refused)


def test_a_good_policy_gets_its_defaults_and_the_printer_columns(
    cluster: Cluster, crd_namespace: str
) -> None:
    cluster.kubectl("apply", "-f", "-", stdin=json.dumps(policy("good", GOOD)))
    stored = cluster.policy(NAMESPACE, "good")["spec"]
    assert (
        stored["mode"] == "Recommend"
        and stored["intervalSeconds"] == 15
        and stored["target"]["kind"] == "Deployment"
    )
    status = {"mode": "Recommend", "current": {"maxNumSeqs": 64}, "recommended": {"maxNumSeqs": 24}, "conditions": [
        {"type": "Preempting", "status": "True", "reason": "PreemptionsObserved", "message": "1.50 preemptions/s",
         "lastTransitionTime": "2026-12-02T00:00:00Z"},
        {"type": "Ready", "status": "False", "reason": "NoMetrics", "message": "no engine answered",
         "lastTransitionTime": "2026-12-02T00:00:00Z"}]}  # fmt: skip
    client.CustomObjectsApi(cluster.api).patch_namespaced_custom_object_status(
        "kvtune.dev", "v1alpha1", NAMESPACE, "kvtuningpolicies", "good", {"status": status}
    )
    header, row = cluster.kubectl("get", "kvtp", "good", "-n", NAMESPACE).stdout.splitlines()
    assert header.split() == [
        "NAME",
        "MODE",
        "RUNNING",
        "READY",
        "CURRENT",
        "RECOMMENDED",
        "PREEMPTING",
        "AGE",
    ]
    assert row.split()[:7] == ["good", "Recommend", "Recommend", "False", "64", "24", "True"]
