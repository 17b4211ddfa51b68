"""The restart budget and the Ready condition through one evaluation of a policy in a cluster (issue 37),
against kmock's Kubernetes API over real HTTP and recorded vLLM-like metrics that preempt: a change the
budget allows patches the Deployment and is counted in status; one it does not (spent, or outside the
maintenance window) leaves the Deployment alone, says so in a condition, an Event and the note, and keeps
the value as a recommendation."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

import pytest

from kvtune.operator.decide.memory import TickMemory
from kvtune.operator.decide.restart_budget import BUDGET_SPENT, OUTSIDE_WINDOW, WITHIN_BUDGET
from kvtune.operator.decide.tuner import TunerState
from kvtune.operator.k8s.reconcile import PolicyMemory
from kvtune.operator.k8s.workload_actuator import read_flag
from tests.operator.kmock_world import (
    OptimisticEmulator,
    add_deployment,
    add_deployment_and_policy,
    add_policy,
    container_args,
    policy_spec,
    policy_status,
    reasons,
    ticks,
)

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]


def budgeted(metrics_url: str, budget: dict[str, Any]) -> dict[str, Any]:
    return {**policy_spec(metrics_url, "Apply"), "restartBudget": budget}


def shut_window() -> dict[str, str]:
    """A maintenance window that opens two hours from now and closes an hour later."""
    hour = datetime.now(UTC).hour
    return {"start": f"{(hour + 2) % 24:02d}:00", "end": f"{(hour + 3) % 24:02d}:00"}


def found(kube: OptimisticEmulator) -> tuple[dict[str, Any], dict[str, tuple[str, str, str]]]:
    status = policy_status(kube)
    return status, {c["type"]: (c["status"], c["reason"], c["message"]) for c in status["conditions"]}


@pytest.mark.parametrize(
    ("budget", "spent", "reason"),
    [
        ({"maxRestarts": 1, "periodSeconds": 3600}, True, BUDGET_SPENT),
        ({"maxRestarts": 2, "maintenanceWindow": shut_window()}, False, OUTSIDE_WINDOW),
    ],
)
async def test_a_change_the_budget_does_not_allow_is_held_and_said(
    kube: OptimisticEmulator, metrics_url: str, budget: dict[str, Any], spent: bool, reason: str
) -> None:
    spec = add_deployment_and_policy(kube, ["--max-num-seqs", "64"], budgeted(metrics_url, budget))
    earlier = time.time() - 600  # a restart ten minutes ago, as a previous run left it in status
    memory = PolicyMemory(TickMemory(state=TunerState(restarts=(earlier,) if spent else ())))
    outcomes = await ticks(spec, memory, 2)
    assert outcomes[-1].tick.held is not None and not outcomes[-1].tick.applied
    assert container_args(kube) == ["--max-num-seqs", "64"]  # no restart
    status, conditions = found(kube)
    held = conditions["ChangeHeld"]
    assert held[:2] == ("True", reason) and "the next change at" in held[2]
    assert conditions["Ready"][:2] == ("True", "Acting") and "held" in conditions["Ready"][2]
    assert status["note"].startswith("held lower_max_num_seqs max_num_seqs 64 -> ")
    assert 2 <= status["recommended"]["maxNumSeqs"] < 64
    assert status["tunerState"]["restarts"] == ([earlier] if spent else [])
    said = reasons(kube)
    assert said.count("ChangeHeld") == 1 and "TuningApplied" not in said  # said once, when it began


async def test_a_change_the_budget_allows_is_made_and_counted(
    kube: OptimisticEmulator, metrics_url: str
) -> None:
    spec = add_deployment_and_policy(
        kube, ["--max-num-seqs", "64"], budgeted(metrics_url, {"maxRestarts": 1, "periodSeconds": 3600})
    )
    outcomes = await ticks(spec, PolicyMemory(), 2)
    lowered = read_flag(container_args(kube), "--max-num-seqs")
    assert lowered is not None and 2 <= lowered < 64
    status, conditions = found(kube)
    (applied_at,) = status["tunerState"]["restarts"]
    assert applied_at == outcomes[-1].tick.at
    assert conditions["ChangeHeld"][:2] == ("False", WITHIN_BUDGET)
    assert conditions["ChangeHeld"][2] == "1 of 1 restarts used in the last 1h"
    assert conditions["Ready"][:2] == ("True", "Acting")
    assert conditions["ActuatorUnavailable"][:2] == ("False", "ActuatorBuilt")
    # the policy states its window and cooldown: the timing in force is the spec's
    assert status["timing"] == {"evaluationWindowSeconds": 30.0, "cooldownSeconds": 0.0, "defaulted": []}


async def test_a_vllm_policy_that_states_no_timing_runs_on_the_gpu_defaults(
    kube: OptimisticEmulator, metrics_url: str
) -> None:
    add_deployment(kube, ["--max-num-seqs", "64"])
    spec = {k: v for k, v in policy_spec(metrics_url, "Recommend").items()
            if k not in ("evaluationWindowSeconds", "cooldownSeconds")}  # fmt: skip
    add_policy(kube, spec)
    await ticks(spec, PolicyMemory(), 2)
    status, conditions = found(kube)
    assert status["timing"] == {
        "evaluationWindowSeconds": 300.0,
        "cooldownSeconds": 1800.0,
        "defaulted": ["evaluationWindowSeconds", "cooldownSeconds"],
    }
    assert conditions["ChangeHeld"][:2] == ("False", "NoRestartBudget")
    assert conditions["Ready"][:2] == ("True", "Recommending")
