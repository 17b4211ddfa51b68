"""A vLLM Deployment of three pods, each with a kvtune proxy sidecar, tuned through `target.podEndpoints`
with `proxyPort`, against kmock's Kubernetes API (real HTTP). Each pod is two real HTTP servers on its own
loopback address (127.0.0.2, .3, ...): vLLM's /metrics (recorded scrapes, clients asking for far more
tokens than they get) and the proxy's /metrics (recorded prefix defeats) with its bearer-guarded admin API.
The cap reaches every pod's proxy, max_num_seqs is one Deployment patch, the proxies' defeat counters pool
into the flag rung's evidence, and a replaced pod's proxy gets the cap back."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack
from http.server import ThreadingHTTPServer
from typing import Any

import kmock
import pytest

from kvtune.operator.k8s.reconcile import PolicyMemory
from kvtune.operator.k8s.workload_actuator import read_flag
from tests.operator.helpers import (
    ASKING_LONG_CAP,
    ProxyServer,
    QuietHandler,
    reply,
    running,
    vllm_asking_long,
)
from tests.operator.kmock_world import (
    LLAMA_ARGS,
    OptimisticEmulator,
    add_deployment_and_policy,
    container_args,
    deployment_patches,
    fast_policy,
    our_events,
    policy_status,
    reasons,
    ticks,
)
from tests.operator.pods_world import PREEMPTIONS_LINE, Pods, free_port

TOKEN = "proxies-token"

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]


class EngineHandler(QuietHandler):
    """vLLM's /metrics in one pod: the recorded scrapes (t0, then t1) with this pod's preemption counts."""

    server: EngineServer

    def do_GET(self) -> None:
        reply(self, 200, "text/plain; version=0.0.4", self.server.metrics().encode())


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


class SidecarPod:
    """One pod of the vLLM Deployment: vLLM and its kvtune proxy, on the pod's address."""

    def __init__(self, engine: EngineServer, proxy: ProxyServer) -> None:
        self.engine = engine
        self.proxy = proxy
        self.serving = ExitStack()
        for server in (engine, proxy):
            self.serving.enter_context(running(server))

    def close(self) -> None:
        self.serving.close()


class SidecarWorkload(Pods[SidecarPod]):
    """The pods behind Service `llama`, listed in its EndpointSlice (the port named there is vLLM's)."""

    def __init__(self, emulator: OptimisticEmulator, engine_port: int, proxy_port: int) -> None:
        super().__init__(emulator)
        self.engine_port = engine_port
        self.proxy_port = proxy_port

    def start(self, name: str, address: str, preemptions: list[float], cap: int | None = None) -> SidecarPod:
        engine = EngineServer(address, self.engine_port, preemptions)
        return self.add(name, address, SidecarPod(engine, ProxyServer(TOKEN, cap, address, self.proxy_port)))

    def ports(self) -> list[dict[str, Any]]:
        return [{"name": "vllm", "port": self.engine_port, "protocol": "TCP"},
                {"name": "proxy", "port": self.proxy_port, "protocol": "TCP"}]  # fmt: skip


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
    target = {
        "name": "llama", "container": "vllm", "engine": "vllm",
        "proxyAdminTokenSecretRef": {"name": "llama-admin"},
        "podEndpoints": {"service": "llama", "metricsPort": workload.engine_port, "proxyPort": workload.proxy_port},
    }  # fmt: skip
    return fast_policy(target)


def three_pods(
    kube: OptimisticEmulator, workload: SidecarWorkload, cap: int | None = None
) -> tuple[list[SidecarPod], dict[str, Any]]:
    """Three pods of the vLLM Deployment, the proxies' token and the policy over them: the pods and its spec.
    Between the two scrapes pod 2 preempts 69 times, pod 1 59, pod 0 49."""
    pods = [workload.start(f"llama-{n}", ADDRESSES[n], [46, 95 + 10 * n], cap) for n in range(3)]
    return pods, add_deployment_and_policy(kube, LLAMA_ARGS, sidecar_spec(workload), TOKEN)


async def test_the_cap_reaches_every_pods_proxy_and_their_defeats_pool(
    kube: OptimisticEmulator,
    workload: SidecarWorkload,
) -> None:
    pods, spec = three_pods(kube, workload)
    first, second = await ticks(spec, PolicyMemory(), 2)

    assert not first.tick.applied  # a baseline: rates need two samples
    assert [(change.knob, change.value, result.ok) for change, result in second.tick.applied] == [
        ("max_tokens_cap", ASKING_LONG_CAP, True)
    ]
    assert [pod.proxy.patches for pod in pods] == [
        [{"max_tokens_cap": ASKING_LONG_CAP}]
    ] * 3  # every pod's proxy, once
    assert container_args(kube) == LLAMA_ARGS and not deployment_patches(kube)  # the cap restarts nothing
    diagnosis = second.tick.decision.diagnosis  # type: ignore[union-attr]
    assert diagnosis.preemptions == 49 + 59 + 69  # vLLM's counters, pooled: summed
    # each proxy saw 30 varying-head and 2 misaligned defeats in the window: the flag rung reads all 90 + 6
    assert dict(diagnosis.prefix_defeats) == {"varying_head": 90.0, "misaligned": 6.0}
    status = policy_status(kube)
    prefix = next(c for c in status["conditions"] if c["type"] == "PrefixCacheDefeated")
    assert (prefix["status"], prefix["reason"]) == ("True", "PrefixDefeatsReported")
    assert "varying_head: 90 prompts" in prefix["message"]
    assert (status["current"]["maxTokensCap"], status["current"]["maxNumSeqs"]) == (ASKING_LONG_CAP, 64)
    assert status["desired"] == {"maxTokensCap": ASKING_LONG_CAP}
    assert status["worstPod"] == "llama-2" and [p["name"] for p in status["pods"]] == [
        "llama-2", "llama-1", "llama-0",
    ]  # fmt: skip
    assert not {"ApplyFailed", "ActuatorUnavailable", "ProxyMetricsMissing", "PodRestarted"} & set(
        reasons(kube)
    )


async def test_max_num_seqs_is_one_deployment_patch_beside_capped_proxies(
    kube: OptimisticEmulator,
    workload: SidecarWorkload,
) -> None:
    pods, spec = three_pods(
        kube, workload, cap=ASKING_LONG_CAP
    )  # the proxies already hold the cap the ladder would set
    outcomes = await ticks(spec, PolicyMemory(), 3)

    assert len(deployment_patches(kube)) == 1  # one rolling restart for the three pods
    lowered = read_flag(container_args(kube), "--max-num-seqs")
    assert lowered is not None and 2 <= lowered < 64
    assert [[change.knob for change, _ in o.tick.applied] for o in outcomes] == [[], ["max_num_seqs"], []]
    assert all(pod.proxy.patches == [] for pod in pods)  # nothing to send: every proxy holds the cap
    status = policy_status(kube)
    assert status["current"]["maxTokensCap"] == ASKING_LONG_CAP
    assert [h["knob"] for h in status["history"] if h["kind"] == "applied"] == ["max_num_seqs"]


async def test_a_replaced_pods_proxy_gets_the_cap_back(
    kube: OptimisticEmulator,
    workload: SidecarWorkload,
) -> None:
    pods, spec = three_pods(kube, workload)
    memory = PolicyMemory()
    await ticks(spec, memory, 2)
    assert all(pod.proxy.config["max_tokens_cap"] == ASKING_LONG_CAP for pod in pods)

    # llama-2 is replaced by llama-3: a new vLLM (3 preemptions since it started) and a proxy with no cap
    workload.stop("llama-2")
    new = workload.start("llama-3", ADDRESSES[3], [3])
    (replaced,) = await ticks(spec, memory, 1)

    assert (
        new.proxy.config["max_tokens_cap"] == ASKING_LONG_CAP
        and {"max_tokens_cap": ASKING_LONG_CAP} in new.proxy.patches
    )
    assert [(knob, value) for knob, value, result in replaced.tick.reapplied if result.ok] == [
        ("max_tokens_cap", ASKING_LONG_CAP)
    ]
    assert replaced.tick.restart is None and replaced.tick.no_data is None
    assert container_args(kube) == LLAMA_ARGS and not deployment_patches(kube)  # still no restart
    status = policy_status(kube)
    assert {p["name"] for p in status["pods"]} == {"llama-0", "llama-1", "llama-3"}  # llama-2 is gone
    assert "DesiredStateReapplied" in reasons(kube)
    assert not {"ReapplyFailed", "EngineRestarted"} & set(reasons(kube))


async def test_a_pod_whose_proxy_metrics_fail_is_named_and_the_workload_still_tuned(
    kube: OptimisticEmulator,
    workload: SidecarWorkload,
) -> None:
    pods, spec = three_pods(kube, workload)
    pods[1].proxy.shutdown()
    pods[1].proxy.server_close()  # llama-1's proxy is down: its /metrics and admin API do not answer
    outcomes = await ticks(spec, PolicyMemory(), 2)

    assert all(o.tick.no_data is None for o in outcomes)  # vLLM's own metrics carry the diagnosis
    missing = [e["message"] for e in our_events(kube) if e["reason"] == "ProxyMetricsMissing"]
    assert len(missing) == 1 and "pod llama-1" in missing[0] and "llama-0" not in missing[0]
    diagnosis = outcomes[-1].tick.decision.diagnosis  # type: ignore[union-attr]
    assert dict(diagnosis.prefix_defeats) == {"varying_head": 60.0, "misaligned": 4.0}  # the two that answer
    # the cap goes to the proxies that answer; the one that does not is named as a failure
    assert [pods[n].proxy.patches for n in (0, 2)] == [[{"max_tokens_cap": ASKING_LONG_CAP}]] * 2
    failed = [e["message"] for e in our_events(kube) if e["reason"] == "ApplyFailed"]
    assert len(failed) == 1 and "pod llama-1" in failed[0]
