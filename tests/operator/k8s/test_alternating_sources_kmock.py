"""The cluster path of an alternating metrics source: a metricsUrl that answers from two engine processes in
turn (two pods behind one Service) makes a Warning Event and the SourceAlternating condition, and no patch
of the Deployment, while a status is still written every tick."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from kvtune.operator.decide.continuity import ALTERNATING_HINT
from kvtune.operator.k8s.crd import KVTuningPolicySpec
from kvtune.operator.k8s.events import PolicyRef
from kvtune.operator.k8s.kube_api import KubeApi
from kvtune.operator.k8s.reconcile import PolicyMemory, run_once
from tests.operator.helpers import fixture_text, reply
from tests.operator.kmock_world import (
    NS,
    POLICIES,
    OptimisticEmulator,
    add_deployment,
    add_policy,
    container_args,
    our_events,
    policy_spec,
    status_writes,
)

# Two pods' /metrics: a busy one long up, and one started later with fewer preemptions.
PODS = [
    fixture_text("kvtune_preempting_t1.prom") + "process_start_time_seconds 1700000000.0\n",
    fixture_text("kvtune_preempting_t0.prom") + "process_start_time_seconds 1700000500.0\n",
]


class Alternating(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        server: Any = self.server
        if self.path != "/metrics":
            reply(self, 404, "application/json", b'{"detail": "Not Found"}')
            return
        body = PODS[server.reads % 2]
        server.reads += 1
        reply(self, 200, "text/plain; version=0.0.4", body.encode())

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def service_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Alternating)
    server.reads = 0  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.mark.asyncio
@pytest.mark.kmock(cls=OptimisticEmulator)
@pytest.mark.timeout(60)
async def test_an_alternating_metrics_url_is_an_event_and_a_condition_and_no_patch(
    kube: OptimisticEmulator,
    service_url: str,
) -> None:
    add_deployment(kube, ["--max-num-seqs", "64"])
    spec = policy_spec(service_url, "Apply")
    add_policy(kube, spec)
    parsed = KVTuningPolicySpec.model_validate(spec)
    memory = PolicyMemory()

    def ticks() -> list[Any]:
        with KubeApi.from_environment() as api:
            return [run_once(api, PolicyRef(NS, "llama", "uid-llama"), parsed, memory, time.time() + i)
                    for i in range(6)]  # fmt: skip

    outcomes = await asyncio.to_thread(ticks)
    assert container_args(kube) == ["--max-num-seqs", "64"], "nothing is patched on flips between pods"
    assert not any(o.tick.applied for o in outcomes)
    assert len(status_writes(kube)) == 6
    alternating = [e for e in our_events(kube) if e["reason"] == "MetricsSourceAlternating"]
    assert len(alternating) == 1, "one Event when it starts, not one per flip"
    assert alternating[0]["type"] == "Warning" and ALTERNATING_HINT in alternating[0]["message"]
    status = kube.objects[POLICIES, NS, "llama"]["status"]
    (condition,) = [c for c in status["conditions"] if c["type"] == "SourceAlternating"]
    assert (condition["status"], condition["reason"]) == ("True", "AlternatingSource")
    assert ALTERNATING_HINT in condition["message"]
    assert ALTERNATING_HINT in status["note"]
    assert sum(1 for o in outcomes if o.evaluation.alternated) >= 4
