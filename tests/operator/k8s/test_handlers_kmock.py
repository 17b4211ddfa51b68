"""The Kubernetes contract of the in-cluster operator, against kmock's stateful Kubernetes API (real HTTP,
no monkey-patching): kopf runs the handlers, which read a KVTuningPolicy, read real metrics from a local
HTTP server, patch the target Deployment's args (retrying a 409 Conflict), patch the status subresource
and post Events. kmock records every request, so the tests also count what one tick costs the API server:
one client for the process, one read of the actuator's values per tick, the admin-token Secret read whole
only when it changed."""

from __future__ import annotations

import asyncio
import time
from http.server import ThreadingHTTPServer
from typing import Any

import kmock
import pytest

import kvtune.operator.k8s.handlers  # noqa: F401  (registers the handlers with kopf)
from kvtune.operator.decide.status import CONDITION_TYPES
from kvtune.operator.k8s import kube_api
from kvtune.operator.k8s.crd import KVTuningPolicySpec
from kvtune.operator.k8s.kube_api import METADATA_ONLY, KubeApi
from kvtune.operator.k8s.reconcile import PolicyMemory, PolicyTick, run_once
from kvtune.operator.k8s.workload_actuator import read_flag, set_flag
from tests.operator.kmock_world import (
    DEPLOYMENTS,
    LLAMA_ARGS,
    NS,
    REF,
    SECRETS,
    OptimisticEmulator,
    add_admin_secret,
    add_deployment_and_policy,
    add_policy,
    conditions,
    container_args,
    kopf_running,
    kvtune_admin_spec,
    our_events,
    ours,
    policy_spec,
    policy_status,
    status_writes,
    ticks,
)


def test_flag_editing() -> None:
    assert set_flag(["--model", "m", "--max-num-seqs=64"], "--max-num-seqs", 41) == [
        "--model",
        "m",
        "--max-num-seqs=41",
    ]
    assert set_flag(["--max-num-seqs", "64", "--x"], "--max-num-seqs", 41) == ["--max-num-seqs", "41", "--x"]
    assert set_flag(["--max_num_seqs", "64"], "--max-num-seqs", 8) == ["--max_num_seqs", "8"]
    assert set_flag(["--model", "m"], "--max-num-seqs", 41) == ["--model", "m", "--max-num-seqs", "41"]
    assert read_flag(["--model", "m", "--max-num-seqs=64"], "--max-num-seqs") == 64
    assert read_flag(["--max_num_seqs", "12"], "--max-num-seqs") == 12
    assert read_flag(["--model", "m"], "--max-num-seqs") is None


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_kopf_applies_to_a_deployment_retrying_a_conflict(
    kube: OptimisticEmulator, metrics_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    logins: list[object] = []
    load = kube_api.environment_configuration

    def counted() -> Any:
        logins.append(True)
        return load()

    monkeypatch.setattr(kube_api, "environment_configuration", counted)
    add_deployment_and_policy(kube, LLAMA_ARGS, policy_spec(metrics_url, "Apply"))
    kube.writers_before_next_patch = 1  # someone else writes the Deployment between our read and our patch
    async with kopf_running() as operator:
        await operator.until(lambda: read_flag(container_args(kube), "--max-num-seqs") != 64 and our_events(kube),
                             30, "the operator did not act within 30 s")  # fmt: skip

    lowered = read_flag(container_args(kube), "--max-num-seqs")
    assert lowered is not None and 2 <= lowered < 64
    assert len(status_writes(kube)) >= 2 and len(logins) == 1  # every tick on the one client made at startup
    assert container_args(kube)[:2] == ["--model", "/models/llama"]
    assert kube.answered[:2] == [409, 200]  # the conflict, then the re-read and re-applied patch
    status = policy_status(kube)
    assert conditions(status)["Preempting"] == "True"
    applied = [h for h in status["history"] if h["kind"] == "applied"]
    assert applied and applied[0]["knob"] == "max_num_seqs"
    assert (applied[0]["before"], applied[0]["after"]) == (64, lowered)
    assert applied[0]["evidence"] and applied[0]["beforeFigures"]["preemptionRate"] > 0
    assert status["tunerState"]["pending"]["after"] == lowered
    assert status["current"]["maxNumSeqs"] == lowered
    reasons = {e["reason"]: e for e in our_events(kube)}
    event = reasons["TuningApplied"]
    assert f"max_num_seqs: 64 -> {lowered}" in event["message"] and "evidence:" in event["message"]
    assert event["involvedObject"] == {"apiVersion": "kvtune.dev/v1alpha1", "kind": "KVTuningPolicy",
                                       "name": "llama", "namespace": NS, "uid": "uid-llama"}  # fmt: skip


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_recommend_mode_writes_status_and_events_without_acting(
    kube: OptimisticEmulator, metrics_url: str
) -> None:
    add_deployment_and_policy(kube, ["--max-num-seqs", "64"], policy_spec(metrics_url, "Recommend"))
    await ticks(policy_spec(metrics_url, "Recommend"), PolicyMemory(), 2)
    assert container_args(kube) == ["--max-num-seqs", "64"] and not kube.answered
    assert len(status_writes(kube)) == 2
    assert len(ours(kube[kmock.action.FETCH, DEPLOYMENTS])) == 2  # its max_num_seqs: read once a tick
    status = policy_status(kube)
    assert conditions(status)["Preempting"] == "True" and conditions(status)["Stable"] == "False"
    assert status["current"]["maxNumSeqs"] == 64
    assert 2 <= status["recommended"]["maxNumSeqs"] < 64
    assert {h["kind"] for h in status["history"]} == {"recommended"}
    messages = [e["message"] for e in our_events(kube) if e["reason"] == "TuningRecommended"]
    assert any(f"64 -> {status['recommended']['maxNumSeqs']}" in m for m in messages)


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_observe_mode_only_diagnoses(kube: OptimisticEmulator, metrics_url: str) -> None:
    add_deployment_and_policy(kube, ["--max-num-seqs", "64"], policy_spec(metrics_url, "Observe"))
    await ticks(policy_spec(metrics_url, "Observe"), PolicyMemory(), 2)
    status = policy_status(kube)
    assert conditions(status)["Preempting"] == "True" and status["note"] == "observe mode"
    assert not status.get("history") and "recommended" not in status and not our_events(kube)
    assert container_args(kube) == ["--max-num-seqs", "64"]


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_unreachable_metrics_are_a_condition_not_an_action(kube: OptimisticEmulator) -> None:
    spec = add_deployment_and_policy(
        kube, ["--max-num-seqs", "64"], policy_spec("http://127.0.0.1:9", "Apply")
    )  # discard port: nothing listens
    outcomes = await ticks(spec, PolicyMemory(), 2)
    assert all(o.tick.no_data for o in outcomes)
    status = policy_status(kube)
    # what the metrics would say is unknown; what became of the operator's patches is known: none was made;
    # the mode (ModeCapped) needs no data
    metric = [c for c in status["conditions"] if c["type"] in CONDITION_TYPES]
    assert {c["status"] for c in metric} == {"Unknown"} and {c["reason"] for c in metric} == {"NoData"}
    workload = {
        c["type"]: (c["status"], c["reason"])
        for c in status["conditions"]
        if c not in metric and c["type"] != "ModeCapped"
    }
    assert workload == {
        "RolloutStalled": ("False", "RolloutComplete"),
        "ChangeReverted": ("False", "NotReverted"),
        "ChangeHeld": ("False", "NoRestartBudget"),
        "ActuatorUnavailable": ("False", "ActuatorBuilt"),
        "Ready": ("False", "NoMetrics"),  # issue 37: the first thing in the way
    }
    assert [e["reason"] for e in our_events(kube)] == ["NoMetrics"]  # once, on the transition
    assert container_args(kube) == ["--max-num-seqs", "64"] and not kube.answered


def secret_reads(kube: OptimisticEmulator) -> tuple[int, int]:
    """(metadata-only reads, whole reads) of the admin-token Secret by our client."""
    reads = ours(kube[kmock.action.FETCH, SECRETS])
    metadata = sum(1 for r in reads if r.headers.get("Accept") == METADATA_ONLY)
    return metadata, len(reads) - metadata


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_a_tick_reads_the_secret_only_when_it_changed_and_the_knobs_once(
    kube: OptimisticEmulator, metrics_server: ThreadingHTTPServer, metrics_url: str
) -> None:
    spec = kvtune_admin_spec(metrics_url, "Recommend")
    add_policy(kube, spec)
    add_admin_secret(kube, "first-token", "1")
    parsed = KVTuningPolicySpec.model_validate(spec)
    memory = PolicyMemory()

    def run(api: KubeApi, count: int) -> None:
        for _ in range(count):
            outcome = run_once(api, PolicyTick(REF, parsed, time.time()), memory)
            assert "actuator_unavailable" not in memory.tuning.on, outcome.status.note

    with KubeApi.from_environment() as api:
        await asyncio.to_thread(run, api, 3)
        assert secret_reads(kube) == (3, 1)  # its resourceVersion every tick, its data once
        add_admin_secret(kube, "rotated-token", "2")
        await asyncio.to_thread(run, api, 2)
    assert secret_reads(kube) == (5, 2)  # read again once, when it changed
    sent = metrics_server.admin_tokens  # type: ignore[attr-defined]
    assert sent == ["Bearer first-token"] * 3 + ["Bearer rotated-token"] * 2  # the knobs: one read a tick
    assert len(status_writes(kube)) == 5
