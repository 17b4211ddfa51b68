"""The fleet's layout: every pod one endpoint of its own, each policy's manifests pointing at exactly the
endpoints its pods are replayed at, and the operator's CRD accepting every policy."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvtune.bench.fleet_layout import deployment, endpoint_slice, fleet, policy, service
from kvtune.operator.k8s.crd import KVTuningPolicySpec

ADDRESSES = [f"10.244.255.{i}" for i in range(2, 255)]


@given(policies=st.integers(1, 600), pods=st.integers(1, 253), per_namespace=st.integers(1, 50))
def test_every_pod_is_an_endpoint_of_its_own(policies: int, pods: int, per_namespace: int) -> None:
    plan = fleet(policies, pods, per_namespace, ADDRESSES, ["a", "b"], 15)
    endpoints = [(e["address"], e["port"]) for e in plan.endpoints()]
    assert len(endpoints) == len(set(endpoints)) == plan.pods == policies * pods
    assert len(plan.namespaces) == -(-policies // per_namespace)
    assert {p.namespace for p in plan.policies} == set(plan.namespaces)
    assert all(sum(p.namespace == ns for p in plan.policies) <= per_namespace for ns in plan.namespaces)


def test_a_policys_manifests_point_at_its_replayed_pods() -> None:
    plan = fleet(12, 3, 5, ADDRESSES, ["vllm", "kvtune"], 15)
    one = plan.policies[7]
    names = [f"{one.name}-abc-{i}" for i in range(3)]
    listed = endpoint_slice(one, names)
    assert [e["addresses"][0] for e in listed["endpoints"]] == list(one.addresses)
    assert [e["targetRef"]["name"] for e in listed["endpoints"]] == names
    assert listed["ports"][0]["port"] == one.port == service(one)["spec"]["ports"][0]["port"]
    assert listed["metadata"]["labels"]["kubernetes.io/service-name"] == service(one)["metadata"]["name"]
    assert deployment(one)["spec"]["replicas"] == 3
    spec = KVTuningPolicySpec.model_validate(policy(one, plan.interval_s)["spec"])
    assert spec.target.pod_endpoints is not None and spec.target.pod_endpoints.metrics_port == one.port
    assert spec.mode == "Recommend" and spec.target.engine == "vllm" and spec.interval_seconds == 15
    assert [p.recording for p in plan.policies[:3]] == ["vllm", "kvtune", "vllm"]


def test_with_prometheus_a_policy_reads_its_own_pods_series_by_pod() -> None:
    plan = fleet(12, 3, 5, ADDRESSES, ["vllm"], 15)
    three = plan.policies[3]
    spec = KVTuningPolicySpec.model_validate(policy(three, 15, "http://127.0.0.1:9090")["spec"])
    assert (
        spec.target.pod_endpoints is None and spec.metrics is not None and spec.metrics.prometheus is not None
    )
    assert spec.metrics.prometheus.by_pod and spec.metrics.prometheus.url == "http://127.0.0.1:9090"
    # engines-3's pods, not engines-30's or engines-31's: the regex needs the dash after the name
    assert spec.metrics.prometheus.selector == '{namespace="fleet-0",pod=~"engines-3-.+"}'
