"""The Kubernetes emulator the operator tests share (kmock with optimistic concurrency), the metrics
server's handler, builders for Deployments, policies, Secrets and the reads of what the operator wrote, and
the two ways a test runs the operator: its ticks called directly, or kopf running the handlers. The fixtures
over them are in conftest.py."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import kmock
import kopf

from kvtune.operator.decide.policy import UNDO_ANNOTATION
from kvtune.operator.io.own_metrics import OperatorMetrics
from kvtune.operator.k8s.crd import KVTuningPolicySpec
from kvtune.operator.k8s.events import PolicyRef
from kvtune.operator.k8s.kube_api import USER_AGENT, KubeApi
from kvtune.operator.k8s.peering import kopf_peering_arguments
from kvtune.operator.k8s.reconcile import Outcome, PolicyMemory, PolicyTick, run_once
from tests.operator.helpers import QuietHandler, reply

FIXTURES = Path(__file__).parent / "fixtures"


NS = "inference"


POLICIES = kmock.resource("kvtune.dev/v1alpha1/kvtuningpolicies")


DEPLOYMENTS = kmock.resource("apps/v1/deployments")


EVENTS = kmock.resource("v1/events")


SECRETS = kmock.resource("v1/secrets")


class OptimisticEmulator(kmock.KubernetesEmulator):
    """kmock's emulator plus the API server's optimistic concurrency for Deployments: a patch carrying a
    stale metadata.resourceVersion gets 409 Conflict and changes nothing; every accepted patch bumps it.
    `writers_before_next_patch` simulates other writers getting in between a read and a patch."""

    writers_before_next_patch = 0
    answered: list[int]

    async def _handle(self, request: kmock.Request) -> Any:
        if request.resource == DEPLOYMENTS and request.action == kmock.action.UPDATE:
            stored = self.objects[DEPLOYMENTS, request.namespace, request.name]
            if self.writers_before_next_patch:
                self.writers_before_next_patch -= 1
                stored.patch(
                    {"metadata": {"resourceVersion": str(int(stored["metadata"]["resourceVersion"]) + 1)}}
                )
            sent = (request.data or {}).get("metadata", {}).get("resourceVersion")
            if sent is not None and sent != stored["metadata"]["resourceVersion"]:
                self.answered.append(409)
                raise kmock.KubernetesError(
                    409, "Conflict", "the object has been modified; apply to the latest"
                )
            response = await super()._handle(request)
            stored.patch(
                {"metadata": {"resourceVersion": str(int(stored["metadata"]["resourceVersion"]) + 1)}}
            )
            self.answered.append(response.status)
            return response
        return await super()._handle(request)


class MetricsHandler(QuietHandler):
    """/metrics from recorded files: the first read gets the first file, later reads the last one. A
    kvtune engine's `GET /admin/config` answers fixed knobs and records the bearer token it was sent."""

    def do_GET(self) -> None:
        server = self.server
        if self.path == "/admin/config":
            server.admin_tokens.append(self.headers.get("Authorization"))  # type: ignore[attr-defined]
            knobs = {"max_num_seqs": 64, "max_tokens_cap": None}
            reply(self, 200, "application/json", json.dumps(knobs).encode())
            return
        index = min(getattr(server, "reads", 0), len(server.files) - 1)  # type: ignore[attr-defined]
        server.reads = getattr(server, "reads", 0) + 1  # type: ignore[attr-defined]
        body = (FIXTURES / server.files[index]).read_bytes()  # type: ignore[attr-defined]
        reply(self, 200, "text/plain; version=0.0.4", body)


LLAMA_ARGS = ["--model", "/models/llama", "--max-num-seqs=64"]  # vLLM serving a model at max_num_seqs 64


def add_deployment(kube: OptimisticEmulator, args: list[str]) -> None:
    kube.objects[DEPLOYMENTS, NS, "llama"] = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "llama", "namespace": NS, "resourceVersion": "1", "generation": 1},
        "spec": {"template": {"spec": {"containers": [
            {"name": "sidecar", "image": "kvtune:latest", "args": ["proxy"]},
            {"name": "vllm", "image": "vllm/vllm-openai", "args": args},
        ]}}},
    }  # fmt: skip


def fast_policy(target: dict[str, Any], mode: str = "Apply", **fields: Any) -> dict[str, Any]:
    """A policy spec around `target` that acts within a test's few ticks: a one-second interval, no cooldown,
    and the ladder's first action on a two-sample window (the predicted move's first fit waits for a 5 s
    window, tests/operator/decide/test_predicted_move.py)."""
    return {
        "target": target,
        **fields,
        "mode": mode,
        "bounds": {"minMaxNumSeqs": 2, "maxMaxNumSeqs": 256},
        "intervalSeconds": 1,
        "evaluationWindowSeconds": 30,
        "cooldownSeconds": 0,
        "prediction": False,
    }


def policy_spec(metrics_url: str, mode: str) -> dict[str, Any]:
    return fast_policy(
        {"name": "llama", "container": "vllm", "engine": "vllm"}, mode, metrics={"metricsUrl": metrics_url}
    )


def kvtune_admin_spec(metrics_url: str, mode: str) -> dict[str, Any]:
    """A kvtune engine at `metrics_url` whose admin API is reached with the token in Secret llama-admin."""
    target = {"name": "llama", "engine": "kvtune", "adminUrl": metrics_url,
              "adminTokenSecretRef": {"name": "llama-admin", "key": "token"}}  # fmt: skip
    return {**policy_spec(metrics_url, mode), "target": target}


def add_policy(kube: OptimisticEmulator, spec: dict[str, Any], name: str = "llama") -> None:
    kube.objects[POLICIES, NS, name] = {
        "apiVersion": "kvtune.dev/v1alpha1",
        "kind": "KVTuningPolicy",
        "metadata": {
            "name": name,
            "namespace": NS,
            "uid": f"uid-{name}",
            "generation": 1,
            "resourceVersion": "1",
        },
        "spec": spec,
    }


def add_deployment_and_policy(
    kube: OptimisticEmulator, args: list[str], spec: dict[str, Any], token: str | None = None
) -> dict[str, Any]:
    """Most tests' cluster: the vLLM Deployment with `args`, the admin token's Secret when there is one, and
    the policy `spec` over it. Returns `spec`, for the ticks."""
    add_deployment(kube, args)
    if token is not None:
        add_admin_secret(kube, token, "1")
    add_policy(kube, spec)
    return spec


def ask_for_undo(kube: OptimisticEmulator, metrics_url: str) -> None:
    """A Deployment at --max-num-seqs 20 that an earlier Apply lowered from 64 (so the policy's status says),
    and an undo asked for on the policy (the kvtune.dev/undo annotation)."""
    add_deployment_and_policy(kube, ["--max-num-seqs", "20"], policy_spec(metrics_url, "Apply"))
    kube.objects[POLICIES, NS, "llama"].patch({"metadata": {"annotations": {UNDO_ANNOTATION: "please"}},
                                              "status": {"original": {"maxNumSeqs": 64}}})  # fmt: skip


def undo_done(kube: OptimisticEmulator) -> bool:
    return bool((kube.objects[POLICIES, NS, "llama"].get("status") or {}).get("undo", {}).get("done"))


def container_args(kube: OptimisticEmulator) -> list[str]:
    return list(kube.objects[DEPLOYMENTS, NS, "llama"]["spec"]["template"]["spec"]["containers"][1]["args"])


def our_events(kube: OptimisticEmulator) -> list[dict[str, Any]]:
    return [request.data for request in kube[kmock.action.CREATE, EVENTS]
            if request.data.get("source", {}).get("component") == "kvtune-operator"]  # fmt: skip


def reasons(kube: OptimisticEmulator) -> list[str]:
    return [event["reason"] for event in our_events(kube)]


def ours(requests: Any) -> list[kmock.Request]:
    """The requests our client made (kopf's own go to the same server)."""
    return [request for request in requests if request.headers.get("User-Agent") == USER_AGENT]


def status_writes(kube: OptimisticEmulator) -> list[kmock.Request]:
    """One per tick: every evaluation ends with a status patch."""
    return [r for r in ours(kube[kmock.action.UPDATE, POLICIES]) if r.subresource == "status"]


def policy_status(kube: OptimisticEmulator, name: str = "llama") -> dict[str, Any]:
    """What the operator last wrote in a policy's status."""
    found: dict[str, Any] = kube.objects[POLICIES, NS, name]["status"]
    return found


def deployment_patches(kube: OptimisticEmulator) -> list[kmock.Request]:
    """Our client's writes of the Deployment: each one a rolling restart of the workload."""
    return ours(kube[kmock.action.UPDATE, DEPLOYMENTS])


def conditions(status: dict[str, Any]) -> dict[str, str]:
    return {c["type"]: c["status"] for c in status.get("conditions", [])}


def add_admin_secret(kube: OptimisticEmulator, token: str, resource_version: str) -> None:
    kube.objects[SECRETS, NS, "llama-admin"] = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "llama-admin", "namespace": NS, "resourceVersion": resource_version},
        "data": {"token": base64.b64encode(token.encode()).decode()},
    }


REF = PolicyRef(NS, "llama", "uid-llama")


async def ticks(
    spec: dict[str, Any],
    memory: PolicyMemory,
    count: int,
    *,
    metrics: OperatorMetrics | None = None,
    pause: float = 0.3,
    start: float | None = None,
    **tick: Any,
) -> list[Outcome]:
    """`count` evaluations of policy llama on one client, in a thread (this event loop serves kmock): `pause`
    apart on the wall clock (the recorded metrics move after the first read), or, from `start`, one a second
    on a clock of their own. `tick` goes to each PolicyTick (max_mode, undo)."""
    parsed = KVTuningPolicySpec.model_validate(spec)

    def run() -> list[Outcome]:
        done = []
        with KubeApi.from_environment() as api:
            for index in range(count):
                now = time.time() if start is None else start + index
                done.append(run_once(api, PolicyTick(REF, parsed, now, **tick), memory, metrics))
                if start is None:
                    time.sleep(pause)
        return done

    return await asyncio.to_thread(run)


class RunningOperator:
    """kopf's operator running as a task of the test's event loop."""

    def __init__(self, task: asyncio.Task[None]) -> None:
        self.task = task

    async def until(
        self, done: Callable[[], object], seconds: float, failure: str | Callable[[], str]
    ) -> None:
        """Poll `done` (kmock keeps serving meanwhile); fail at the deadline, or at once if kopf has stopped."""
        deadline = time.monotonic() + seconds
        while not done():
            assert time.monotonic() < deadline, failure if isinstance(failure, str) else failure()
            assert not self.task.done(), self.task
            await asyncio.sleep(0.2)


@contextlib.asynccontextmanager
async def kopf_running(
    memo: kopf.Memo | None = None,
    *,
    namespaces: tuple[str, ...] = (NS,),
    clusterwide: bool = False,
    peering: str | None = None,
    stop_within: float = 15,
) -> AsyncIterator[RunningOperator]:
    """kopf running the registered handlers as `kvtune operator` does, stopped on the way out. Standalone
    (no `peering`) it scans no namespaces or CRDs from the start, which kmock 0.8 cannot serve."""
    arguments = kopf_peering_arguments(peering)
    if peering is None:
        settings = kopf.OperatorSettings()
        settings.scanning.disabled = True
        arguments["settings"] = settings
    stop = asyncio.Event()
    task = asyncio.create_task(kopf.operator(
        clusterwide=clusterwide, namespaces=[] if clusterwide else list(namespaces), stop_flag=stop, memo=memo,
        **arguments,
    ))  # fmt: skip
    try:
        yield RunningOperator(task)
    finally:
        stop.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, stop_within)
