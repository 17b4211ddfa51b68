"""A vLLM Deployment of three pods, each with a kvtune proxy sidecar, tuned through `target.podEndpoints`
with `proxyPort`, against kmock's Kubernetes API (real HTTP). Each pod is two real HTTP servers on its own
loopback address (127.0.0.2, .3, ...): vLLM's /metrics (recorded scrapes, clients asking for far more
tokens than they get) and the proxy's /metrics (recorded prefix defeats) with its bearer-guarded admin API.
The cap reaches every pod's proxy, max_num_seqs is one Deployment patch, the proxies' defeat counters pool
into the flag rung's evidence, and a replaced pod's proxy gets the cap back."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import kmock
import pytest

from kvtune.operator.k8s.reconcile import PolicyMemory
from kvtune.operator.k8s.workload_actuator import read_flag
from tests.operator.helpers import fixture_text, reply, vllm_asking_long
from tests.operator.kmock_world import (
    DEPLOYMENTS,
    NS,
    POLICIES,
    OptimisticEmulator,
    add_admin_secret,
    add_deployment,
    add_policy,
    container_args,
    our_events,
    ours,
)
from tests.operator.pods_world import SLICES, free_port, reasons, ticks

TOKEN = "proxies-token"
CAP = 256  # generation p99 ~199 x 1.25, rounded up to 250, then the policy's floor of 256
ARGS = ["--model", "/models/llama", "--max-num-seqs=64"]
PREEMPTIONS_LINE = re.compile(r"^(vllm:num_preemptions_total\{.*\}) \S+$", re.M)


class EngineHandler(BaseHTTPRequestHandler):
    """vLLM's /metrics in one pod: the recorded scrapes (t0, then t1) with this pod's preemption counts."""

    server: EngineServer

    def do_GET(self) -> None:
        reply(self, 200, "text/plain; version=0.0.4", self.server.metrics().encode())

    def log_message(self, *args: Any) -> None:
        pass


class EngineServer(ThreadingHTTPServer):
    def __init__(self, address: str, port: int, preemptions: list[float]) -> None:
        super().__init__((address, port), EngineHandler)
        self.preemptions = preemptions
        self.reads = 0
        self.started = time.time()

    def metrics(self) -> str:
        text = vllm_asking_long("t0" if self.reads == 0 else "t1")
        count = self.preemptions[min(self.reads, len(self.preemptions) - 1)]
        self.reads += 1
        text = PREEMPTIONS_LINE.sub(lambda found: f"{found.group(1)} {count}", text)
        return text + f"process_start_time_seconds {self.started}\n"


class ProxyHandler(BaseHTTPRequestHandler):
    """A kvtune proxy sidecar: its /metrics (recorded prefix defeats, t0 then t1) and its admin API
    `GET/PATCH /admin/config` behind the bearer token, recording every PATCH it accepts."""

    server: ProxyServer

    def _authorized(self) -> bool:
        if self.headers.get("Authorization") == f"Bearer {TOKEN}":
            return True
        reply(self, 401, "application/json", b'{"error": {"message": "bad token"}}')
        return False

    def do_GET(self) -> None:
        if self.path == "/metrics":
            moment = "t0" if self.server.reads == 0 else "t1"
            self.server.reads += 1
            reply(
                self, 200, "text/plain; version=0.0.4", fixture_text(f"proxy_defeats_{moment}.prom").encode()
            )
        elif self.path == "/admin/config" and self._authorized():
            reply(self, 200, "application/json", json.dumps(self.server.config).encode())

    def do_PATCH(self) -> None:
        if self.path != "/admin/config" or not self._authorized():
            return
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.patches.append(body)
        self.server.config.update(body)
        reply(self, 200, "application/json", json.dumps(self.server.config).encode())

    def log_message(self, *args: Any) -> None:
        pass


class ProxyServer(ThreadingHTTPServer):
    def __init__(self, address: str, port: int, cap: int | None) -> None:
        super().__init__((address, port), ProxyHandler)
        self.reads = 0
        self.config: dict[str, Any] = {"max_tokens_cap": cap, "cap_mode": "clamp"}
        self.patches: list[dict[str, Any]] = []


class SidecarPod:
    """One pod of the vLLM Deployment: vLLM and its kvtune proxy, on the pod's address."""

    def __init__(self, engine: EngineServer, proxy: ProxyServer) -> None:
        self.engine = engine
        self.proxy = proxy
        for server in (engine, proxy):
            threading.Thread(target=server.serve_forever, daemon=True).start()

    def close(self) -> None:
        for server in (self.engine, self.proxy):
            server.shutdown()
            server.server_close()


class SidecarWorkload:
    """The pods behind Service `llama`, listed in its EndpointSlice (the port named there is vLLM's)."""

    def __init__(self, emulator: OptimisticEmulator, engine_port: int, proxy_port: int) -> None:
        self.kube = emulator
        self.engine_port = engine_port
        self.proxy_port = proxy_port
        self.pods: dict[str, SidecarPod] = {}
        self.addresses: dict[str, str] = {}

    def start(self, name: str, address: str, preemptions: list[float], cap: int | None = None) -> SidecarPod:
        engine = EngineServer(address, self.engine_port, preemptions)
        self.pods[name] = SidecarPod(engine, ProxyServer(address, self.proxy_port, cap))
        self.addresses[name] = address
        self.publish()
        return self.pods[name]

    def stop(self, name: str) -> None:
        self.pods.pop(name).close()
        del self.addresses[name]
        self.publish()

    def publish(self) -> None:
        self.kube.objects[SLICES, NS, "llama-abcde"] = {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {"name": "llama-abcde", "namespace": NS,
                         "labels": {"kubernetes.io/service-name": "llama"}},
            "addressType": "IPv4",
            "ports": [{"name": "vllm", "port": self.engine_port, "protocol": "TCP"},
                      {"name": "proxy", "port": self.proxy_port, "protocol": "TCP"}],
            "endpoints": [
                {"addresses": [address], "conditions": {"ready": True},
                 "targetRef": {"kind": "Pod", "name": name, "namespace": NS}}
                for name, address in sorted(self.addresses.items())
            ],
        }  # fmt: skip

    def close(self) -> None:
        for name in list(self.pods):
            self.stop(name)


ADDRESSES = ["127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"]


@pytest.fixture
def workload(kube: OptimisticEmulator) -> Iterator[SidecarWorkload]:
    kube.resources["discovery.k8s.io/v1/endpointslices"] = kmock.ResourceInfo(
        kind="EndpointSlice", namespaced=True, verbs={"list", "watch"}
    )
    engine_port = free_port(ADDRESSES)
    proxy_port = free_port(ADDRESSES)
    while proxy_port == engine_port:
        proxy_port = free_port(ADDRESSES)
    found = SidecarWorkload(kube, engine_port, proxy_port)
    yield found
    found.close()


def sidecar_spec(workload: SidecarWorkload) -> dict[str, Any]:
    return {
        "target": {
            "name": "llama", "container": "vllm", "engine": "vllm",
            "proxyAdminTokenSecretRef": {"name": "llama-admin"},
            "podEndpoints": {"service": "llama", "metricsPort": workload.engine_port,
                             "proxyPort": workload.proxy_port},
        },
        "mode": "Apply",
        "bounds": {"minMaxNumSeqs": 2, "maxMaxNumSeqs": 256},
        "intervalSeconds": 1,
        "evaluationWindowSeconds": 30,
        "cooldownSeconds": 0,
        "prediction": False,  # the ladder's first action on a two-sample window (the predicted move needs 5 s)
    }  # fmt: skip


def deployment_patches(kube: OptimisticEmulator) -> list[kmock.Request]:
    return ours(kube[kmock.action.UPDATE, DEPLOYMENTS])


def three_pods(workload: SidecarWorkload, cap: int | None = None) -> list[SidecarPod]:
    # between the two scrapes pod 2 preempts 69 times, pod 1 59, pod 0 49
    return [workload.start(f"llama-{n}", ADDRESSES[n], [46, 95 + 10 * n], cap) for n in range(3)]


@pytest.mark.asyncio
@pytest.mark.kmock(cls=OptimisticEmulator)
@pytest.mark.timeout(60)
async def test_the_cap_reaches_every_pods_proxy_and_their_defeats_pool(
    kube: OptimisticEmulator,
    workload: SidecarWorkload,
) -> None:
    pods = three_pods(workload)
    add_deployment(kube, ARGS)
    add_admin_secret(kube, TOKEN, "1")
    spec = sidecar_spec(workload)
    add_policy(kube, spec)
    first, second = await ticks(spec, PolicyMemory(), 2)

    assert not first.tick.applied  # a baseline: rates need two samples
    assert [(change.knob, change.value, result.ok) for change, result in second.tick.applied] == [
        ("max_tokens_cap", CAP, True)
    ]
    assert [pod.proxy.patches for pod in pods] == [[{"max_tokens_cap": CAP}]] * 3  # every pod's proxy, once
    assert container_args(kube) == ARGS and not deployment_patches(kube)  # the cap restarts nothing
    diagnosis = second.tick.decision.diagnosis  # type: ignore[union-attr]
    assert diagnosis.preemptions == 49 + 59 + 69  # vLLM's counters, pooled: summed
    # each proxy saw 30 varying-head and 2 misaligned defeats in the window: the flag rung reads all 90 + 6
    assert dict(diagnosis.prefix_defeats) == {"varying_head": 90.0, "misaligned": 6.0}
    status = kube.objects[POLICIES, NS, "llama"]["status"]
    prefix = next(c for c in status["conditions"] if c["type"] == "PrefixCacheDefeated")
    assert (prefix["status"], prefix["reason"]) == ("True", "PrefixDefeatsReported")
    assert "varying_head: 90 prompts" in prefix["message"]
    assert (status["current"]["maxTokensCap"], status["current"]["maxNumSeqs"]) == (CAP, 64)
    assert status["desired"] == {"maxTokensCap": CAP}
    assert status["worstPod"] == "llama-2" and [p["name"] for p in status["pods"]] == [
        "llama-2", "llama-1", "llama-0",
    ]  # fmt: skip
    assert not {"ApplyFailed", "ActuatorUnavailable", "ProxyMetricsMissing", "PodRestarted"} & set(
        reasons(kube)
    )


@pytest.mark.asyncio
@pytest.mark.kmock(cls=OptimisticEmulator)
@pytest.mark.timeout(60)
async def test_max_num_seqs_is_one_deployment_patch_beside_capped_proxies(
    kube: OptimisticEmulator,
    workload: SidecarWorkload,
) -> None:
    pods = three_pods(workload, cap=CAP)  # the proxies already hold the cap the ladder would set
    add_deployment(kube, ARGS)
    add_admin_secret(kube, TOKEN, "1")
    spec = sidecar_spec(workload)
    add_policy(kube, spec)
    outcomes = await ticks(spec, PolicyMemory(), 3)

    assert len(deployment_patches(kube)) == 1  # one rolling restart for the three pods
    lowered = read_flag(container_args(kube), "--max-num-seqs")
    assert lowered is not None and 2 <= lowered < 64
    assert [[change.knob for change, _ in o.tick.applied] for o in outcomes] == [[], ["max_num_seqs"], []]
    assert all(pod.proxy.patches == [] for pod in pods)  # nothing to send: every proxy holds the cap
    status = kube.objects[POLICIES, NS, "llama"]["status"]
    assert status["current"]["maxTokensCap"] == CAP
    assert [h["knob"] for h in status["history"] if h["kind"] == "applied"] == ["max_num_seqs"]


@pytest.mark.asyncio
@pytest.mark.kmock(cls=OptimisticEmulator)
@pytest.mark.timeout(60)
async def test_a_replaced_pods_proxy_gets_the_cap_back(
    kube: OptimisticEmulator,
    workload: SidecarWorkload,
) -> None:
    pods = three_pods(workload)
    add_deployment(kube, ARGS)
    add_admin_secret(kube, TOKEN, "1")
    spec = sidecar_spec(workload)
    add_policy(kube, spec)
    memory = PolicyMemory()
    await ticks(spec, memory, 2)
    assert all(pod.proxy.config["max_tokens_cap"] == CAP for pod in pods)

    # llama-2 is replaced by llama-3: a new vLLM (3 preemptions since it started) and a proxy with no cap
    workload.stop("llama-2")
    new = workload.start("llama-3", ADDRESSES[3], [3])
    (replaced,) = await ticks(spec, memory, 1)

    assert new.proxy.config["max_tokens_cap"] == CAP and {"max_tokens_cap": CAP} in new.proxy.patches
    assert [(knob, value) for knob, value, result in replaced.tick.reapplied if result.ok] == [
        ("max_tokens_cap", CAP)
    ]
    assert replaced.tick.restart is None and replaced.tick.no_data is None
    assert container_args(kube) == ARGS and not deployment_patches(kube)  # still no restart
    status = kube.objects[POLICIES, NS, "llama"]["status"]
    assert {p["name"] for p in status["pods"]} == {"llama-0", "llama-1", "llama-3"}  # llama-2 is gone
    assert "DesiredStateReapplied" in reasons(kube)
    assert not {"ReapplyFailed", "EngineRestarted"} & set(reasons(kube))


@pytest.mark.asyncio
@pytest.mark.kmock(cls=OptimisticEmulator)
@pytest.mark.timeout(60)
async def test_a_pod_whose_proxy_metrics_fail_is_named_and_the_workload_still_tuned(
    kube: OptimisticEmulator,
    workload: SidecarWorkload,
) -> None:
    pods = three_pods(workload)
    pods[1].proxy.shutdown()
    pods[1].proxy.server_close()  # llama-1's proxy is down: its /metrics and admin API do not answer
    add_deployment(kube, ARGS)
    add_admin_secret(kube, TOKEN, "1")
    spec = sidecar_spec(workload)
    add_policy(kube, spec)
    outcomes = await ticks(spec, PolicyMemory(), 2)

    assert all(o.tick.no_data is None for o in outcomes)  # vLLM's own metrics carry the diagnosis
    missing = [e["message"] for e in our_events(kube) if e["reason"] == "ProxyMetricsMissing"]
    assert len(missing) == 1 and "pod llama-1" in missing[0] and "llama-0" not in missing[0]
    diagnosis = outcomes[-1].tick.decision.diagnosis  # type: ignore[union-attr]
    assert dict(diagnosis.prefix_defeats) == {"varying_head": 60.0, "misaligned": 4.0}  # the two that answer
    # the cap goes to the proxies that answer; the one that does not is named as a failure
    assert [pods[n].proxy.patches for n in (0, 2)] == [[{"max_tokens_cap": CAP}]] * 2
    failed = [e["message"] for e in our_events(kube) if e["reason"] == "ApplyFailed"]
    assert len(failed) == 1 and "pod llama-1" in failed[0]
