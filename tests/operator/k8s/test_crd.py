"""The KVTuningPolicy CRD: generated from the pydantic models without drift, a valid and structural
CustomResourceDefinition, and a schema that accepts what the models accept and rejects what they reject."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pydantic
import pytest
import yaml

from kvtune.core.predict import Forecast
from kvtune.operator.decide.ladder import Remedy
from kvtune.operator.decide.policy import Mode
from kvtune.operator.decide.prediction import PredictionState
from kvtune.operator.decide.tuner import HistoryEntry, JudgedFigures, Pending, TunerState
from kvtune.operator.k8s import crd_yaml
from kvtune.operator.k8s.crd import (
    KVTuningPolicy,
    KVTuningPolicySpec,
    KVTuningPolicyStatus,
    PredictionStatus,
    TimingStatus,
    state_from_status,
    state_to_status,
)
from tests.operator.crd_schema import (
    CRD_FILE,
    assert_refused_by_schema_and_model,
    cel_rules,
    committed_crd,
    openapi_schema,
    walk,
)

SAMPLE = Path(__file__).parents[1] / "fixtures" / "kvtuningpolicy_vllm.yaml"
KUBERNETES_VERSION = "1.30"


def sample() -> dict[str, Any]:
    return yaml.safe_load(SAMPLE.read_text())


def test_committed_crd_matches_the_models() -> None:
    assert CRD_FILE.read_text() == crd_yaml.render(), (
        "charts/kvtune/crds/kvtuningpolicy.yaml is stale: "
        "python -m kvtune.operator.k8s.crd_yaml > charts/kvtune/crds/kvtuningpolicy.yaml"
    )


def test_crd_is_a_valid_custom_resource_definition() -> None:
    assert (
        kubernetes_validate.validate(committed_crd(), KUBERNETES_VERSION, strict=True) == KUBERNETES_VERSION
    )
    spec = committed_crd()["spec"]
    assert (spec["group"], spec["scope"], spec["names"]["shortNames"]) == (
        "kvtune.dev",
        "Namespaced",
        ["kvtp"],
    )
    version = spec["versions"][0]
    assert version["name"] == "v1alpha1" and version["subresources"] == {"status": {}}
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns[:6] == ["Mode", "Running", "Ready", "Current", "Recommended", "Preempting"]


def test_schema_is_structural() -> None:
    """What the API server demands of a v1 CRD schema: every node typed (or int-or-string), no references,
    no unions, no additionalProperties beside properties."""
    for path, node in walk(openapi_schema()):
        assert "type" in node or node.get("x-kubernetes-int-or-string"), f"{path} has no type"
        for forbidden in ("$ref", "anyOf", "oneOf", "allOf", "additionalProperties", "$defs", "title"):
            assert forbidden not in node, f"{path} has {forbidden}"


def test_sample_validates_against_the_schema_and_the_models() -> None:
    jsonschema.validate(sample(), openapi_schema())
    policy = KVTuningPolicy.model_validate(sample())
    pure = policy.spec.to_policy()
    assert pure.mode is Mode.APPLY
    assert (pure.min_max_num_seqs, pure.max_max_num_seqs, pure.cap_floor) == (8, 256, 512)
    assert (pure.evaluation_window_s, pure.cooldown_s, pure.max_step) == (120.0, 300.0, 32)
    assert pure.shared_prefix_tokens == 1200 and pure.allow_fp8 is False
    assert policy.spec.dump()["allowFP8"] is False


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("spec", "mode"), "Bogus"),
        (("spec", "target", "engine"), "tgi"),
        (("spec", "target", "kind"), "DaemonSet"),
        (("spec", "target", "admissionFlag"), "MaxNumBatchedTokens"),
        (("spec", "bounds", "minMaxNumSeqs"), 0),
        (("spec", "intervalSeconds"), 0),
        (("spec", "maxStep"), "ten"),
    ],
)
def test_schema_and_models_reject_the_same_bad_values(path: tuple[str, ...], value: object) -> None:
    bad = copy.deepcopy(sample())
    node = bad
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, openapi_schema())
    with pytest.raises(pydantic.ValidationError):
        KVTuningPolicy.model_validate(bad)


def test_missing_required_fields_are_rejected() -> None:
    bad = copy.deepcopy(sample())
    del bad["spec"]["target"]["name"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, openapi_schema())
    with pytest.raises(pydantic.ValidationError):
        KVTuningPolicy.model_validate(bad)


KVTUNE_BEHIND_A_PROXY = {
    "name": "m",
    "engine": "kvtune",
    "adminUrl": "http://m:8000",
    "adminTokenSecretRef": {"name": "m-admin"},
    "proxyAdminUrl": "http://proxy:8001",
    "proxyAdminTokenSecretRef": {"name": "proxy-admin"},
}


def test_cross_field_rules_are_in_the_models_and_in_cel() -> None:
    spec = sample()["spec"]
    for change in (
        {"target": {**spec["target"], "engine": "kvtune"}},  # kvtune without admin URL and token
        {"metrics": {"metricsUrl": "http://x:8000", "prometheus": spec["metrics"]["prometheus"]}},
        {"bounds": {"minMaxNumSeqs": 64, "maxMaxNumSeqs": 8}},
        {"target": {**spec["target"], "proxyAdminUrl": "http://proxy:8001"}},  # proxy URL without its token
        {
            "target": {**spec["target"], "proxyAdminTokenSecretRef": {"name": "proxy-admin"}}
        },  # and the reverse
        {"target": KVTUNE_BEHIND_A_PROXY},  # a kvtune engine caps max_tokens itself: no proxy in front
        {"metrics": {**spec["metrics"], "proxyMetricsUrl": "http://proxy:8001"}},  # only beside metricsUrl
        {"objective": "Goodput"},  # issue 28: Goodput states its p95 latency bound
    ):
        with pytest.raises(pydantic.ValidationError):
            KVTuningPolicySpec.model_validate({**spec, **change})
    rules = [rule["rule"] for rule in cel_rules()]
    # issue 15: podEndpoints (metricsPath, adminUrl, metrics and byPod rules), then its proxyPort (the
    # proxy token goes with proxyAdminUrl or podEndpoints.proxyPort, so the one "together" rule is two);
    # issue 28: the Goodput objective's bound; issue 37: the restart budget's engine and its window
    assert len(rules) == 18
    assert "!has(self.restartBudget) || self.target.engine != 'kvtune'" in rules
    assert "self.start != self.end" in rules
    assert "self.objective != 'Goodput' || has(self.p95QueueWaitBoundSeconds)" in rules
    assert "!has(self.proxyAdminUrl) || has(self.proxyAdminTokenSecretRef)" in rules


def test_a_vllm_target_behind_a_proxy_validates() -> None:
    spec = sample()["spec"]
    behind = {
        **spec,
        "target": {**spec["target"], "proxyAdminUrl": "http://llama-proxy:8001",
                   "proxyAdminTokenSecretRef": {"name": "llama-proxy-admin"}},
        "metrics": {"metricsUrl": "http://llama:8000", "proxyMetricsUrl": "http://llama-proxy:8001"},
    }  # fmt: skip
    jsonschema.validate({"spec": behind}, openapi_schema())
    parsed = KVTuningPolicySpec.model_validate(behind)
    assert parsed.target.proxy_admin_url == "http://llama-proxy:8001"
    assert parsed.target.proxy_admin_token_secret_ref is not None
    assert parsed.target.proxy_admin_token_secret_ref.key == "token"
    assert parsed.metrics.proxy_metrics_url == "http://llama-proxy:8001"


def test_defaults_fill_a_minimal_spec() -> None:
    minimal = {"target": {"name": "m", "engine": "vllm"}, "metrics": {"metricsUrl": "http://m:8000"}}
    jsonschema.validate({"spec": minimal}, openapi_schema())
    spec = KVTuningPolicySpec.model_validate(minimal)
    assert spec.mode == "Recommend" and spec.interval_seconds == 15 and spec.target.kind == "Deployment"
    # issue 28: prediction on, NoPreemption, and multiples of 8 for vLLM (its CUDA graphs), 1 elsewhere
    policy = spec.to_policy()
    assert policy.predict and policy.objective == "NoPreemption" and policy.round_to == 8
    # issue 37: a vLLM change is a rolling restart of GPU pods: GPU-sized window and cooldown, no budget
    assert (policy.evaluation_window_s, policy.cooldown_s, policy.restart_budget) == (300.0, 1800.0, None)
    kvtune = {**minimal, "target": {"name": "m", "engine": "kvtune", "adminUrl": "http://m:8000",
                                     "adminTokenSecretRef": {"name": "t"}}}  # fmt: skip
    live = KVTuningPolicySpec.model_validate(kvtune).to_policy()
    assert live.round_to == 1 and (live.evaluation_window_s, live.cooldown_s) == (60.0, 60.0)
    cpu_vllm = KVTuningPolicySpec.model_validate({**minimal, "roundTo": 1, "objective": "Goodput",
                                                  "p95QueueWaitBoundSeconds": 2.5})  # fmt: skip
    goodput = cpu_vllm.to_policy()
    assert goodput.round_to == 1 and goodput.objective == "Goodput" and goodput.p95_wait_bound_s == 2.5


def test_tuner_state_round_trips_through_status() -> None:
    before = JudgedFigures(0.5, 100.0, 0.97, 3.0)
    state = TunerState(
        rung=Remedy.LOWER_MAX_NUM_SEQS,
        pending=Pending(1000.25, Remedy.LOWER_MAX_NUM_SEQS, "max_num_seqs", 64, 41, "lower", before,
                        held_at=1003.5),
        last_action_at=1000.25,
        unsafe_max_num_seqs=64,
        unsafe_since=1000.25,
        exhausted=frozenset({Remedy.CAP_MAX_TOKENS}),
        reported=frozenset({"cap_max_tokens=1800"}),
        history=(
            HistoryEntry(990.5, "recommended", Remedy.CAP_MAX_TOKENS, "max_tokens_cap", None, 1800,
                         "recommended", "generation p99 1440", before),
            HistoryEntry(1000.25, "applied", Remedy.LOWER_MAX_NUM_SEQS, "max_num_seqs", 64, 41, "lower",
                         "sized from the real concurrency ceiling", before,
                         JudgedFigures(0.0, 120.0, 0.8, 1.0)),
        ),
    )  # fmt: skip
    tuner, history = state_to_status(state)
    status = KVTuningPolicyStatus(tuner_state=tuner, history=history)
    dumped = status.dump()
    jsonschema.validate({"spec": sample()["spec"], "status": dumped}, openapi_schema())
    assert state_from_status(KVTuningPolicyStatus.model_validate(dumped)) == state


def test_a_forecast_and_its_verdict_round_trip_through_status() -> None:
    """Issue 28: the prediction in force, its verdict and the misses survive an operator restart (the
    operating points do not: a refit gathers them again)."""
    forecast = Forecast(
        8, 0.0, 480.5, 0.75, 64, 41.2, 455.0, "NoPreemption", "the largest value", "closed loop"
    )
    prediction = PredictionState(forecast, "held: 0 preemptions in 60 s at 8", 1, False, (), 1000.5)
    tuner, history = state_to_status(TunerState(prediction=prediction))
    status = KVTuningPolicyStatus(
        tuner_state=tuner,
        history=history,
        prediction=PredictionStatus.of(prediction, "NoPreemption (risk margin 5%)", 1, 0.0),
    )
    dumped = status.dump()
    jsonschema.validate({"spec": sample()["spec"], "status": dumped}, openapi_schema())
    assert dumped["prediction"]["forecast"]["predictedPreemptionsPerMinute"] == 0.0
    assert state_from_status(KVTuningPolicyStatus.model_validate(dumped)).prediction == prediction


def spec_schema_property(name: str) -> dict[str, Any]:
    found: dict[str, Any] = openapi_schema()["properties"]["spec"]["properties"][name]
    return found


def test_the_engine_defaults_are_the_operators_not_the_api_servers() -> None:
    """Issue 37: the CRD sets no default for the window and the cooldown (the API server would write 60 into
    every policy, and a vLLM policy could not tell a stated 60 from a forgotten one); the operator resolves
    them by engine, a stated value wins, and status says which were defaulted."""
    for name, gpu in (("evaluationWindowSeconds", "300"), ("cooldownSeconds", "1800")):
        assert "default" not in spec_schema_property(name)
        assert f"Unset: {gpu} for vllm and sglang" in spec_schema_property(name)["description"]
    spec = {**sample()["spec"]}
    del spec["cooldownSeconds"]
    parsed = KVTuningPolicySpec.model_validate(spec)
    assert (parsed.to_policy().evaluation_window_s, parsed.to_policy().cooldown_s) == (120.0, 1800.0)
    timing = TimingStatus.of(parsed)
    assert timing.defaulted == ["cooldownSeconds"] and timing.evaluation_window_seconds == 120.0
    jsonschema.validate(
        {"spec": spec, "status": KVTuningPolicyStatus(timing=timing).dump()}, openapi_schema()
    )


BUDGET = {"maxRestarts": 2, "periodSeconds": 86400, "maintenanceWindow": {"start": "22:30", "end": "01:00"}}


def test_a_restart_budget_validates_and_becomes_the_pure_budget() -> None:
    spec = {**sample()["spec"], "restartBudget": BUDGET}
    jsonschema.validate({"spec": spec}, openapi_schema())
    budget = KVTuningPolicySpec.model_validate(spec).to_policy().restart_budget
    assert budget is not None and (budget.max_restarts, budget.period_s) == (2, 86400.0)
    assert budget.window is not None and budget.window.describe() == "22:30-01:00 UTC"
    default_period = {**sample()["spec"], "restartBudget": {"maxRestarts": 1}}
    assert KVTuningPolicySpec.model_validate(default_period).restart_budget.period_seconds == 86400  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "budget",
    [
        {"maxRestarts": 0},
        {"maxRestarts": 1, "periodSeconds": 10},
        {"maxRestarts": 1, "maintenanceWindow": {"start": "2:00", "end": "05:00"}},
        {"maxRestarts": 1, "maintenanceWindow": {"start": "02:00", "end": "24:00"}},
        {"maxRestarts": 1, "maintenanceWindow": {"start": "02:00"}},
        {"periodSeconds": 3600},
    ],
)
def test_schema_and_models_reject_the_same_bad_budgets(budget: dict[str, Any]) -> None:
    assert_refused_by_schema_and_model({**sample()["spec"], "restartBudget": budget})


def test_the_cross_field_budget_rules_are_in_the_models_and_in_cel() -> None:
    spec = sample()["spec"]
    kvtune = {**spec, "target": {"name": "m", "engine": "kvtune", "adminUrl": "http://m:8000",
                                 "adminTokenSecretRef": {"name": "t"}}, "restartBudget": BUDGET}  # fmt: skip
    with pytest.raises(pydantic.ValidationError, match="restartBudget is for vllm and sglang"):
        KVTuningPolicySpec.model_validate(kvtune)
    empty = {**BUDGET, "maintenanceWindow": {"start": "02:00", "end": "02:00"}}
    with pytest.raises(pydantic.ValidationError, match="an end different from its start"):
        KVTuningPolicySpec.model_validate({**spec, "restartBudget": empty})
    sglang = {**spec, "target": {**spec["target"], "engine": "sglang"}, "restartBudget": BUDGET}
    assert KVTuningPolicySpec.model_validate(sglang).to_policy().restart_budget is not None


def test_the_restarts_round_trip_through_status() -> None:
    """Issue 37: the budget's memory survives an operator restart, so it is never spent twice."""
    state = TunerState(restarts=(1000.5, 4600.25))
    tuner, history = state_to_status(state)
    dumped = KVTuningPolicyStatus(tuner_state=tuner, history=history).dump()
    jsonschema.validate({"spec": sample()["spec"], "status": dumped}, openapi_schema())
    assert dumped["tunerState"]["restarts"] == [1000.5, 4600.25]
    assert state_from_status(KVTuningPolicyStatus.model_validate(dumped)).restarts == state.restarts
