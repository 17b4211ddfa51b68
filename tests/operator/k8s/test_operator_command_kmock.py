"""`kvtune operator` as the chart runs it (`--namespace NS --peering NAME --liveness-port P --metrics-port Q`),
a real subprocess against kmock through $KUBECONFIG: kopf's /healthz answers 200 for the probes, the
operator's own /metrics shows it evaluating a policy, SIGTERM stops it cleanly, and every API call it made is
one the chart's Role grants (the command line's real settings, not a test's)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from kvtune.harness.local_http import free_port
from kvtune.harness.server import cli_argv
from tests.chart.helm import by_kind, render
from tests.operator.api_calls import api_calls
from tests.operator.kmock_world import (
    LLAMA_ARGS,
    NS,
    OptimisticEmulator,
    add_deployment_and_policy,
    policy_spec,
)
from tests.operator.rbac_world import add_peering, granting, rule_grants

REPO = Path(__file__).resolve().parents[3]
PEERING = "kvtune"  # what add_peering creates


async def get(url: str) -> httpx.Response | None:
    try:
        async with httpx.AsyncClient(timeout=2) as client:
            return await client.get(url)
    except httpx.HTTPError:
        return None  # not listening yet


async def wait_for(
    url: str, contains: str, seconds: float, operator: subprocess.Popen[bytes]
) -> httpx.Response:
    """Poll `url` (while kmock, in this event loop, keeps serving) until it answers 200 with `contains`."""
    deadline = time.monotonic() + seconds
    answer = None
    while time.monotonic() < deadline:
        assert operator.poll() is None, f"the operator exited with {operator.returncode}"
        answer = await get(url)
        if answer is not None and answer.status_code == 200 and contains in answer.text:
            return answer
        await asyncio.sleep(0.3)
    raise AssertionError(f"{url} did not answer 200 with {contains!r} within {seconds:.0f} s: {answer}")


@pytest.mark.asyncio
@pytest.mark.timeout(300)
async def test_the_command_line_operator_is_healthy_serves_its_metrics_and_stops_on_sigterm(
    kube: OptimisticEmulator,
    metrics_url: str,
    tmp_path: Path,
) -> None:
    add_peering(kube, clusterwide=False)
    add_deployment_and_policy(kube, LLAMA_ARGS, policy_spec(metrics_url, "Recommend"))
    health, metrics = free_port(), free_port()
    command = cli_argv("operator", "--namespace", NS, "--peering", PEERING,
                             "--liveness-port", str(health), "--metrics-port", str(metrics))  # fmt: skip
    environment = {**os.environ, "PYTHONPATH": str(REPO)}  # KUBECONFIG: the kube fixture's, pointing at kmock
    log = tmp_path / "operator.log"
    with log.open("wb") as out:
        operator = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=environment, cwd=REPO)
    try:
        # hang deadlines: the whole test takes ~10 s here, ~16 s with both cores loaded
        await wait_for(f"http://127.0.0.1:{health}/healthz", "", 120, operator)
        evaluated = f'kvtune_operator_last_evaluation_timestamp_seconds{{namespace="{NS}",policy="llama"}}'
        scrape = await wait_for(f"http://127.0.0.1:{metrics}/metrics", evaluated, 120, operator)
        assert scrape.headers["content-type"].startswith("text/plain")
        operator.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(operator.wait, 20)
    finally:
        if operator.poll() is None:
            operator.kill()
            operator.wait()
    output = log.read_text()
    assert code == 0, output[-3000:]
    assert "Traceback" not in output, output[-3000:]

    calls = api_calls(list(kube))
    objects = render({"watchNamespaces": [NS]}, tmp_path)
    (role,) = by_kind(objects, "Role")
    grants = rule_grants(role)
    assert calls and not [call for call in calls if not granting(call, grants, NS)], sorted(calls)
