"""Rung 1 on vLLM through a kvtune proxy: the max_tokens cap goes to the proxy's admin API (live, no
restart), max_num_seqs still through the Deployment. In a cluster against kmock's Kubernetes API, and with
`kvtune operator --local --proxy`; the proxy is a local stand-in with the proxy's admin API shape, and the
engine a /metrics of recorded vLLM scrapes."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import kmock
import pytest

from kvtune.cli import main
from kvtune.operator.k8s.crd import KVTuningPolicySpec
from kvtune.operator.k8s.events import PolicyRef
from kvtune.operator.k8s.kube_api import KubeApi
from kvtune.operator.k8s.reconcile import Outcome, PolicyMemory, PolicyTick, run_once
from kvtune.operator.k8s.workload_actuator import read_flag
from tests.operator.helpers import fixture_text, reply, serve_bodies, vllm_asking_long
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

PROXY_TOKEN = "proxy-secret"
CAP = 256  # generation p99 ~199 x 1.25, rounded up to 250, then the policy's floor of 256


class ProxyStandIn(BaseHTTPRequestHandler):
    """A kvtune proxy's /metrics (recorded t0, then t1) and its admin API `GET/PATCH /admin/config`
    ({max_tokens_cap, cap_mode}, bearer token), recording every PATCH it accepts."""

    def _authorized(self) -> bool:
        if self.headers.get("Authorization") == f"Bearer {PROXY_TOKEN}":
            return True
        reply(self, 401, "application/json", b'{"error": {"message": "bad token"}}')
        return False

    def do_GET(self) -> None:
        server: Any = self.server
        if self.path == "/metrics":
            server.scrapes += 1
            body = server.metrics.pop(0) if len(server.metrics) > 1 else server.metrics[0]
            reply(self, 200, "text/plain; version=0.0.4", body.encode())
        elif self.path == "/admin/config" and self._authorized():
            reply(self, 200, "application/json", json.dumps(server.config).encode())
        elif self.path != "/admin/config":
            reply(self, 404, "application/json", b"{}")

    def do_PATCH(self) -> None:
        server: Any = self.server
        if self.path != "/admin/config" or not self._authorized():
            return
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if not set(body) <= {"max_tokens_cap", "cap_mode"}:
            reply(self, 400, "application/json", b'{"error": {"message": "unknown field"}}')
            return
        server.patches.append(body)
        server.config.update(body)
        reply(self, 200, "application/json", json.dumps(server.config).encode())

    def log_message(self, *args: object) -> None:
        pass


def start_proxy(cap: int | None) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer(("127.0.0.1", 0), ProxyStandIn)
    server.metrics = [fixture_text("proxy_defeats_t0.prom"), fixture_text("proxy_defeats_t1.prom")]  # type: ignore[attr-defined]
    server.config = {"max_tokens_cap": cap, "cap_mode": "clamp"}  # type: ignore[attr-defined]
    server.patches = []  # type: ignore[attr-defined]
    server.scrapes = 0  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture()
def proxy() -> Iterator[ThreadingHTTPServer]:
    server = start_proxy(None)
    yield server
    server.shutdown()


@pytest.fixture()
def capped_proxy() -> Iterator[ThreadingHTTPServer]:
    """A proxy that already holds the cap the ladder would set."""
    server = start_proxy(CAP)
    yield server
    server.shutdown()


@pytest.fixture()
def vllm_url() -> Iterator[str]:
    """vLLM's /metrics: preempting, clients asking for up to 1,000 tokens while generating ~200."""
    yield from serve_bodies([vllm_asking_long("t0"), vllm_asking_long("t1")])


def url(server: ThreadingHTTPServer) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}"


def behind_proxy(vllm: str, proxy: str) -> dict[str, Any]:
    return {
        "target": {
            "name": "llama", "container": "vllm", "engine": "vllm", "proxyAdminUrl": proxy,
            "proxyAdminTokenSecretRef": {"name": "llama-admin", "key": "token"},
        },
        "metrics": {"metricsUrl": vllm, "proxyMetricsUrl": proxy},
        "mode": "Apply",
        "bounds": {"minMaxNumSeqs": 2, "maxMaxNumSeqs": 256},
        "intervalSeconds": 1,
        "evaluationWindowSeconds": 30,
        "cooldownSeconds": 0,
        "prediction": False,  # the ladder's first action on a two-sample window (the predicted move needs 5 s)
    }  # fmt: skip


async def two_ticks(spec: dict[str, Any]) -> list[Outcome]:
    parsed = KVTuningPolicySpec.model_validate(spec)
    ref, memory = PolicyRef(NS, "llama", "uid-llama"), PolicyMemory()

    def run() -> list[Outcome]:
        with KubeApi.from_environment() as api:
            first = run_once(api, PolicyTick(ref, parsed, time.time()), memory)
            time.sleep(0.3)
            return [first, run_once(api, PolicyTick(ref, parsed, time.time()), memory)]

    return await asyncio.to_thread(run)


ARGS = ["--model", "/models/llama", "--max-num-seqs=64"]


@pytest.mark.asyncio
@pytest.mark.kmock(cls=OptimisticEmulator)
@pytest.mark.timeout(30)
async def test_the_cap_goes_to_the_proxy_and_the_deployment_is_not_restarted(
    kube: OptimisticEmulator, vllm_url: str, proxy: ThreadingHTTPServer
) -> None:
    add_deployment(kube, ARGS)
    add_admin_secret(kube, PROXY_TOKEN, "1")
    spec = behind_proxy(vllm_url, url(proxy))
    add_policy(kube, spec)
    outcomes = await two_ticks(spec)
    assert proxy.patches == [{"max_tokens_cap": CAP}]  # type: ignore[attr-defined]
    assert container_args(kube) == ARGS and not ours(kube[kmock.action.UPDATE, DEPLOYMENTS])  # no restart
    status = kube.objects[POLICIES, NS, "llama"]["status"]
    applied = [h for h in status["history"] if h["kind"] == "applied"]
    assert [(h["knob"], h.get("before"), h["after"]) for h in applied] == [("max_tokens_cap", None, CAP)]
    current = status["current"]
    assert (current["maxNumSeqs"], current["maxTokensCap"]) == (64, CAP)  # seats: the Deployment; cap: live
    assert status["desired"] == {"maxTokensCap": CAP}
    messages = [e["message"] for e in our_events(kube) if e["reason"] == "TuningApplied"]
    assert len(messages) == 1 and f"max_tokens_cap: None -> {CAP}" in messages[0]
    # the proxy's defeat series reached the diagnosis: the flag names the reasons
    diagnosis = outcomes[-1].tick.decision.diagnosis  # type: ignore[union-attr]
    assert dict(diagnosis.prefix_defeats) == {"varying_head": 30.0, "misaligned": 2.0}
    prefix = next(c for c in status["conditions"] if c["type"] == "PrefixCacheDefeated")
    assert (prefix["status"], prefix["reason"]) == ("True", "PrefixDefeatsReported")
    assert "varying_head: 30 prompts" in prefix["message"]


@pytest.mark.asyncio
@pytest.mark.kmock(cls=OptimisticEmulator)
@pytest.mark.timeout(30)
async def test_max_num_seqs_still_goes_through_the_deployment(
    kube: OptimisticEmulator, vllm_url: str, capped_proxy: ThreadingHTTPServer
) -> None:
    add_deployment(kube, ARGS)
    add_admin_secret(kube, PROXY_TOKEN, "1")
    spec = behind_proxy(vllm_url, url(capped_proxy))
    add_policy(kube, spec)
    await two_ticks(spec)
    assert capped_proxy.patches == []  # type: ignore[attr-defined]  # already capped: nothing to send
    lowered = read_flag(container_args(kube), "--max-num-seqs")
    assert lowered is not None and 2 <= lowered < 64
    status = kube.objects[POLICIES, NS, "llama"]["status"]
    assert [h["knob"] for h in status["history"] if h["kind"] == "applied"] == ["max_num_seqs"]
    assert status["current"]["maxTokensCap"] == CAP


@pytest.mark.asyncio
@pytest.mark.kmock(cls=OptimisticEmulator)
@pytest.mark.timeout(30)
async def test_a_missing_proxy_secret_leaves_the_cap_a_recommendation(
    kube: OptimisticEmulator, vllm_url: str, proxy: ThreadingHTTPServer
) -> None:
    add_deployment(kube, ARGS)  # no Secret for the proxy's token
    spec = behind_proxy(vllm_url, url(proxy))
    add_policy(kube, spec)
    await two_ticks(spec)
    assert proxy.patches == []  # type: ignore[attr-defined]
    reasons = [e["reason"] for e in our_events(kube)]
    assert reasons.count("ActuatorUnavailable") == 1
    status = kube.objects[POLICIES, NS, "llama"]["status"]
    # issue 37: a condition too, and the first thing in the way of Apply
    found = {c["type"]: (c["status"], c["reason"], c["message"]) for c in status["conditions"]}
    unavailable, ready = found["ActuatorUnavailable"], found["Ready"]
    assert unavailable[:2] == ("True", "SecretUnreadable") and "llama-admin" in unavailable[2]
    assert ready == ("False", "ActuatorUnavailable", unavailable[2])
    kinds = {(h["kind"], h["knob"]) for h in status["history"]}
    assert ("recommended", "max_tokens_cap") in kinds and ("applied", "max_num_seqs") in kinds
    assert read_flag(container_args(kube), "--max-num-seqs") != 64  # the Deployment's knob still moves


@pytest.mark.asyncio
@pytest.mark.kmock(cls=OptimisticEmulator)
@pytest.mark.timeout(30)
async def test_proxy_metrics_that_cannot_be_read_are_an_event_not_a_stop(
    kube: OptimisticEmulator, vllm_url: str, proxy: ThreadingHTTPServer
) -> None:
    add_deployment(kube, ARGS)
    add_admin_secret(kube, PROXY_TOKEN, "1")
    spec = behind_proxy(vllm_url, url(proxy))
    spec["metrics"]["proxyMetricsUrl"] = "http://127.0.0.1:9"  # nothing listens
    add_policy(kube, spec)
    outcomes = await two_ticks(spec)
    assert all(o.tick.no_data is None for o in outcomes)  # the engine's metrics carry the diagnosis
    missing = [e for e in our_events(kube) if e["reason"] == "ProxyMetricsMissing"]
    assert len(missing) == 1 and "127.0.0.1:9" in missing[0]["message"]  # once, on the transition
    assert proxy.patches == [{"max_tokens_cap": CAP}]  # type: ignore[attr-defined]  # the cap still acts


def test_local_operator_sets_the_cap_through_the_proxy(
    vllm_url: str, proxy: ThreadingHTTPServer, tmp_path: Path
) -> None:
    """The operator runs until the cap has been patched and two more ticks have scraped the proxy (so a
    second patch would have shown), then is stopped with SIGTERM as a user would: events, not a duration."""
    token = tmp_path / "proxy-token"
    token.write_text(PROXY_TOKEN + "\n")
    token.chmod(0o600)
    server: Any = proxy

    def stop_after_two_more_ticks() -> None:
        deadline = time.monotonic() + 120  # only a hang reaches it
        while not server.patches and time.monotonic() < deadline:
            time.sleep(0.05)
        patched_at = server.scrapes
        while server.scrapes < patched_at + 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    previous = signal.getsignal(signal.SIGTERM)
    watcher = threading.Thread(target=stop_after_two_more_ticks, daemon=True)
    watcher.start()
    try:
        code = main([
            "operator", "--local", "--target", vllm_url, "--proxy", url(proxy), "--metrics-port", "0",
            "--proxy-admin-token-file", str(token), "--interval", "0.5", "--duration", "180",
        ])  # fmt: skip
    finally:
        signal.signal(signal.SIGTERM, previous)
    watcher.join(timeout=5)
    assert code == 0
    assert server.scrapes >= 3  # the patching tick and two after it
    assert proxy.patches == [{"max_tokens_cap": CAP}]  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--proxy", "http://127.0.0.1:9"], "--proxy needs --proxy-admin-token-file"),
        (["--proxy-admin-token-file", "/dev/null"], "need --proxy URL"),
        (["--proxy", "ftp://proxy", "--proxy-admin-token-file", "/dev/null"], "--proxy: "),
    ],
)
def test_local_proxy_flags_are_checked(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["operator", "--local", "--target", "http://127.0.0.1:9", *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
