"""Rung 1 on vLLM through a kvtune proxy: the max_tokens cap goes to the proxy's admin API (live, no
restart), max_num_seqs still through the Deployment. In a cluster against kmock's Kubernetes API, and with
`kvtune operator --local --proxy`; the proxy is a local stand-in with the proxy's admin API shape, and the
engine a /metrics of recorded vLLM scrapes."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtune.cli import main
from kvtune.operator.k8s.reconcile import Outcome, PolicyMemory
from kvtune.operator.k8s.workload_actuator import read_flag
from tests.operator.helpers import (
    ASKING_LONG_CAP,
    ProxyServer,
    local_url,
    running,
    serve_bodies,
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
    ticks,
)

PROXY_TOKEN = "proxy-secret"


@pytest.fixture()
def proxy() -> Iterator[ProxyServer]:
    with running(ProxyServer(PROXY_TOKEN, None)) as server:
        yield server


@pytest.fixture()
def capped_proxy() -> Iterator[ProxyServer]:
    """A proxy that already holds the cap the ladder would set."""
    with running(ProxyServer(PROXY_TOKEN, ASKING_LONG_CAP)) as server:
        yield server


@pytest.fixture()
def vllm_url() -> Iterator[str]:
    """vLLM's /metrics: preempting, clients asking for up to 1,000 tokens while generating ~200."""
    yield from serve_bodies([vllm_asking_long("t0"), vllm_asking_long("t1")])


def behind_proxy(vllm: str, proxy: str) -> dict[str, Any]:
    target = {"name": "llama", "container": "vllm", "engine": "vllm", "proxyAdminUrl": proxy,
              "proxyAdminTokenSecretRef": {"name": "llama-admin", "key": "token"}}  # fmt: skip
    return fast_policy(target, metrics={"metricsUrl": vllm, "proxyMetricsUrl": proxy})


async def two_ticks(
    kube: OptimisticEmulator, spec: dict[str, Any], token: str | None = PROXY_TOKEN
) -> list[Outcome]:
    """The Deployment, the proxy's token in its Secret (unless None) and the policy `spec`: two of its ticks."""
    return await ticks(add_deployment_and_policy(kube, LLAMA_ARGS, spec, token), PolicyMemory(), 2)


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_the_cap_goes_to_the_proxy_and_the_deployment_is_not_restarted(
    kube: OptimisticEmulator, vllm_url: str, proxy: ProxyServer
) -> None:
    outcomes = await two_ticks(kube, behind_proxy(vllm_url, local_url(proxy)))
    assert proxy.patches == [{"max_tokens_cap": ASKING_LONG_CAP}]
    assert container_args(kube) == LLAMA_ARGS and not deployment_patches(kube)  # no restart
    status = policy_status(kube)
    applied = [h for h in status["history"] if h["kind"] == "applied"]
    assert [(h["knob"], h.get("before"), h["after"]) for h in applied] == [
        ("max_tokens_cap", None, ASKING_LONG_CAP)
    ]
    current = status["current"]
    assert (current["maxNumSeqs"], current["maxTokensCap"]) == (
        64,
        ASKING_LONG_CAP,
    )  # seats: the Deployment; cap: live
    assert status["desired"] == {"maxTokensCap": ASKING_LONG_CAP}
    messages = [e["message"] for e in our_events(kube) if e["reason"] == "TuningApplied"]
    assert len(messages) == 1 and f"max_tokens_cap: None -> {ASKING_LONG_CAP}" in messages[0]
    # the proxy's defeat series reached the diagnosis: the flag names the reasons
    diagnosis = outcomes[-1].tick.decision.diagnosis  # type: ignore[union-attr]
    assert dict(diagnosis.prefix_defeats) == {"varying_head": 30.0, "misaligned": 2.0}
    prefix = next(c for c in status["conditions"] if c["type"] == "PrefixCacheDefeated")
    assert (prefix["status"], prefix["reason"]) == ("True", "PrefixDefeatsReported")
    assert "varying_head: 30 prompts" in prefix["message"]


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_max_num_seqs_still_goes_through_the_deployment(
    kube: OptimisticEmulator, vllm_url: str, capped_proxy: ProxyServer
) -> None:
    await two_ticks(kube, behind_proxy(vllm_url, local_url(capped_proxy)))
    assert capped_proxy.patches == []  # already capped: nothing to send
    lowered = read_flag(container_args(kube), "--max-num-seqs")
    assert lowered is not None and 2 <= lowered < 64
    status = policy_status(kube)
    assert [h["knob"] for h in status["history"] if h["kind"] == "applied"] == ["max_num_seqs"]
    assert status["current"]["maxTokensCap"] == ASKING_LONG_CAP


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_a_missing_proxy_secret_leaves_the_cap_a_recommendation(
    kube: OptimisticEmulator, vllm_url: str, proxy: ProxyServer
) -> None:
    await two_ticks(
        kube, behind_proxy(vllm_url, local_url(proxy)), token=None
    )  # no Secret for the proxy's token
    assert proxy.patches == []
    reasons = [e["reason"] for e in our_events(kube)]
    assert reasons.count("ActuatorUnavailable") == 1
    status = policy_status(kube)
    # issue 37: a condition too, and the first thing in the way of Apply
    found = {c["type"]: (c["status"], c["reason"], c["message"]) for c in status["conditions"]}
    unavailable, ready = found["ActuatorUnavailable"], found["Ready"]
    assert unavailable[:2] == ("True", "SecretUnreadable") and "llama-admin" in unavailable[2]
    assert ready == ("False", "ActuatorUnavailable", unavailable[2])
    kinds = {(h["kind"], h["knob"]) for h in status["history"]}
    assert ("recommended", "max_tokens_cap") in kinds and ("applied", "max_num_seqs") in kinds
    assert read_flag(container_args(kube), "--max-num-seqs") != 64  # the Deployment's knob still moves


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_proxy_metrics_that_cannot_be_read_are_an_event_not_a_stop(
    kube: OptimisticEmulator, vllm_url: str, proxy: ProxyServer
) -> None:
    spec = behind_proxy(vllm_url, local_url(proxy))
    spec["metrics"]["proxyMetricsUrl"] = "http://127.0.0.1:9"  # nothing listens
    outcomes = await two_ticks(kube, spec)
    assert all(o.tick.no_data is None for o in outcomes)  # the engine's metrics carry the diagnosis
    missing = [e for e in our_events(kube) if e["reason"] == "ProxyMetricsMissing"]
    assert len(missing) == 1 and "127.0.0.1:9" in missing[0]["message"]  # once, on the transition
    assert proxy.patches == [{"max_tokens_cap": ASKING_LONG_CAP}]  # the cap still acts


def test_local_operator_sets_the_cap_through_the_proxy(
    vllm_url: str, proxy: ProxyServer, tmp_path: Path
) -> None:
    """The operator runs until the cap has been patched and two more ticks have scraped the proxy (so a
    second patch would have shown), then is stopped with SIGTERM as a user would: events, not a duration."""
    token = tmp_path / "proxy-token"
    token.write_text(PROXY_TOKEN + "\n")
    token.chmod(0o600)

    def stop_after_two_more_ticks() -> None:
        deadline = time.monotonic() + 120  # only a hang reaches it
        while not proxy.patches and time.monotonic() < deadline:
            time.sleep(0.05)
        patched_at = proxy.scrapes
        while proxy.scrapes < patched_at + 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    previous = signal.getsignal(signal.SIGTERM)
    watcher = threading.Thread(target=stop_after_two_more_ticks, daemon=True)
    watcher.start()
    try:
        code = main([
            "operator", "--local", "--target", vllm_url, "--proxy", local_url(proxy), "--metrics-port", "0",
            "--proxy-admin-token-file", str(token), "--interval", "0.5", "--duration", "180",
        ])  # fmt: skip
    finally:
        signal.signal(signal.SIGTERM, previous)
    watcher.join(timeout=5)
    assert code == 0
    assert proxy.scrapes >= 3  # the patching tick and two after it
    assert proxy.patches == [{"max_tokens_cap": ASKING_LONG_CAP}]


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
