"""The active operator replica killed with SIGKILL between its decision and its patch, two replicas peering
(issue 38): the patch it had in flight is caught at the API server (faults.py's webhook), the process is
killed there and the write refused, so it never lands. kopf's peering keeps the standby paused until the
dead replica's keep-alive expires (its lifetime: kopf's 60 s); it then resumes, says so (an
OperatorResumed Event: what it took over from status) and acts exactly once, on data it read itself.

The checks are test_faults.py's: nothing lost, applied once on data less than one interval old, the
operator says what happened, the takeover and the recovery recorded; the decision is the one the same two
replicas reach without the fault. The module has its own control plane: its operators are the fault."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator

import pytest

from kvtune.harness.local_http import free_port
from tests.e2e.chart_release import install
from tests.e2e.cluster import (
    Cluster,
    Operator,
    chart_operator,
    control_plane,
    kwok_node,
    wait_for,
    wait_until_peered,
)
from tests.e2e.faults import (
    START,
    Decision,
    Outage,
    PatchCatcher,
    Tuned,
    assert_applied_once_on_fresh_data,
    assert_nothing_lost,
    patch_catcher,
    replayed_engine,
)
from tests.e2e.replica_peering import resumed

NAMESPACE = "takeover"
RELEASE = "kvtune-takeover"
POOL = "takeover"
TAKEOVER_S = 150.0  # kopf's peering lifetime (60 s) and the standby's resume, with room
Record = Callable[[str, object], None]


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with control_plane(tmp_path_factory.mktemp("takeover-plane")) as started:
        install(started, RELEASE, NAMESPACE)
        kwok_node(started, "takeover-main", POOL)
        yield started


@pytest.fixture(scope="module")
def replicas(plane: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Operator]]:
    """Two of the release's pods, as processes: one ServiceAccount, one peering object."""
    folder = tmp_path_factory.mktemp("takeover-operators")
    started = [chart_operator(plane, RELEASE, f"{RELEASE}-system", folder / f"replica-{index}.log",
                              metrics_port=free_port()).start() for index in range(2)]  # fmt: skip
    try:
        for replica in started:
            wait_until_peered(plane, replica, NAMESPACE, replica.peering, count=2)
        wait_for("exactly one active replica", lambda: [resumed(r) for r in started].count(True) == 1)
        yield started
    finally:
        for index, replica in enumerate(started):
            replica.stop()
            print(f"--- replica {index} (the end of its log) ---\n{replica.output()[-3000:]}")


@pytest.fixture(scope="module")
def catcher(
    plane: Cluster, replicas: list[Operator], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PatchCatcher]:
    account = plane.get("deployment", RELEASE, f"{RELEASE}-system")["spec"]["template"]["spec"][
        "serviceAccountName"
    ]
    username = f"system:serviceaccount:{RELEASE}-system:{account}"
    with patch_catcher(plane, NAMESPACE, username, tmp_path_factory.mktemp("takeover-webhook")) as caught:
        yield caught


def active(replicas: list[Operator]) -> Operator:
    (found,) = [replica for replica in replicas if replica.running() and resumed(replica)]
    return found


def test_the_standby_takes_over_from_a_replica_killed_with_its_patch_in_flight(
    plane: Cluster, replicas: list[Operator], catcher: PatchCatcher, record_testsuite_property: Record,
) -> None:  # fmt: skip
    with replayed_engine() as quiet_engine:  # the baseline: the same two replicas, no fault
        calm = Tuned(plane, NAMESPACE, "no-fault", quiet_engine, POOL)
        calm.create_workload()
        calm.create_policy()
        baseline = Decision.of(calm.decided())
        assert (baseline.knob, baseline.before) == ("max_num_seqs", START) and baseline.after < START, (
            baseline
        )
        assert_applied_once_on_fresh_data(calm, catcher, baseline)
        calm.delete_policy()

    with replayed_engine() as engine:
        tuned = Tuned(plane, NAMESPACE, "killed-active", engine, POOL)
        tuned.create_workload()
        doomed = active(replicas)
        (standby,) = [replica for replica in replicas if replica is not doomed]
        assert doomed.process is not None
        pid = doomed.process.pid

        def kill() -> None:
            os.kill(pid, signal.SIGKILL)
            # the evidence the killed replica held (its samples: memory only) died with it; the standby
            # gathers its own, from the recording's start (its first read the first scrape)
            engine.reads = 0  # type: ignore[attr-defined]

        fired = catcher.arm(tuned.name, kill, admit=False)
        tuned.create_policy()
        wait_for("the active replica's patch in flight at the API server", fired.is_set)
        killed_at, outage = time.time(), Outage()
        assert doomed.process.wait(30) == -signal.SIGKILL
        wait_for("the standby to resume", lambda: resumed(standby), timeout=TAKEOVER_S)
        outage.end()
        (said,) = wait_for("the takeover told", lambda: tuned.events("OperatorResumed"))
        assert "resumed the policy from its status: history 0 entries" in said, said
        entry = tuned.decided()
        outage.record("the active replica killed (-9) with its patch in flight; the standby took over",
                      record_testsuite_property)  # fmt: skip
        assert entry["at"] >= killed_at, "the standby acted on a decision made before the kill"
        assert_nothing_lost(tuned, baseline)
        landed = assert_applied_once_on_fresh_data(tuned, catcher, baseline)
        assert (
            landed > killed_at and next(r.admitted for r in catcher.reviews if r.name == tuned.name) is False
        )
        plane.evaluations(NAMESPACE, tuned.name, 3)  # and it stays one action
        assert_nothing_lost(tuned, baseline)
        assert tuned.deployment()["metadata"]["generation"] == 2
        tuned.delete_policy()
