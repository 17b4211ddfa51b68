"""The cluster path of an alternating metrics source: a metricsUrl that answers from two engine processes in
turn (two pods behind one Service) makes a Warning Event and the SourceAlternating condition, and no patch
of the Deployment, while a status is still written every tick."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from kvtune.operator.decide.continuity import ALTERNATING_HINT
from kvtune.operator.decide.loop import step, window_length
from kvtune.operator.decide.sample import Sample
from kvtune.operator.decide.tuner import TunerState
from kvtune.operator.io.actuators import KvtuneAdminActuator
from kvtune.operator.io.local_metrics import LocalRecorder
from kvtune.operator.io.own_metrics import OperatorMetrics
from kvtune.operator.io.sources import MetricsEndpoint
from kvtune.operator.k8s.crd import KVTuningPolicySpec
from kvtune.operator.k8s.events import FINDING_EVENTS, finding_events
from kvtune.operator.k8s.reconcile import PolicyMemory
from tests.operator.helpers import QuietHandler, fixture_text, local_url, reply, serving
from tests.operator.kmock_world import (
    OptimisticEmulator,
    add_deployment,
    add_deployment_and_policy,
    add_policy,
    container_args,
    our_events,
    policy_spec,
    policy_status,
    status_writes,
    ticks,
)

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]

# Two pods' /metrics: a busy one long up, and one started later with fewer preemptions.
PODS = [
    fixture_text("kvtune_preempting_t1.prom") + "process_start_time_seconds 1700000000.0\n",
    fixture_text("kvtune_preempting_t0.prom") + "process_start_time_seconds 1700000500.0\n",
]


class Alternating(QuietHandler):
    def do_GET(self) -> None:
        server: Any = self.server
        if self.path != "/metrics":
            reply(self, 404, "application/json", b'{"detail": "Not Found"}')
            return
        body = PODS[server.reads % 2]
        server.reads += 1
        reply(self, 200, "text/plain; version=0.0.4", body.encode())


@contextmanager
def alternating_server() -> Iterator[str]:
    with serving(Alternating, reads=0) as server:
        yield local_url(server)


@pytest.fixture
def service_url() -> Iterator[str]:
    with alternating_server() as url:
        yield url


async def test_an_alternating_metrics_url_is_an_event_and_a_condition_and_no_patch(
    kube: OptimisticEmulator,
    service_url: str,
) -> None:
    spec = add_deployment_and_policy(kube, ["--max-num-seqs", "64"], policy_spec(service_url, "Apply"))
    outcomes = await ticks(spec, PolicyMemory(), 6, start=time.time())
    assert container_args(kube) == ["--max-num-seqs", "64"], "nothing is patched on flips between pods"
    assert not any(o.tick.applied for o in outcomes)
    assert len(status_writes(kube)) == 6
    alternating = [e for e in our_events(kube) if e["reason"] == "MetricsSourceAlternating"]
    assert len(alternating) == 1, "one Event when it starts, not one per flip"
    assert alternating[0]["type"] == "Warning" and ALTERNATING_HINT in alternating[0]["message"]
    status = policy_status(kube)
    (condition,) = [c for c in status["conditions"] if c["type"] == "SourceAlternating"]
    assert (condition["status"], condition["reason"]) == ("True", "AlternatingSource")
    assert ALTERNATING_HINT in condition["message"]
    assert ALTERNATING_HINT in status["note"]
    assert sum(1 for o in outcomes if o.evaluation.alternated) >= 4


async def test_the_cluster_and_local_report_the_same_findings(
    kube: OptimisticEmulator, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 39: one recorded sequence (two pods answering in turn) through the cluster path (its Events)
    and through --local (its log): the same findings, in the same words, each told once."""
    add_deployment(kube, ["--max-num-seqs", "64"])
    start = time.time()
    with alternating_server() as url:
        spec = policy_spec(url, "Apply")
        add_policy(kube, spec)
        await ticks(spec, PolicyMemory(), 6, start=start)
    reasons = {p.reason for p in FINDING_EVENTS.values()} | {
        p.ended[1] for p in FINDING_EVENTS.values() if p.ended
    }
    posted = [(e["reason"], e["message"]) for e in our_events(kube) if e["reason"] in reasons]
    caplog.set_level(logging.INFO, logger="kvtune.operator")
    with alternating_server() as url:
        parsed = KVTuningPolicySpec.model_validate(spec)
        policy = parsed.to_policy()
        recorder = LocalRecorder(OperatorMetrics(), url, policy)
        actuator = KvtuneAdminActuator(url, "unused")
        state, samples, found = (
            TunerState(),
            deque[Sample](maxlen=window_length(policy, float(parsed.interval_seconds))),
            [],
        )
        for i in range(6):
            tick = step(MetricsEndpoint(url), actuator, policy, state, samples, start + i)
            found += recorder(tick)
            state = tick.state
    local = [(e.reason, e.message) for e in finding_events(found)]
    assert posted and posted == local
    logged = [r.getMessage() for r in caplog.records if r.name == "kvtune.operator"]
    assert all(logged.count(message) == 1 for _, message in posted), logged
