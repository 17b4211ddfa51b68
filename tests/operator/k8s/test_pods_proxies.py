"""The parts of a many-replica vLLM workload with a kvtune proxy sidecar in each pod, below the kopf layer:
the CRD rules for `podEndpoints.proxyPort` (in the models and in CEL, with the same words), each pod read
as its engine plus its proxy, a proxy container's restart that does not count the engine's counters twice,
and the split cap of the composed actuator that the desired-state re-apply puts back on every proxy."""

from __future__ import annotations

from typing import Any

import jsonschema
import pydantic
import pytest

from kvtune.contract import metrics as m
from kvtune.operator.decide.loop import reapply_desired
from kvtune.operator.decide.policy import Mode, TuningPolicy
from kvtune.operator.decide.pooling import PoolState, pool
from kvtune.operator.decide.ports import ActuatorResult
from kvtune.operator.decide.restart_budget import RestartBudget
from kvtune.operator.decide.sample import Sample
from kvtune.operator.decide.tuner import TunerState
from kvtune.operator.io.actuators import ComposedActuator, FanOutActuator
from kvtune.operator.io.sources import EngineWithProxy, MetricsEndpoint
from kvtune.operator.k8s.crd import KVTuningPolicySpec
from kvtune.operator.k8s.pods import Pod, PodEndpointsSource
from tests.operator.crd_schema import assert_refused_by_schema_and_model, cel_rules, openapi_schema


def sidecar_policy(**pod_endpoints: Any) -> dict[str, Any]:
    return {
        "target": {
            "name": "llama", "engine": "vllm", "proxyAdminTokenSecretRef": {"name": "llama-proxy-admin"},
            "podEndpoints": {"service": "llama", "metricsPort": 8000, "proxyPort": 8001, **pod_endpoints},
        },
    }  # fmt: skip


def test_a_vllm_workload_with_proxy_sidecars_validates() -> None:
    spec = sidecar_policy(proxyAdminPort=8002)
    jsonschema.validate({"spec": spec}, openapi_schema())
    endpoints = KVTuningPolicySpec.model_validate(spec).target.pod_endpoints
    assert endpoints is not None and (endpoints.proxy_port, endpoints.proxy_admin()) == (8001, 8002)
    plain = KVTuningPolicySpec.model_validate(sidecar_policy()).target.pod_endpoints
    assert plain is not None and plain.proxy_admin() == 8001  # the admin API on the proxy's own port


def without(target: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in target.items() if k != key}


TARGET = sidecar_policy()["target"]


@pytest.mark.parametrize(
    ("target", "message"),
    [
        (without(TARGET, "proxyAdminTokenSecretRef"), "podEndpoints.proxyPort is for a vllm or sglang target"),
        ({**TARGET, "engine": "kvtune", "adminTokenSecretRef": {"name": "a"}},
         "podEndpoints.proxyPort is for a vllm or sglang target"),
        ({**TARGET, "proxyAdminUrl": "http://llama:8002"}, "proxyAdminUrl reaches one proxy"),
        ({**TARGET, "podEndpoints": {"service": "llama", "metricsPort": 8000}},
         "proxyAdminTokenSecretRef goes with proxyAdminUrl or podEndpoints.proxyPort"),
        ({**TARGET, "podEndpoints": {"service": "llama", "metricsPort": 8000, "proxyAdminPort": 8002}},
         "proxyAdminPort goes with proxyPort"),
        ({"name": "llama", "engine": "vllm", "proxyAdminUrl": "http://llama:8002",
          "podEndpoints": {"service": "llama", "metricsPort": 8000}},
         "proxyAdminUrl needs proxyAdminTokenSecretRef"),
    ],
)  # fmt: skip
def test_proxy_port_rules_hold_in_the_models_and_are_in_cel(target: dict[str, Any], message: str) -> None:
    with pytest.raises(pydantic.ValidationError, match=message):
        KVTuningPolicySpec.model_validate({"target": target})
    assert any(
        message in rule["message"] for rule in cel_rules()
    )  # the API server refuses it with the same words


def test_a_proxy_port_out_of_range_is_rejected_by_schema_and_model() -> None:
    spec = sidecar_policy(proxyPort=0)
    assert_refused_by_schema_and_model(spec)


def test_each_pod_is_read_as_its_engine_beside_its_proxy() -> None:
    pods = [Pod("llama-0", "10.0.0.1"), Pod("llama-1", "fd00::2")]
    source = PodEndpointsSource(pods, "http", 8000, "/metrics", proxy_port=8001)
    urls = {
        name: (endpoint.engine.url, endpoint.proxy.url)
        for name, endpoint in source.endpoints.items()
        if isinstance(endpoint, EngineWithProxy)
    }
    assert urls == {
        "llama-0": ("http://10.0.0.1:8000/metrics", "http://10.0.0.1:8001/metrics"),
        "llama-1": ("http://[fd00::2]:8000/metrics", "http://[fd00::2]:8001/metrics"),
    }
    alone = PodEndpointsSource(pods, "http", 8000, "/metrics")
    assert all(isinstance(endpoint, MetricsEndpoint) for endpoint in alone.endpoints.values())
    assert alone.proxy_problem is None


def pod_with_proxy(t: float, preemptions: float, defeats: float) -> Sample:
    """One pod: vLLM's counters (its process start time never moves here) beside its proxy's defeats."""
    return Sample(
        timestamp=t,
        gauges={m.KV_USAGE: 0.9, m.PROCESS_START: 1000.0},
        counters={m.PREEMPTIONS: preemptions, f"{m.PREFIX_DEFEATS}:varying_head": defeats},
        histograms={},
        cache_config={"block_size": "16", "kv_cache_size_tokens": "8192"},
    )


def test_a_proxy_container_restart_does_not_count_the_engines_counters_twice() -> None:
    first = pool(PoolState(), {"a": pod_with_proxy(10, 100, 40)}, {"a"}, 10, 1e9)
    steady = pool(first.state, {"a": pod_with_proxy(20, 110, 50)}, {"a"}, 20, 1e9)
    # the proxy container restarted: its counter starts again (3 defeats since), vLLM's goes on (+5)
    after = pool(steady.state, {"a": pod_with_proxy(30, 115, 3)}, {"a"}, 30, 1e9)
    counted = [p.sample.counters for p in (first, steady, after)]
    assert [c[m.PREEMPTIONS] for c in counted] == [100, 110, 115]  # not 110 + 115
    assert [c[f"{m.PREFIX_DEFEATS}:varying_head"] for c in counted] == [40, 50, 53]


class Proxy:
    """One pod's proxy admin API: the cap it holds."""

    knobs = frozenset({"max_tokens_cap"})

    def __init__(self, cap: int | None) -> None:
        self.cap = cap

    def current(self) -> ActuatorResult:
        return ActuatorResult(True, {"max_tokens_cap": self.cap})

    def apply(self, knob: str, value: int | str | None, cause: str = "") -> ActuatorResult:
        assert value is None or isinstance(value, int)
        self.cap = value
        return self.current()


class Deployment:
    """vLLM's Deployment args: max_num_seqs only."""

    knobs = frozenset({"max_num_seqs"})

    def current(self) -> ActuatorResult:
        return ActuatorResult(True, {"max_num_seqs": 64})

    def apply(self, knob: str, value: int | str | None, cause: str = "") -> ActuatorResult:
        raise AssertionError("the Deployment is not patched to put a proxy's cap back")


def test_proxies_that_disagree_on_the_cap_are_all_put_back_to_the_desired_one() -> None:
    # the operator wants no cap (it lifted it); a replaced pod's proxy started with one from its flags
    proxies = {"a": Proxy(None), "b": Proxy(None), "c": Proxy(300)}
    actuator = ComposedActuator([FanOutActuator(proxies, frozenset({"max_tokens_cap"})), Deployment()])
    held = actuator.current()
    assert held.ok and held.values == {"max_tokens_cap": None, "max_num_seqs": 64}
    assert held.split == {"max_tokens_cap"}  # the fan-out's disagreement survives the composition
    # a spent restart budget holds no live knob: the cap goes back on the proxies, uncounted (issue 37)
    state = TunerState(desired=(("max_tokens_cap", None),), restarts=(0.0,))
    policy = TuningPolicy(mode=Mode.APPLY, restart_budget=RestartBudget(1, 3600.0))
    again = reapply_desired(actuator, policy, state, held, 10.0)
    assert [(knob, value, result.ok) for knob, value, result in again.done] == [
        ("max_tokens_cap", None, True)
    ]
    assert again.held is None and again.state.restarts == (0.0,)
    assert {name: proxy.cap for name, proxy in proxies.items()} == {"a": None, "b": None, "c": None}
