"""A policy that tunes a workload of many replicas, against kmock's Kubernetes API (real HTTP) and one real
HTTP engine per pod on its own loopback address (127.0.0.2, .3, ...: Linux serves all of 127/8), listed in
the target Service's EndpointSlice: every pod is read and pooled, one value is decided, a kvtune engine's
value reaches every pod's admin API, a vLLM Deployment gets one patch, a replaced pod is no restart and
gets the operator's value, and status carries per-pod evidence and the worst pod."""

from __future__ import annotations

from typing import Any

import pytest

from kvtune.contract import metrics as m
from kvtune.operator.decide.window import Window
from kvtune.operator.k8s.reconcile import PolicyMemory
from kvtune.operator.k8s.workload_actuator import read_flag
from tests.operator.kmock_world import (
    LLAMA_ARGS,
    OptimisticEmulator,
    add_admin_secret,
    add_deployment_and_policy,
    add_policy,
    container_args,
    deployment_patches,
    our_events,
    policy_status,
    reasons,
    ticks,
)
from tests.operator.pods_world import Workload, kvtune_spec

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]


def vllm_spec(port: int) -> dict[str, Any]:
    return {**kvtune_spec(port), "target": {"name": "llama", "container": "vllm", "engine": "vllm",
                                            "podEndpoints": {"service": "llama", "metricsPort": port}}}  # fmt: skip


async def test_three_kvtune_pods_get_the_one_decision_with_per_pod_evidence_in_status(
    kube: OptimisticEmulator,
    workload: Workload,
) -> None:
    # between the two samples pod b preempts 100 times, a 49, c 14: the pool preempts, b is the worst
    a = workload.start("llama-a", "127.0.0.2", [46, 95])
    b = workload.start("llama-b", "127.0.0.3", [46, 146])
    c = workload.start("llama-c", "127.0.0.4", [46, 60])
    add_admin_secret(kube, "pods-token", "1")
    add_policy(kube, kvtune_spec(workload.port))
    memory = PolicyMemory()
    first, second = await ticks(kvtune_spec(workload.port), memory, 2)

    assert first.tick.decision is not None and not first.tick.applied  # a baseline: rates need two samples
    change, result = second.tick.applied[0]
    assert result.ok, result.error
    assert change.knob == "max_num_seqs" and 2 <= int(change.value or 0) < 64
    assert [pod.patches for pod in (a, b, c)] == [[{"max_num_seqs": change.value}]] * 3  # every pod, once
    assert second.tick.decision.diagnosis.preemptions == 49 + 100 + 14  # pooled: summed
    status = policy_status(kube)
    assert status["worstPod"] == "llama-b" and "worst pod llama-b: 100 preemptions" in status["note"]
    assert [(p["name"], p["preemptions"], p["maxNumSeqs"]) for p in status["pods"]] == [
        ("llama-b", 100, change.value), ("llama-a", 49, change.value), ("llama-c", 14, change.value),
    ]  # fmt: skip
    assert all(p["lastSeen"] and "kvUsageMax" in p and "runningMax" in p for p in status["pods"])
    assert status["current"]["maxNumSeqs"] == change.value and status["desired"]["maxNumSeqs"] == change.value
    applied = [h for h in status["history"] if h["kind"] == "applied"]
    assert applied and "worst pod llama-b" in applied[0]["evidence"]
    event = next(e for e in our_events(kube) if e["reason"] == "TuningApplied")
    assert "worst pod llama-b" in event["message"]
    assert not {"EngineRestarted", "PodRestarted", "ApplyFailed", "PodsDisagree"} & set(reasons(kube))


async def test_a_vllm_deployment_of_three_pods_gets_exactly_one_patch(
    kube: OptimisticEmulator,
    workload: Workload,
) -> None:
    pods = [workload.start(f"llama-{n}", f"127.0.0.{n + 2}", [46, 95 + 10 * n]) for n in range(3)]
    add_deployment_and_policy(kube, LLAMA_ARGS, vllm_spec(workload.port))
    outcomes = await ticks(vllm_spec(workload.port), PolicyMemory(), 3)

    patches = deployment_patches(kube)
    assert len(patches) == 1  # one rolling restart for the workload, not one per pod
    lowered = read_flag(container_args(kube), "--max-num-seqs")
    assert lowered is not None and 2 <= lowered < 64
    assert [len(o.tick.applied) for o in outcomes] == [0, 1, 0]
    assert outcomes[1].tick.decision is not None
    assert outcomes[1].tick.decision.diagnosis.preemptions == 49 + 59 + 69
    assert all(pod.patches == [] for pod in pods)  # vLLM has no admin API: nothing goes to the pods
    status = policy_status(kube)
    assert status["worstPod"] == "llama-2" and [p["name"] for p in status["pods"]] == [
        "llama-2",
        "llama-1",
        "llama-0",
    ]


async def test_a_pod_replaced_during_the_window_is_no_restart_and_gets_the_operators_value(
    kube: OptimisticEmulator,
    workload: Workload,
) -> None:
    workload.start("llama-a", "127.0.0.2", [46, 95])
    workload.start("llama-b", "127.0.0.3", [46, 95])
    workload.start("llama-c", "127.0.0.4", [46, 900])
    add_admin_secret(kube, "pods-token", "1")
    add_policy(kube, kvtune_spec(workload.port))
    memory = PolicyMemory()
    _, acted = await ticks(kvtune_spec(workload.port), memory, 2)
    value = acted.tick.applied[0][0].value
    assert isinstance(value, int) and value < 64

    # c is replaced by d: a new process whose counters start small (3 preemptions since it started)
    workload.stop("llama-c")
    d = workload.start("llama-d", "127.0.0.5", [3])
    (replaced,) = await ticks(kvtune_spec(workload.port), memory, 1)

    assert replaced.tick.restart is None and replaced.tick.no_data is None
    assert d.patches == [{"max_num_seqs": value}] and d.knobs["max_num_seqs"] == value  # put back at once
    assert [(knob, to) for knob, to, result in replaced.tick.reapplied if result.ok] == [
        ("max_num_seqs", value)
    ]
    window = Window.of(memory.tuning.samples)
    assert window.restarts() == 0
    counts = [sample.counters[m.PREEMPTIONS] for sample in window.samples]
    assert counts == sorted(counts) and counts[-1] - counts[-2] == 3  # the new pod's own work, no more
    diagnosis = replaced.tick.decision.diagnosis if replaced.tick.decision else None
    assert diagnosis is not None and (diagnosis.preemption_rate or 0) >= 0 and diagnosis.restarts == 0
    status = policy_status(kube)
    assert {p["name"] for p in status["pods"]} == {"llama-a", "llama-b", "llama-d"}  # c is gone
    assert {p["maxNumSeqs"] for p in status["pods"]} == {value}
    assert not {"EngineRestarted", "PodRestarted", "ReapplyFailed"} & set(reasons(kube))
    assert "DesiredStateReapplied" in reasons(kube)
