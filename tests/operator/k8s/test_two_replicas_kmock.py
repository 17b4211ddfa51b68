"""Two operator replicas with kopf peering (`kvtune operator --peering NAME`, as the chart runs them) against
one kmock API server that serves the KopfPeering: each draws its own random priority, so exactly one acts
on a vLLM Deployment under pressure and the other stands by. The Deployment is patched once, the Event and
the history entry written once. The recorded calls (ours and kopf's) are what the chart's RBAC must grant."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import httpx
import kmock
import kopf
import pytest
from kopf._core.engines import peering as kopf_peering

import kvtune.operator.k8s.handlers  # noqa: F401  (registers the handlers with kopf)
from kvtune.operator.io.own_metrics import OperatorMetrics
from kvtune.operator.k8s.peering import kopf_peering_arguments
from kvtune.operator.k8s.workload_actuator import read_flag
from tests.operator.api_calls import ApiCall, api_calls
from tests.operator.kmock_world import (
    DEPLOYMENTS,
    LLAMA_ARGS,
    NS,
    OptimisticEmulator,
    add_deployment,
    container_args,
    our_events,
    policy_spec,
    policy_status,
    status_writes,
)

PEERING = "kvtune"
PEERINGS = kmock.resource("kopf.dev/v1/kopfpeerings")


def add_peering(cluster: OptimisticEmulator) -> None:
    cluster.resources["kopf.dev/v1/kopfpeerings"] = kmock.ResourceInfo(
        kind="KopfPeering", namespaced=True, verbs={"get", "list", "watch", "patch"}
    )
    cluster.objects[PEERINGS, NS, PEERING] = {
        "apiVersion": "kopf.dev/v1",
        "kind": "KopfPeering",
        "metadata": {"name": PEERING, "namespace": NS, "resourceVersion": "1"},
        "status": {},
    }


async def create_policy(cluster: OptimisticEmulator, spec: dict[str, Any]) -> None:
    """POST the policy as kubectl would, so the watching replicas hear of it."""
    body = {
        "apiVersion": "kvtune.dev/v1alpha1",
        "kind": "KVTuningPolicy",
        "metadata": {"name": "llama", "namespace": NS, "uid": "uid-llama", "generation": 1},
        "spec": spec,
    }
    url = f"{str(cluster.url).rstrip('/')}/apis/kvtune.dev/v1alpha1/namespaces/{NS}/kvtuningpolicies"
    async with httpx.AsyncClient() as client:
        answer = await client.post(url, json=body)
    assert answer.status_code in (200, 201), answer.text


@pytest.fixture
def paused(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Each replica's own pause switch (kopf's `conflicts_found` toggle for the peering), as kopf hands it to
    the function that processes peering events: observed, not changed, so a test can wait until the lower
    priority has actually paused (kopf starts a replica paused, so no log line need say so)."""
    switches: dict[str, Any] = {}
    real = kopf_peering.process_peering_event

    async def observed(
        *, identity: kopf_peering.Identity, conflicts_found: Any = None, **kwargs: Any
    ) -> None:
        switches[identity] = conflicts_found
        await real(identity=identity, conflicts_found=conflicts_found, **kwargs)

    monkeypatch.setattr(kopf_peering, "process_peering_event", observed)
    return switches


def evaluated(metrics: OperatorMetrics) -> bool:
    value = metrics.registry.get_sample_value(
        "kvtune_operator_last_evaluation_timestamp_seconds", {"namespace": NS, "policy": "llama"}
    )
    return value is not None


async def wait_for(condition: Any, seconds: float, what: str, operators: list[asyncio.Task[Any]]) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what
        assert not any(task.done() for task in operators), operators
        await asyncio.sleep(0.2)


@pytest.mark.asyncio
@pytest.mark.timeout(90)
async def test_two_replicas_one_acts_the_other_stands_by(
    kube: OptimisticEmulator,
    metrics_url: str,
    paused: dict[str, Any],
) -> None:
    add_peering(kube)
    add_deployment(kube, LLAMA_ARGS)
    stop = asyncio.Event()
    replicas = {"replica-a": OperatorMetrics(), "replica-b": OperatorMetrics()}
    operators = []
    for identity, metrics in replicas.items():
        settings = kopf.OperatorSettings()
        settings.scanning.disabled = True
        operators.append(asyncio.create_task(kopf.operator(
            namespaces=[NS], stop_flag=stop, settings=settings, identity=identity,  # type: ignore[arg-type]
            memo=kopf.Memo(operator_metrics=metrics), **kopf_peering_arguments(PEERING),
        )))  # fmt: skip
    try:
        peers = lambda: kube.objects[PEERINGS, NS, PEERING].get("status", {})  # noqa: E731
        await wait_for(lambda: set(peers()) == set(replicas), 30, "both replicas keep alive", operators)
        ranked = sorted(replicas, key=lambda identity: peers()[identity]["priority"])
        await wait_for(lambda: set(paused) == set(replicas) and paused[ranked[0]].is_on() and paused[ranked[1]].is_off(),
                       30, "the lower priority to pause and the higher to resume", operators)  # fmt: skip
        await create_policy(kube, policy_spec(metrics_url, "Apply"))
        await wait_for(lambda: read_flag(container_args(kube), "--max-num-seqs") != 64 and our_events(kube),
                       30, "the active replica did not act within 30 s", operators)  # fmt: skip
        # three more evaluations by the active replica: a second actor, if there were one, ticks as often
        ticked = len(status_writes(kube)) + 3
        await wait_for(lambda: len(status_writes(kube)) >= ticked, 30, "three more evaluations", operators)
        acted = [identity for identity, metrics in replicas.items() if evaluated(metrics)]
        priorities = {identity: entry["priority"] for identity, entry in peers().items()}
    finally:
        stop.set()
        for task in operators:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(task, 20)

    assert acted == [max(priorities, key=priorities.__getitem__)]  # the higher priority acts, alone
    assert len(set(priorities.values())) == 2
    patches = [r for r in kube[kmock.action.UPDATE, DEPLOYMENTS] if not r.subresource]
    assert len(patches) == 1 and kube.answered == [200]
    applied = [e for e in our_events(kube) if e["reason"] == "TuningApplied"]
    assert len(applied) == 1 and "through --max-num-seqs" in applied[0]["message"]
    history = policy_status(kube)["history"]
    assert [h["kind"] for h in history].count("applied") == 1

    calls = api_calls(list(kube))
    print("API calls:", *sorted(calls), sep="\n  ")
    assert {
        ApiCall("watch", "kopf.dev", "kopfpeerings", "", NS, ""),
        ApiCall("patch", "kopf.dev", "kopfpeerings", "", NS, ""),
        ApiCall("get", "apps", "deployments", "", NS, ""),
        ApiCall("patch", "apps", "deployments", "", NS, ""),
        ApiCall("patch", "kvtune.dev", "kvtuningpolicies", "status", NS, ""),
        ApiCall("create", "", "events", "", NS, ""),
    } <= calls
