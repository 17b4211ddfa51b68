"""Two operator replicas (two processes, one ServiceAccount, one peering name) meet in the chart's KopfPeering
through the real API: exactly one evaluates and acts, the other stands by; when the active one stops, the
other takes over."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from kvtune.harness.local_http import free_port
from tests.e2e.chart_release import install, policy, workload
from tests.e2e.cluster import Cluster, Operator, chart_operator, kwok_node, peers, wait_for, wait_until_peered
from tests.e2e.replica_peering import resumed
from tests.operator.rbac_world import OLD_VLLM_IMAGE, VllmHandler, vllm_policy

NAMESPACE = "peering"
RELEASE = "kvtune-peer"


@pytest.fixture
def engine() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), VllmHandler)
    server.files = ["kvtune_preempting_t0.prom", "kvtune_preempting_t1.prom"]  # type: ignore[attr-defined]
    server.admin_tokens = []  # type: ignore[attr-defined]
    server.version = None  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def evaluated(replica: Operator) -> bool:
    """Whether this replica has evaluated the policy (its own /metrics has the policy's series)."""
    try:
        text = httpx.get(f"http://127.0.0.1:{replica.metrics_port}/metrics", timeout=5).text
    except httpx.HTTPError:
        return False
    return bool(re.search(r'kvtune_operator_last_evaluation_timestamp_seconds\{[^}]*policy="peer"', text))


def test_two_replicas_exactly_one_acts(cluster: Cluster, engine: str, tmp_path: Path) -> None:
    install(cluster, RELEASE, NAMESPACE)
    kwok_node(cluster, "peer-main", "peer")
    deployment = workload(
        "Deployment", "llama-vllm", NAMESPACE, OLD_VLLM_IMAGE, ["--model", "m", "--max-num-seqs=64"]
    )
    deployment["spec"]["template"]["spec"]["nodeSelector"] = {"kvtune-e2e/pool": "peer"}
    cluster.apply(deployment)
    replicas = [  # two of the release's pods, as processes
        chart_operator(cluster, RELEASE, f"{RELEASE}-system", tmp_path / f"replica-{i}.log",
                       metrics_port=free_port()).start()
        for i in range(2)
    ]  # fmt: skip
    try:
        for replica in replicas:
            wait_until_peered(cluster, replica, NAMESPACE, RELEASE, count=2)
        # kopf starts each replica paused; the one that sees no higher peer resumes (and one that resumed before
        # it saw the other pauses again): a policy made now meets one active replica
        wait_for("exactly one active replica", lambda: [resumed(r) for r in replicas].count(True) == 1)
        cluster.apply(policy("peer", NAMESPACE, vllm_policy("Deployment", "llama-vllm", engine)))
        wait_for("the policy's first action", lambda: [
            e for e in cluster.events(NAMESPACE, "peer") if e["reason"] == "TuningApplied"])  # fmt: skip
        cluster.evaluations(NAMESPACE, "peer", 3)
        acting = [replica for replica in replicas if evaluated(replica)]
        assert len(acting) == 1, [r.output()[-2000:] for r in replicas]
        assert cluster.get("deployment", "llama-vllm", NAMESPACE)["metadata"]["generation"] == 2  # one patch
        assert len([e for e in cluster.events(NAMESPACE, "peer") if e["reason"] == "TuningApplied"]) == 1
        assert len(peers(cluster, NAMESPACE, RELEASE)) == 2

        (active,) = acting
        (standby,) = [replica for replica in replicas if replica is not active]
        active.stop()  # it leaves the peering on its way out; the other resumes
        wait_for("the standby replica to take over", lambda: evaluated(standby), timeout=120)
        cluster.evaluations(NAMESPACE, "peer", 2)
    finally:
        for index, replica in enumerate(replicas):
            replica.stop()
            print(f"--- replica {index} (shown when the test fails) ---\n{replica.output()[-4000:]}")
