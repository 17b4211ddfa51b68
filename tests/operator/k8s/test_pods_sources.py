"""The parts of a many-replica policy below the kopf layer: which pods an EndpointSlice lists as ready,
Prometheus read pod by pod (the `pod` label) and pooled, the fan-out actuator's all-or-named-failure apply
and its split knobs, and the CRD fields that turn it on."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pydantic
import pytest

from kvtune.contract import metrics as m
from kvtune.operator.decide.pooling import PoolState
from kvtune.operator.decide.ports import ActuatorResult
from kvtune.operator.decide.sample import NoData, Sample
from kvtune.operator.io.actuators import FanOutActuator
from kvtune.operator.io.sources import PrometheusSource
from kvtune.operator.k8s.crd import KVTuningPolicySpec
from kvtune.operator.k8s.pods import Pod, PooledSource, pod_url, ready_pods
from tests.operator.crd_schema import assert_refused_by_schema_and_model, cel_rules, openapi_schema
from tests.operator.helpers import fixture_text, serve_routes


def endpoint(name: str, address: str, ready: bool | None = True) -> dict[str, Any]:
    conditions = {} if ready is None else {"ready": ready}
    return {"addresses": [address], "conditions": conditions, "targetRef": {"kind": "Pod", "name": name}}


def endpoint_slice(service: str, address_type: str, *endpoints: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"labels": {"kubernetes.io/service-name": service}}, "addressType": address_type,
            "endpoints": list(endpoints)}  # fmt: skip


def test_ready_pods_are_the_services_ready_endpoints_once_each() -> None:
    slices = [
        endpoint_slice("llama", "IPv4", endpoint("llama-b", "10.0.0.2"), endpoint("llama-a", "10.0.0.1"),
                       endpoint("llama-c", "10.0.0.3", ready=False), endpoint("llama-d", "10.0.0.4", ready=None)),
        endpoint_slice("llama", "IPv6", endpoint("llama-a", "fd00::1")),  # dual stack: the same pod again
        endpoint_slice("llama", "FQDN", endpoint("llama-e", "e.example")),
        endpoint_slice("other", "IPv4", endpoint("other-0", "10.0.1.1")),
    ]  # fmt: skip
    assert ready_pods(slices, "llama") == [
        Pod("llama-a", "10.0.0.1"),
        Pod("llama-b", "10.0.0.2"),
        Pod("llama-d", "10.0.0.4"),  # readiness unknown: ready, as the API advises
    ]
    assert pod_url("http", Pod("p", "fd00::1"), 8000, "/metrics") == "http://[fd00::1]:8000/metrics"


def by_pod_answer(pods: dict[str, str]) -> str:
    """A Prometheus instant-query answer holding each pod's scrape under its `pod` label."""
    from prometheus_client.parser import text_string_to_metric_families

    result = [
        {"metric": {"__name__": s.name, **s.labels, "pod": pod}, "value": [1000.0, repr(float(s.value))]}
        for pod, text in pods.items()
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]
    return json.dumps({"status": "success", "data": {"resultType": "vector", "result": result}})


def test_prometheus_by_pod_reads_each_pod_apart_and_pools_them() -> None:
    t0, t1 = fixture_text("kvtune_preempting_t0.prom"), fixture_text("kvtune_preempting_t1.prom")
    answers = [
        (200, "application/json", by_pod_answer({"llama-0": t0, "llama-1": t0})),
        (200, "application/json", by_pod_answer({"llama-0": t0, "llama-1": t0})),
        (200, "application/json", by_pod_answer({"llama-0": t1, "llama-1": t0})),
    ]
    for base in serve_routes({"/api/v1/query": answers}):
        prometheus = PrometheusSource(base, '{job="vllm"}')
        readings = prometheus.read_pods()
        assert not isinstance(readings, NoData) and set(readings) == {"llama-0", "llama-1"}
        assert all(isinstance(r, Sample) and r.counters[m.PREEMPTIONS] == 46 for r in readings.values())
        pooled = PooledSource(PrometheusSource(base, '{job="vllm"}'), PoolState(), horizon=60.0)
        first, second = pooled.read(), pooled.read()
        assert isinstance(first, Sample) and isinstance(second, Sample)
        assert (first.counters[m.PREEMPTIONS], second.counters[m.PREEMPTIONS]) == (92, 92 + 49)
        assert m.PROCESS_START not in second.gauges


def test_prometheus_by_pod_without_a_pod_label_is_no_data() -> None:
    plain = json.loads(by_pod_answer({"x": fixture_text("kvtune_preempting_t0.prom")}))
    for item in plain["data"]["result"]:
        del item["metric"]["pod"]
    for base in serve_routes({"/api/v1/query": [(200, "application/json", json.dumps(plain))]}):
        found = PrometheusSource(base, '{job="vllm"}').read_pods()
        assert isinstance(found, NoData) and "pod" in found.reason


def test_prometheus_by_pod_leaves_out_a_pod_without_engine_series() -> None:
    """A router in the namespace (vllm-project/router's own `vllm_router_*`) or a process that exports only
    its start time is no engine: the pods read are the engines."""
    router = (
        '# TYPE vllm_router_running_requests gauge\nvllm_router_running_requests{worker="http://a:8000"} 3\n'
        "# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds 1.7e9\n"
    )
    engine = fixture_text("kvtune_preempting_t0.prom")
    answer = by_pod_answer({"llama-0": engine, "router-0": router, "llama-1": engine})
    for base in serve_routes({"/api/v1/query": [(200, "application/json", answer)]}):
        readings = PrometheusSource(base, 'namespace="inference"').read_pods()
        assert not isinstance(readings, NoData) and sorted(readings) == ["llama-0", "llama-1"]


class Engine:
    """One pod's knobs behind the Actuator protocol (or a pod that cannot be reached)."""

    knobs = frozenset({"max_num_seqs"})

    def __init__(self, max_num_seqs: int, reachable: bool = True) -> None:
        self.values: dict[str, int | None] = {"max_num_seqs": max_num_seqs}
        self.reachable = reachable

    def current(self) -> ActuatorResult:
        return (
            ActuatorResult(True, dict(self.values))
            if self.reachable
            else ActuatorResult(False, {}, "refused")
        )

    def apply(self, knob: str, value: int | str | None, cause: str = "") -> ActuatorResult:
        if not self.reachable:
            return ActuatorResult(False, {}, "refused")
        assert isinstance(value, int)
        self.values[knob] = value
        return ActuatorResult(True, dict(self.values))


def test_fan_out_applies_to_every_pod_and_names_the_ones_that_failed() -> None:
    pods = {"a": Engine(20), "b": Engine(20), "c": Engine(64)}
    fan = FanOutActuator(pods, frozenset({"max_num_seqs"}))
    held = fan.current()
    assert held.ok and held.values == {"max_num_seqs": None} and held.split == {"max_num_seqs"}
    done = fan.apply("max_num_seqs", 20)
    assert done.ok and done.values == {"max_num_seqs": 20} and not done.split
    assert {name: pod.values["max_num_seqs"] for name, pod in pods.items()} == {"a": 20, "b": 20, "c": 20}
    assert fan.held == {"a": {"max_num_seqs": 20}, "b": {"max_num_seqs": 20}, "c": {"max_num_seqs": 20}}
    pods["b"].reachable = False
    failed = fan.apply("max_num_seqs", 12)
    assert not failed.ok and failed.error == "pod b: refused" and failed.values == {}
    still = fan.current()  # the others still answer: their knobs are read, b is named
    assert still.ok and still.values == {"max_num_seqs": 12} and still.error == "pod b: refused"
    assert not FanOutActuator({}, frozenset({"max_num_seqs"})).current().ok


def pod_policy(**target: Any) -> dict[str, Any]:
    return {
        "target": {"name": "llama", "engine": "kvtune", "adminTokenSecretRef": {"name": "llama-admin"},
                   "podEndpoints": {"service": "llama", "metricsPort": 8000}, **target},
    }  # fmt: skip


def test_a_policy_over_pod_endpoints_needs_no_metrics_url() -> None:
    spec = pod_policy()
    jsonschema.validate({"spec": spec}, openapi_schema())
    parsed = KVTuningPolicySpec.model_validate(spec)
    assert parsed.metrics is None and parsed.target.pod_endpoints is not None
    endpoints = parsed.target.pod_endpoints
    assert (endpoints.admin_port, endpoints.scheme, endpoints.metrics_path) == (None, "http", "/metrics")
    by_pod = {
        **spec,
        "target": {**spec["target"], "engine": "vllm"},
        "metrics": {"prometheus": {"url": "http://prom:9090", "selector": '{job="vllm"}', "byPod": True}},
    }
    jsonschema.validate({"spec": by_pod}, openapi_schema())
    assert KVTuningPolicySpec.model_validate(by_pod).metrics.prometheus.by_pod  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"target": {"name": "l", "engine": "vllm"}}, "set metrics, or target.podEndpoints"),
        ({"metrics": {"metricsUrl": "http://l:8000"}}, "metricsUrl reads one engine"),
        ({"target": {**pod_policy()["target"], "adminUrl": "http://l:8000"}}, "adminUrl reaches one pod"),
        (
            {"target": {"name": "l", "engine": "kvtune", "adminUrl": "http://l:8000",
                        "adminTokenSecretRef": {"name": "a"}},
             "metrics": {"prometheus": {"url": "http://p:9090", "selector": "{}", "byPod": True}}},
            "prometheus.byPod on a kvtune engine needs target.podEndpoints",
        ),
        ({"target": {**pod_policy()["target"], "podEndpoints": {"service": "l", "metricsPort": 8000,
                                                                 "metricsPath": "metrics"}}}, "starts with /"),
    ],
)  # fmt: skip
def test_pod_endpoint_rules_hold_in_the_models_and_are_in_cel(change: dict[str, Any], message: str) -> None:
    with pytest.raises(pydantic.ValidationError, match=message):
        KVTuningPolicySpec.model_validate({**pod_policy(), **change})
    assert any(
        message in rule["message"] for rule in cel_rules()
    )  # the API server refuses it with the same words


def test_a_pod_port_out_of_range_is_rejected_by_schema_and_model() -> None:
    spec = pod_policy(podEndpoints={"service": "llama", "metricsPort": 70000})
    assert_refused_by_schema_and_model(spec)
