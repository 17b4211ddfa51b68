"""The Kubernetes contract of the in-cluster operator, against kmock's stateful Kubernetes API (real HTTP,
no monkey-patching): kopf runs the handlers, which read a KVTuningPolicy, read real metrics from a local
HTTP server, patch the target Deployment's args (retrying a 409 Conflict), patch the status subresource
and post Events. kmock records every request, so the tests also count what one tick costs the API server:
one client for the process, one read of the actuator's values per tick, the admin-token Secret read whole
only when it changed."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import kmock
import kopf
import pytest

import kvtune.operator.k8s.handlers  # noqa: F401  (registers the handlers with kopf)
from kvtune.operator.decide.status import CONDITION_TYPES
from kvtune.operator.k8s import kube_api
from kvtune.operator.k8s.crd import KVTuningPolicySpec
from kvtune.operator.k8s.events import PolicyRef
from kvtune.operator.k8s.kube_api import METADATA_ONLY, USER_AGENT, KubeApi
from kvtune.operator.k8s.reconcile import PolicyMemory, run_once
from kvtune.operator.k8s.workload_actuator import read_flag, set_flag
from tests.operator.helpers import reply

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


class MetricsHandler(BaseHTTPRequestHandler):
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

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def metrics_server() -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), MetricsHandler)
    server.files = ["kvtune_preempting_t0.prom", "kvtune_preempting_t1.prom"]  # type: ignore[attr-defined]
    server.admin_tokens = []  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def metrics_url(metrics_server: ThreadingHTTPServer) -> str:
    return f"http://127.0.0.1:{metrics_server.server_address[1]}"


@pytest.fixture
def kube(kmock: OptimisticEmulator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> OptimisticEmulator:
    """The emulator with our resources declared, and a kubeconfig pointing at it (as kopf and our client
    would find in a cluster's kubeconfig)."""
    kmock.answered = []
    kmock.resources["kvtune.dev/v1alpha1/kvtuningpolicies"] = kmock.ResourceInfo(
        kind="KVTuningPolicy", namespaced=True, subresources={"status"},
        verbs={"get", "list", "watch", "patch", "update"},
    )  # fmt: skip
    kmock.resources["apps/v1/deployments"] = kmock.ResourceInfo(
        kind="Deployment", namespaced=True, verbs={"get", "list", "watch", "patch"}
    )
    kmock.resources["v1/events"] = kmock.ResourceInfo(kind="Event", namespaced=True)
    kmock.resources["v1/secrets"] = kmock.ResourceInfo(kind="Secret", namespaced=True)
    # kopf's backbone: it must discover namespaces (kmock 0.8 cannot parse /api/v1/namespaces, so the test
    # turns kopf's namespace and CRD scanning off and names the namespace)
    kmock.resources["v1/namespaces"] = kmock.ResourceInfo(kind="Namespace", namespaced=False)
    config = tmp_path / "kubeconfig"
    config.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: kmock\n"
        f"clusters: [{{name: kmock, cluster: {{server: '{str(kmock.url).rstrip('/')}'}}}}]\n"
        "users: [{name: tester, user: {token: test-token}}]\n"
        "contexts: [{name: kmock, context: {cluster: kmock, user: tester, namespace: inference}}]\n"
    )
    monkeypatch.setenv("KUBECONFIG", str(config))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    return kmock


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


def policy_spec(metrics_url: str, mode: str) -> dict[str, Any]:
    return {
        "target": {"name": "llama", "container": "vllm", "engine": "vllm"},
        "metrics": {"metricsUrl": metrics_url},
        "mode": mode,
        "bounds": {"minMaxNumSeqs": 2, "maxMaxNumSeqs": 256},
        "intervalSeconds": 1,
        "evaluationWindowSeconds": 30,
        "cooldownSeconds": 0,
        # these tests are about kopf's handlers acting through the Deployment on a recorded window; the
        # predicted move's first fit waits for a 5 s window (tests/operator/test_predicted_move.py)
        "prediction": False,
    }


def add_policy(kube: OptimisticEmulator, spec: dict[str, Any]) -> None:
    kube.objects[POLICIES, NS, "llama"] = {
        "apiVersion": "kvtune.dev/v1alpha1",
        "kind": "KVTuningPolicy",
        "metadata": {
            "name": "llama",
            "namespace": NS,
            "uid": "uid-llama",
            "generation": 1,
            "resourceVersion": "1",
        },
        "spec": spec,
    }


def container_args(kube: OptimisticEmulator) -> list[str]:
    return list(kube.objects[DEPLOYMENTS, NS, "llama"]["spec"]["template"]["spec"]["containers"][1]["args"])


def our_events(kube: OptimisticEmulator) -> list[dict[str, Any]]:
    return [request.data for request in kube[kmock.action.CREATE, EVENTS]
            if request.data.get("source", {}).get("component") == "kvtune-operator"]  # fmt: skip


def ours(requests: Any) -> list[kmock.Request]:
    """The requests our client made (kopf's own go to the same server)."""
    return [request for request in requests if request.headers.get("User-Agent") == USER_AGENT]


def status_writes(kube: OptimisticEmulator) -> list[kmock.Request]:
    """One per tick: every evaluation ends with a status patch."""
    return [r for r in ours(kube[kmock.action.UPDATE, POLICIES]) if r.subresource == "status"]


def conditions(status: dict[str, Any]) -> dict[str, str]:
    return {c["type"]: c["status"] for c in status.get("conditions", [])}


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
@pytest.mark.kmock(cls=OptimisticEmulator)
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
    add_deployment(kube, ["--model", "/models/llama", "--max-num-seqs=64"])
    add_policy(kube, policy_spec(metrics_url, "Apply"))
    kube.writers_before_next_patch = 1  # someone else writes the Deployment between our read and our patch
    stop = asyncio.Event()
    settings = kopf.OperatorSettings()
    settings.scanning.disabled = True
    operator = asyncio.create_task(
        kopf.operator(standalone=True, namespaces=[NS], stop_flag=stop, settings=settings)
    )
    try:
        deadline = time.monotonic() + 30
        while read_flag(container_args(kube), "--max-num-seqs") == 64 or not our_events(kube):
            assert time.monotonic() < deadline, "the operator did not act within 30 s"
            assert not operator.done(), operator
            await asyncio.sleep(0.2)
    finally:
        stop.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(operator, 15)

    lowered = read_flag(container_args(kube), "--max-num-seqs")
    assert lowered is not None and 2 <= lowered < 64
    assert len(status_writes(kube)) >= 2 and len(logins) == 1  # every tick on the one client made at startup
    assert container_args(kube)[:2] == ["--model", "/models/llama"]
    assert kube.answered[:2] == [409, 200]  # the conflict, then the re-read and re-applied patch
    status = kube.objects[POLICIES, NS, "llama"]["status"]
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


async def tick_twice(spec: dict[str, Any], memory: PolicyMemory) -> list[Any]:
    parsed = KVTuningPolicySpec.model_validate(spec)
    ref = PolicyRef(NS, "llama", "uid-llama")

    def run() -> list[Any]:
        with KubeApi.from_environment() as api:
            first = run_once(api, ref, parsed, memory, time.time())
            time.sleep(0.3)
            return [first, run_once(api, ref, parsed, memory, time.time())]

    return await asyncio.to_thread(run)


@pytest.mark.asyncio
@pytest.mark.kmock(cls=OptimisticEmulator)
@pytest.mark.timeout(30)
async def test_recommend_mode_writes_status_and_events_without_acting(
    kube: OptimisticEmulator, metrics_url: str
) -> None:
    add_deployment(kube, ["--max-num-seqs", "64"])
    add_policy(kube, policy_spec(metrics_url, "Recommend"))
    await tick_twice(policy_spec(metrics_url, "Recommend"), PolicyMemory())
    assert container_args(kube) == ["--max-num-seqs", "64"] and not kube.answered
    assert len(status_writes(kube)) == 2
    assert len(ours(kube[kmock.action.FETCH, DEPLOYMENTS])) == 2  # its max_num_seqs: read once a tick
    status = kube.objects[POLICIES, NS, "llama"]["status"]
    assert conditions(status)["Preempting"] == "True" and conditions(status)["Stable"] == "False"
    assert status["current"]["maxNumSeqs"] == 64
    assert 2 <= status["recommended"]["maxNumSeqs"] < 64
    assert {h["kind"] for h in status["history"]} == {"recommended"}
    messages = [e["message"] for e in our_events(kube) if e["reason"] == "TuningRecommended"]
    assert any(f"64 -> {status['recommended']['maxNumSeqs']}" in m for m in messages)


@pytest.mark.asyncio
@pytest.mark.kmock(cls=OptimisticEmulator)
@pytest.mark.timeout(30)
async def test_observe_mode_only_diagnoses(kube: OptimisticEmulator, metrics_url: str) -> None:
    add_deployment(kube, ["--max-num-seqs", "64"])
    add_policy(kube, policy_spec(metrics_url, "Observe"))
    await tick_twice(policy_spec(metrics_url, "Observe"), PolicyMemory())
    status = kube.objects[POLICIES, NS, "llama"]["status"]
    assert conditions(status)["Preempting"] == "True" and status["note"] == "observe mode"
    assert not status.get("history") and "recommended" not in status and not our_events(kube)
    assert container_args(kube) == ["--max-num-seqs", "64"]


@pytest.mark.asyncio
@pytest.mark.kmock(cls=OptimisticEmulator)
@pytest.mark.timeout(30)
async def test_unreachable_metrics_are_a_condition_not_an_action(kube: OptimisticEmulator) -> None:
    add_deployment(kube, ["--max-num-seqs", "64"])
    spec = policy_spec("http://127.0.0.1:9", "Apply")  # discard port: nothing listens
    add_policy(kube, spec)
    outcomes = await tick_twice(spec, PolicyMemory())
    assert all(o.tick.no_data for o in outcomes)
    status = kube.objects[POLICIES, NS, "llama"]["status"]
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


def add_admin_secret(kube: OptimisticEmulator, token: str, resource_version: str) -> None:
    kube.objects[SECRETS, NS, "llama-admin"] = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "llama-admin", "namespace": NS, "resourceVersion": resource_version},
        "data": {"token": base64.b64encode(token.encode()).decode()},
    }


def secret_reads(kube: OptimisticEmulator) -> tuple[int, int]:
    """(metadata-only reads, whole reads) of the admin-token Secret by our client."""
    reads = ours(kube[kmock.action.FETCH, SECRETS])
    metadata = sum(1 for r in reads if r.headers.get("Accept") == METADATA_ONLY)
    return metadata, len(reads) - metadata


@pytest.mark.asyncio
@pytest.mark.kmock(cls=OptimisticEmulator)
@pytest.mark.timeout(30)
async def test_a_tick_reads_the_secret_only_when_it_changed_and_the_knobs_once(
    kube: OptimisticEmulator, metrics_server: ThreadingHTTPServer, metrics_url: str
) -> None:
    spec = {
        **policy_spec(metrics_url, "Recommend"),
        "target": {
            "name": "llama",
            "engine": "kvtune",
            "adminUrl": metrics_url,
            "adminTokenSecretRef": {"name": "llama-admin", "key": "token"},
        },
    }
    add_policy(kube, spec)
    add_admin_secret(kube, "first-token", "1")
    parsed = KVTuningPolicySpec.model_validate(spec)
    ref = PolicyRef(NS, "llama", "uid-llama")
    memory = PolicyMemory()

    def run(api: KubeApi, ticks: int) -> None:
        for _ in range(ticks):
            outcome = run_once(api, ref, parsed, memory, time.time())
            assert memory.actuator_error is None, outcome.status.note

    with KubeApi.from_environment() as api:
        await asyncio.to_thread(run, api, 3)
        assert secret_reads(kube) == (3, 1)  # its resourceVersion every tick, its data once
        add_admin_secret(kube, "rotated-token", "2")
        await asyncio.to_thread(run, api, 2)
    assert secret_reads(kube) == (5, 2)  # read again once, when it changed
    sent = metrics_server.admin_tokens  # type: ignore[attr-defined]
    assert sent == ["Bearer first-token"] * 3 + ["Bearer rotated-token"] * 2  # the knobs: one read a tick
    assert len(status_writes(kube)) == 5
