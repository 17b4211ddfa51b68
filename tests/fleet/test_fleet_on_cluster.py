"""The fleet harness on the real control plane: policies over Deployments of kwok pods whose addresses the
replay server answers, read by the operator as live engines: every pod of every policy read, a replayed
preempting vLLM diagnosed Preempting, a replayed quiet engine not, and the evaluation lag recorded."""

from __future__ import annotations

from pathlib import Path

import httpx

from kvtune.bench.fleet import EXAMPLES, VERSIONS
from kvtune.bench.fleet_cluster import RELEASE, SYSTEM, FleetShape, fleet_on_cluster
from kvtune.bench.fleet_figures import lag_buckets
from kvtune.bench.fleet_layout import PolicyPlan
from kvtune.harness.local_http import free_port
from tests.e2e import cluster as e2e
from tests.e2e import pod_network

RECORDINGS = ("vllm-0.32-cpu-preempting", "kvtune-engine-preempting", "kvtune-engine-quiet")
SLOW_WAIT_S = 300.0  # the first evaluations of a fresh operator over a fresh fleet: a hang deadline


def test_the_operator_reads_every_replayed_pod_as_a_live_engine(tmp_path: Path) -> None:
    recordings = {name: EXAMPLES / f"{name}.prom" for name in RECORDINGS}
    shape = FleetShape(policies=3, pods_per_policy=2, policies_per_namespace=2, interval_s=1,
                       recordings=recordings, versions=VERSIONS)  # fmt: skip
    with fleet_on_cluster(e2e, pod_network, tmp_path, shape) as world:
        assert len(world.fleet.namespaces) == 2 and world.fleet.pods == 6
        port = free_port()
        operator = e2e.chart_operator(world.cluster, RELEASE, SYSTEM, tmp_path / "operator.log",
                                      metrics_port=port).start()  # fmt: skip
        try:
            for plan in world.fleet.policies:
                expected = "True" if plan.recording.endswith("preempting") else "False"

                def diagnosed(plan: PolicyPlan = plan, expected: str = expected) -> bool:
                    status = world.cluster.policy(plan.namespace, plan.name).get("status") or {}
                    preempting = next(
                        (c for c in status.get("conditions", []) if c["type"] == "Preempting"), {}
                    )
                    return len(status.get("pods") or []) == 2 and preempting.get("status") == expected

                e2e.wait_for(f"{plan.name} ({plan.recording}) read from both pods, Preempting {expected}",
                             diagnosed, timeout=SLOW_WAIT_S)  # fmt: skip
            lag = lag_buckets(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text)
            assert lag[float("inf")] > 0, "no evaluation lag recorded"
        finally:
            operator.stop()
