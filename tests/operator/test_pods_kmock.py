"""A policy that tunes a workload of many replicas, against kmock's Kubernetes API (real HTTP) and one real
HTTP engine per pod on its own loopback address (127.0.0.2, .3, ...: Linux serves all of 127/8), listed in
the target Service's EndpointSlice: every pod is read and pooled, one value is decided, a kvtune engine's
value reaches every pod's admin API, a vLLM Deployment gets one patch, a replaced pod is no restart and
gets the operator's value, and status carries per-pod evidence and the worst pod."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import kmock
import pytest

from kvtune.contract import metrics as m
from kvtune.operator.decide.window import Window
from kvtune.operator.k8s.crd import KVTuningPolicySpec
from kvtune.operator.k8s.events import PolicyRef
from kvtune.operator.k8s.kube_api import KubeApi
from kvtune.operator.k8s.reconcile import Outcome, PolicyMemory, run_once
from kvtune.operator.k8s.workload_actuator import read_flag
from tests.operator.helpers import fixture_text, reply
from tests.operator.test_handlers_kmock import (  # noqa: F401  (kube: the emulator fixture)
    DEPLOYMENTS,
    NS,
    POLICIES,
    OptimisticEmulator,
    add_admin_secret,
    add_deployment,
    add_policy,
    container_args,
    kube,
    our_events,
    ours,
)

SLICES = kmock.resource("discovery.k8s.io/v1/endpointslices")
PREEMPTIONS_LINE = re.compile(r"^(vllm:num_preemptions_total\{.*\}) \S+$", re.M)
MAX_NUM_SEQS_LINE = re.compile(r"^(kvtune:max_num_seqs\{.*\}) \S+$", re.M)


class PodEngine(ThreadingHTTPServer):
    """One pod: the recorded kvtune scrape (t0 first, t1 after) with this pod's preemption counts, its live
    max_num_seqs and process start time; and a kvtune admin API that records every PATCH."""

    def __init__(self, address: str, port: int, preemptions: list[float]) -> None:
        super().__init__((address, port), PodHandler)
        self.preemptions = preemptions
        self.reads = 0
        self.knobs: dict[str, int | None] = {"max_num_seqs": 64, "max_tokens_cap": None}
        self.patches: list[dict[str, Any]] = []
        self.started = time.time()
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def metrics(self) -> str:
        text = fixture_text("kvtune_preempting_t0.prom" if self.reads == 0 else "kvtune_preempting_t1.prom")
        count = self.preemptions[min(self.reads, len(self.preemptions) - 1)]
        self.reads += 1
        text = PREEMPTIONS_LINE.sub(lambda found: f"{found.group(1)} {count}", text)
        text = MAX_NUM_SEQS_LINE.sub(lambda found: f"{found.group(1)} {self.knobs['max_num_seqs']}", text)
        return text + f"process_start_time_seconds {self.started}\n"


class PodHandler(BaseHTTPRequestHandler):
    server: PodEngine

    def do_GET(self) -> None:
        if self.path == "/admin/config":
            reply(self, 200, "application/json", json.dumps(self.server.knobs).encode())
        else:
            reply(self, 200, "text/plain; version=0.0.4", self.server.metrics().encode())

    def do_PATCH(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.patches.append(body)
        self.server.knobs.update(body)
        reply(self, 200, "application/json", json.dumps(self.server.knobs).encode())

    def log_message(self, *args: Any) -> None:
        pass


def free_port(addresses: list[str]) -> int:
    """A port free on every address (the pods listen on the same port, each on its own address)."""
    for _ in range(50):
        probe = socket.socket()
        probe.bind((addresses[0], 0))
        port = int(probe.getsockname()[1])
        held = [probe]
        try:
            for address in addresses[1:]:
                other = socket.socket()
                held.append(other)
                other.bind((address, port))
            return port
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()
    raise RuntimeError("no port free on every loopback address")


class Workload:
    """The pods of one Service: their engines, and the EndpointSlice that lists them in kmock."""

    def __init__(self, emulator: OptimisticEmulator, port: int) -> None:
        self.kube = emulator
        self.port = port
        self.pods: dict[str, PodEngine] = {}
        self.addresses: dict[str, str] = {}

    def start(self, name: str, address: str, preemptions: list[float]) -> PodEngine:
        self.pods[name] = PodEngine(address, self.port, preemptions)
        self.addresses[name] = address
        self.publish()
        return self.pods[name]

    def stop(self, name: str) -> None:
        engine = self.pods.pop(name)
        del self.addresses[name]
        engine.shutdown()
        engine.server_close()
        self.publish()

    def publish(self) -> None:
        self.kube.objects[SLICES, NS, "llama-abcde"] = {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {"name": "llama-abcde", "namespace": NS,
                         "labels": {"kubernetes.io/service-name": "llama"}},
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": self.port, "protocol": "TCP"}],
            "endpoints": [
                {"addresses": [address], "conditions": {"ready": True},
                 "targetRef": {"kind": "Pod", "name": name, "namespace": NS}}
                for name, address in sorted(self.addresses.items())
            ],
        }  # fmt: skip

    def close(self) -> None:
        for name in list(self.pods):
            self.stop(name)


@pytest.fixture
def workload(kube: OptimisticEmulator) -> Iterator[Workload]:  # noqa: F811
    kube.resources["discovery.k8s.io/v1/endpointslices"] = kmock.ResourceInfo(
        kind="EndpointSlice", namespaced=True, verbs={"list", "watch"}
    )
    # another Service's slice in the namespace: its pod (nothing listens there) is never read
    kube.objects[SLICES, NS, "other-xyz"] = {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": "other-xyz", "namespace": NS, "labels": {"kubernetes.io/service-name": "other"}},
        "addressType": "IPv4", "ports": [{"port": 9}],
        "endpoints": [{"addresses": ["127.0.0.9"], "targetRef": {"kind": "Pod", "name": "other-0"}}],
    }  # fmt: skip
    found = Workload(kube, free_port(["127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"]))
    yield found
    found.close()


def kvtune_spec(port: int, mode: str = "Apply") -> dict[str, Any]:
    return {
        "target": {
            "name": "llama",
            "engine": "kvtune",
            "adminTokenSecretRef": {"name": "llama-admin"},
            "podEndpoints": {"service": "llama", "metricsPort": port},
        },
        "mode": mode,
        "bounds": {"minMaxNumSeqs": 2, "maxMaxNumSeqs": 256},
        "intervalSeconds": 1,
        "evaluationWindowSeconds": 30,
        "cooldownSeconds": 0,
        "prediction": False,  # the ladder's first action on a two-sample window (the predicted move needs 5 s)
    }


def vllm_spec(port: int) -> dict[str, Any]:
    return {**kvtune_spec(port), "target": {"name": "llama", "container": "vllm", "engine": "vllm",
                                            "podEndpoints": {"service": "llama", "metricsPort": port}}}  # fmt: skip


async def ticks(spec: dict[str, Any], memory: PolicyMemory, count: int) -> list[Outcome]:
    parsed = KVTuningPolicySpec.model_validate(spec)
    ref = PolicyRef(NS, "llama", "uid-llama")

    def run() -> list[Outcome]:
        outcomes = []
        with KubeApi.from_environment() as api:
            for index in range(count):
                if index:
                    time.sleep(0.3)
                outcomes.append(run_once(api, ref, parsed, memory, time.time()))
        return outcomes

    return await asyncio.to_thread(run)


def reasons(kube: OptimisticEmulator) -> list[str]:  # noqa: F811
    return [event["reason"] for event in our_events(kube)]


@pytest.mark.asyncio
@pytest.mark.kmock(cls=OptimisticEmulator)
@pytest.mark.timeout(60)
async def test_three_kvtune_pods_get_the_one_decision_with_per_pod_evidence_in_status(
    kube: OptimisticEmulator,  # noqa: F811
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
    status = kube.objects[POLICIES, NS, "llama"]["status"]
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


@pytest.mark.asyncio
@pytest.mark.kmock(cls=OptimisticEmulator)
@pytest.mark.timeout(60)
async def test_a_vllm_deployment_of_three_pods_gets_exactly_one_patch(
    kube: OptimisticEmulator,  # noqa: F811
    workload: Workload,
) -> None:
    pods = [workload.start(f"llama-{n}", f"127.0.0.{n + 2}", [46, 95 + 10 * n]) for n in range(3)]
    add_deployment(kube, ["--model", "/models/llama", "--max-num-seqs=64"])
    add_policy(kube, vllm_spec(workload.port))
    outcomes = await ticks(vllm_spec(workload.port), PolicyMemory(), 3)

    patches = ours(kube[kmock.action.UPDATE, DEPLOYMENTS])
    assert len(patches) == 1  # one rolling restart for the workload, not one per pod
    lowered = read_flag(container_args(kube), "--max-num-seqs")
    assert lowered is not None and 2 <= lowered < 64
    assert [len(o.tick.applied) for o in outcomes] == [0, 1, 0]
    assert outcomes[1].tick.decision is not None
    assert outcomes[1].tick.decision.diagnosis.preemptions == 49 + 59 + 69
    assert all(pod.patches == [] for pod in pods)  # vLLM has no admin API: nothing goes to the pods
    status = kube.objects[POLICIES, NS, "llama"]["status"]
    assert status["worstPod"] == "llama-2" and [p["name"] for p in status["pods"]] == [
        "llama-2",
        "llama-1",
        "llama-0",
    ]


@pytest.mark.asyncio
@pytest.mark.kmock(cls=OptimisticEmulator)
@pytest.mark.timeout(60)
async def test_a_pod_replaced_during_the_window_is_no_restart_and_gets_the_operators_value(
    kube: OptimisticEmulator,  # noqa: F811
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
    window = Window.of(memory.samples)
    assert window.restarts() == 0
    counts = [sample.counters[m.PREEMPTIONS] for sample in window.samples]
    assert counts == sorted(counts) and counts[-1] - counts[-2] == 3  # the new pod's own work, no more
    diagnosis = replaced.tick.decision.diagnosis if replaced.tick.decision else None
    assert diagnosis is not None and (diagnosis.preemption_rate or 0) >= 0 and diagnosis.restarts == 0
    status = kube.objects[POLICIES, NS, "llama"]["status"]
    assert {p["name"] for p in status["pods"]} == {"llama-a", "llama-b", "llama-d"}  # c is gone
    assert {p["maxNumSeqs"] for p in status["pods"]} == {value}
    assert not {"EngineRestarted", "PodRestarted", "ReapplyFailed"} & set(reasons(kube))
    assert "DesiredStateReapplied" in reasons(kube)
