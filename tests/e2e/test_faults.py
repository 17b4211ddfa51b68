"""Faults on the real control plane while the operator acts (issue 38): the operator (the chart's args, its
ServiceAccount) runs a policy in Apply over a vLLM-shaped Deployment whose engine replays recorded scrapes of
a preempting kvtune engine. The control-plane faults (kube-apiserver, etcd) land exactly when its patch of
the Deployment is in flight (an admission webhook catches it at the API server, faults.py); the partition
right after its first scrape; Prometheus (the policy reading through it) after its first read there. For each fault the test checks:
- nothing is lost: status.original, the history, the tuner state and the value it holds are the one
  action, as without the fault;
- no change is applied twice (one new generation, one TuningApplied), and none on data older than one
  interval (the patch that landed was decided on a scrape less than one interval old, after the fault);
- the operator says what happened: the failed patch is an ApplyFailed Event, told once the API is back;
  the partition a NoMetrics Event and Ready False;
- the outage and the recovery (its end to the action), printed and recorded (record_testsuite_property).
And after each, the policy reaches the decision the same policy reaches without the fault (the baseline).

The module has its own control plane, so stopping its parts never disturbs the one the other e2e tests share."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest

from kvtune.harness.local_http import free_port
from tests.e2e.chart_release import install
from tests.e2e.cluster import (
    CHART,
    Cluster,
    Operator,
    chart_operator,
    control_plane,
    kwok_node,
    local_cluster,
    wait_for,
    wait_until_peered,
)
from tests.e2e.faults import (
    INTERVAL_S,
    START,
    Decision,
    LocalPrometheus,
    Outage,
    PatchCatcher,
    Tuned,
    assert_applied_once_on_fresh_data,
    assert_nothing_lost,
    compacted,
    etcd_url,
    move_and_compact,
    operator_said,
    patch_catcher,
    policies_version,
    replayed_engine,
    stored_after,
    watch_expired,
)
from tests.e2e.pod_network import PodNetwork, ip

NAMESPACE = "faults"
RELEASE = "kvtune-faults"
POOL = "faults"
# its address in the run's pod network (the shared engines have 2 to 4, test_rbac's pods 5 and 6)
PARTITIONED_POD = 7
Record = Callable[[str, object], None]


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A control plane of this module's own: its etcd and API server are the ones the faults stop."""
    with control_plane(tmp_path_factory.mktemp("faults-plane")) as started:
        install(started, RELEASE, NAMESPACE)
        kwok_node(started, "faults-main", POOL)
        yield started


@pytest.fixture(scope="module")
def operator(plane: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Operator]:
    running = chart_operator(plane, RELEASE, f"{RELEASE}-system",
                             tmp_path_factory.mktemp("faults-operator") / "operator.log",
                             metrics_port=free_port()).start()  # fmt: skip
    wait_until_peered(plane, running, NAMESPACE, running.peering)
    yield running
    running.stop()
    print(f"--- the operator's log (the end) ---\n{running.output()[-4000:]}")


@pytest.fixture(scope="module")
def catcher(
    plane: Cluster, operator: Operator, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PatchCatcher]:
    account = plane.get("deployment", RELEASE, f"{RELEASE}-system")["spec"]["template"]["spec"][
        "serviceAccountName"
    ]
    username = f"system:serviceaccount:{RELEASE}-system:{account}"
    with patch_catcher(plane, NAMESPACE, username, tmp_path_factory.mktemp("faults-webhook")) as caught:
        yield caught


@pytest.fixture
def engine() -> Iterator[ThreadingHTTPServer]:
    with replayed_engine() as server:
        yield server


@pytest.fixture
def tuned_here(plane: Cluster) -> Iterator[list[Tuned]]:
    """The policies a test makes, deleted after it."""
    made: list[Tuned] = []
    yield made
    for tuned in made:
        tuned.delete_policy()


@pytest.fixture(scope="module")
def baseline(plane: Cluster, operator: Operator, catcher: PatchCatcher) -> Iterator[Decision]:
    """The decision the same policy over the same replayed engine reaches with no fault."""
    with replayed_engine() as server:
        tuned = Tuned(plane, NAMESPACE, "no-fault", server, POOL)
        tuned.create_workload()
        began = time.monotonic()
        tuned.create_policy()
        decision = Decision.of(tuned.decided())
        print(f"no fault: decided in {time.monotonic() - began:.1f} s: {decision}")
        assert (decision.knob, decision.before) == ("max_num_seqs", START), decision
        assert decision.after < START, decision
        assert_nothing_lost(tuned, decision)
        assert_applied_once_on_fresh_data(tuned, catcher, decision)
        yield decision
        tuned.delete_policy()


def patch_in_flight_fault(
    plane: Cluster, operator: Operator, catcher: PatchCatcher, tuned: Tuned, component: str
) -> tuple[float, Outage]:
    """SIGKILL `component` when the operator's patch of `tuned`'s workload reaches the API server, wait for
    the operator to meet the failure, start the component again with its flags and data; (the fault's time,
    the outage)."""
    lc = local_cluster()
    fired = catcher.arm(tuned.name, lambda: lc.stop_component(plane.folder, component, kill=True))
    mark = len(operator.output())
    tuned.create_policy()
    wait_for(f"the operator's patch of {tuned.name} in flight at the API server", fired.is_set)
    fault_at, outage = time.time(), Outage()
    wait_for(f"the operator to meet the {component} it lost",
             lambda: operator_said(operator.output, "could not apply max_num_seqs", mark))  # fmt: skip
    lc.start_component(plane.folder, component)
    outage.end()
    return fault_at, outage


def check_recovered(tuned: Tuned, catcher: PatchCatcher, baseline: Decision, fault_at: float) -> None:
    """The four checks once the action landed (see the module's docstring)."""
    entry = tuned.decided()
    assert entry["at"] >= fault_at, "the action was decided before the fault and carried over"
    told = f"max_num_seqs {START} -> {baseline.after}: deployment {tuned.namespace}/{tuned.name}: "
    wait_for(
        "the failed patch told as an Event", lambda: [m for m in tuned.events("ApplyFailed") if told in m]
    )
    assert_nothing_lost(tuned, baseline)
    assert_applied_once_on_fresh_data(tuned, catcher, baseline)
    tuned.cluster.evaluations(tuned.namespace, tuned.name, 3)  # and it stays one action
    assert_nothing_lost(tuned, baseline)
    assert tuned.deployment()["metadata"]["generation"] == 2


def test_kube_apiserver_killed_with_a_patch_in_flight(
    plane: Cluster, operator: Operator, catcher: PatchCatcher, baseline: Decision, engine: ThreadingHTTPServer,
    record_testsuite_property: Record, tuned_here: list[Tuned],
) -> None:  # fmt: skip
    tuned = Tuned(plane, NAMESPACE, "apiserver-killed", engine, POOL)
    tuned_here.append(tuned)
    tuned.create_workload()
    fault_at, outage = patch_in_flight_fault(plane, operator, catcher, tuned, "kube-apiserver")
    tuned.decided()
    outage.record("kube-apiserver killed, patch in flight", record_testsuite_property)
    check_recovered(tuned, catcher, baseline, fault_at)


def test_watches_expired_by_etcd_compaction_with_a_patch_in_flight(
    plane: Cluster, operator: Operator, catcher: PatchCatcher, baseline: Decision, engine: ThreadingHTTPServer,
    record_testsuite_property: Record, tuned_here: list[Tuned],
) -> None:  # fmt: skip
    """etcd's revision moved and compacted past every revision the watches started from, then the API server
    lost with the operator's patch in flight: a watch resuming from before is answered 410 Gone, so the
    operator's watches list again; it acts as without the fault and follows a spec edit made after it."""
    tuned = Tuned(plane, NAMESPACE, "watch-expired", engine, POOL)
    tuned_here.append(tuned)
    tuned.create_workload()
    url = etcd_url(plane)
    resumed_from = policies_version(plane, NAMESPACE)
    before, after = move_and_compact(url, writes=200)
    refused = compacted(url, before)
    assert refused is not None and "compacted" in refused, (before, after, refused)
    fault_at, outage = patch_in_flight_fault(plane, operator, catcher, tuned, "kube-apiserver")
    tuned.decided()
    outage.record("watches expired (410) by etcd compaction, patch in flight", record_testsuite_property)
    expired = wait_for(f"a watch resuming from {resumed_from} to be answered 410 Gone",
                       lambda: watch_expired(plane, NAMESPACE, resumed_from))  # fmt: skip
    assert "too old resource version" in expired, expired
    check_recovered(tuned, catcher, baseline, fault_at)
    plane.kubectl("patch", "kvtp", tuned.name, "-n", NAMESPACE, "--type", "merge",
                  "-p", '{"spec": {"cooldownSeconds": 7}}')  # fmt: skip
    wait_for("the operator to follow a spec edit made after the 410", lambda: (
        tuned.status().get("timing") or {}).get("cooldownSeconds") == 7)  # fmt: skip
    assert tuned.deployment()["metadata"]["generation"] == 2


def test_a_partition_between_the_operator_and_the_pods_then_healed(
    plane: Cluster, operator: Operator, catcher: PatchCatcher, baseline: Decision, pods: PodNetwork,
    record_testsuite_property: Record, tuned_here: list[Tuned],
) -> None:  # fmt: skip
    """The pods' network cut off from the operator (the pod network's link on this machine down) right after
    its first scrape, so before it can decide; healed once the operator says it has no data. Then it decides
    as without the partition, on data read after it."""
    partitioned: list[Outage] = []

    def cut_after_first_read(count: int) -> None:
        if count == 1:
            ip("link", "set", pods.host_link, "down")
            partitioned.append(Outage())

    with replayed_engine(pods.address(PARTITIONED_POD), pods.run, cut_after_first_read) as engine:
        tuned = Tuned(plane, NAMESPACE, "partitioned", engine, POOL)
        tuned_here.append(tuned)
        tuned.create_workload()
        tuned.create_policy()
        try:
            (outage,) = wait_for("the pod network cut off after the first scrape", lambda: partitioned)
            (said,) = wait_for("the operator to say it has no data", lambda: tuned.events("NoMetrics"))
            ready = wait_for("Ready False for the missing metrics", lambda: (
                c := plane.condition(NAMESPACE, tuned.name, "Ready")) and c["status"] == "False" and c)  # fmt: skip
            assert ready["reason"] == "NoMetrics" and "unreachable" in said, (ready, said)
            assert not tuned.applied() and tuned.deployment()["metadata"]["generation"] == 1
        finally:
            ip("link", "set", pods.host_link, "up")
        healed_at = time.time()
        outage.end()
        entry = tuned.decided()
        outage.record("pod network partitioned, then healed", record_testsuite_property)
        assert entry["at"] >= healed_at - INTERVAL_S, "decided on data from before the partition"
        assert_nothing_lost(tuned, baseline)
        assert_applied_once_on_fresh_data(tuned, catcher, baseline)
        wait_for(
            "Ready again",
            lambda: (c := plane.condition(NAMESPACE, tuned.name, "Ready")) and c["status"] == "True",
        )
        assert tuned.deployment()["metadata"]["generation"] == 2


def test_etcd_killed_with_a_patch_in_flight(
    plane: Cluster, operator: Operator, catcher: PatchCatcher, baseline: Decision, engine: ThreadingHTTPServer,
    record_testsuite_property: Record, tuned_here: list[Tuned],
) -> None:  # fmt: skip
    """etcd SIGKILLed when the operator's patch reaches the API server: the API server holds the write for
    etcd, so without a deadline it would be stored once etcd is back, long after the data it was decided
    on. The patch carries its deadline (one interval after the data was read): the API server gives it up,
    the operator says it was not applied and why, and decides again on data read after etcd is back."""
    tuned = Tuned(plane, NAMESPACE, "etcd-killed", engine, POOL)
    tuned_here.append(tuned)
    tuned.create_workload()
    lc = local_cluster()
    decided_on: list[float] = []

    def kill_etcd() -> None:
        decided_on.append(tuned.engine.read_times[-1])  # type: ignore[attr-defined]  # the data it stands on
        lc.stop_component(plane.folder, "etcd", kill=True)

    fired = catcher.arm(tuned.name, kill_etcd)
    tuned.create_policy()
    wait_for(f"the operator's patch of {tuned.name} in flight at the API server", fired.is_set)
    fault_at, outage = time.time(), Outage()
    # etcd back as soon as that data is older than one interval: a patch still held by the API server then
    # would be stored late (and the operator, never told, would not patch again)
    wait_for("the data the patch stands on to be older than one interval",
             lambda: time.time() > decided_on[0] + INTERVAL_S, every=0.05)  # fmt: skip
    lc.start_component(plane.folder, "etcd")
    outage.end()
    back_at = time.time()
    tuned.decided()
    outage.record("etcd killed, patch in flight", record_testsuite_property)
    check_recovered(tuned, catcher, baseline, fault_at)
    stored_after(tuned, catcher, back_at)
    (failed,) = [m for m in tuned.events("ApplyFailed") if f"deployment {NAMESPACE}/{tuned.name}" in m]
    # Two ways the API server gives the patch up, by where the kill lands: it holds the write until the
    # patch's deadline (the operator then says it was not applied), or its stream to etcd breaks mid-request
    # and it answers 500 Unavailable at once (the operator passes that on). Either way nothing was stored late
    # and the next evaluation decided again: check_recovered and stored_after hold for both.
    held = "not applied; the next evaluation decides again" in failed
    cut = "HTTP 500" in failed and "Unavailable" in failed
    assert held or cut, failed


def test_prometheus_down_then_back(
    plane: Cluster, operator: Operator, catcher: PatchCatcher, baseline: Decision,
    record_testsuite_property: Record, tuned_here: list[Tuned], tmp_path: Path,
) -> None:  # fmt: skip
    """The policy reads its engine through a real Prometheus (spec.metrics.prometheus). Prometheus is killed
    after the operator's first read through it, before there is evidence to act on: the operator says it has
    no data (a NoMetrics Event, Ready False) and does nothing; once Prometheus is back (its TSDB kept) it
    decides as without the fault, on data Prometheus scraped after it came back."""
    with replayed_engine() as engine:
        engine.files = ["kvtune_preempting_t0.prom"]  # type: ignore[attr-defined]  # quiet until released
        host, port = engine.server_address[:2]
        prometheus = LocalPrometheus(tmp_path, f"{host!s}:{port}", "faults-prometheus").start()
        try:
            wait_for("Prometheus to scrape the engine", prometheus.scraped)
            tuned = Tuned(plane, NAMESPACE, "prometheus-down", engine, POOL)
            tuned_here.append(tuned)
            tuned.create_workload()
            tuned.create_policy(
                {"prometheus": {"url": prometheus.url, "selector": '{job="faults-prometheus"}'}}
            )
            wait_for("the operator's first read through Prometheus",
                     lambda: (tuned.status().get("current") or {}).get("maxNumSeqs") == START)  # fmt: skip
            prometheus.kill()
            outage = Outage()
            engine.files = ["kvtune_preempting_t0.prom", "kvtune_preempting_t1.prom"]  # type: ignore[attr-defined]
            (said,) = wait_for("the operator to say it has no data", lambda: tuned.events("NoMetrics"))
            ready = wait_for("Ready False for the missing metrics", lambda: (
                c := plane.condition(NAMESPACE, tuned.name, "Ready")) and c["status"] == "False" and c)  # fmt: skip
            assert ready["reason"] == "NoMetrics" and "unreachable" in said, (
                ready,
                said,
            )
            assert not tuned.applied() and tuned.deployment()["metadata"]["generation"] == 1
            prometheus.start()
            back_at = time.time()
            outage.end()
            entry = tuned.decided()
            outage.record("Prometheus killed, then back", record_testsuite_property)
            assert entry["at"] >= back_at - INTERVAL_S, "decided on data from before Prometheus was back"
            assert_nothing_lost(tuned, baseline)
            assert_applied_once_on_fresh_data(tuned, catcher, baseline)
            wait_for("Ready again", lambda: (
                c := plane.condition(NAMESPACE, tuned.name, "Ready")) and c["status"] == "True")  # fmt: skip
            assert tuned.deployment()["metadata"]["generation"] == 2
        finally:
            prometheus.stop()


def test_helm_upgrade_with_a_policy_in_flight(
    plane: Cluster, operator: Operator, catcher: PatchCatcher, baseline: Decision, engine: ThreadingHTTPServer,
    record_testsuite_property: Record, tuned_here: list[Tuned], tmp_path: Path,
) -> None:  # fmt: skip
    """`helm upgrade` of the release while the operator's patch is in flight: the upgraded Deployment replaces
    the operator's pod, so the old process is stopped as the kubelet stops it (SIGTERM) and a new one starts
    from the upgraded Deployment's args. The action lands once and is kept; the new one resumes from status
    and does not act again. (It runs last: the module's operator is the one it replaces.)"""
    tuned = Tuned(plane, NAMESPACE, "upgraded", engine, POOL)
    tuned_here.append(tuned)
    tuned.create_workload()
    upgraded = threading.Event()

    def upgrade() -> None:
        plane.helm("upgrade", RELEASE, str(CHART), "--namespace", f"{RELEASE}-system", "--reuse-values",
                   "--set", "podAnnotations.kvtune-e2e/upgraded=yes")  # fmt: skip
        assert operator.process is not None
        operator.process.send_signal(signal.SIGTERM)  # the kubelet stopping the replaced pod
        upgraded.set()

    fired = catcher.arm(tuned.name, lambda: threading.Thread(target=upgrade, daemon=True).start())
    tuned.create_policy()
    wait_for("the operator's patch in flight at the API server", fired.is_set)
    outage = Outage()
    wait_for("helm upgrade done and the old operator stopping", upgraded.is_set, timeout=180)
    assert operator.process is not None and operator.process.wait(60) == 0, operator.output()[-3000:]
    annotations = plane.get("deployment", RELEASE, f"{RELEASE}-system")["spec"]["template"]["metadata"]
    assert annotations.get("annotations", {}).get("kvtune-e2e/upgraded") == "yes", annotations
    replaced = chart_operator(plane, RELEASE, f"{RELEASE}-system", tmp_path / "upgraded.log").start()
    try:
        wait_until_peered(plane, replaced, NAMESPACE, replaced.peering)
        outage.end()
        told = wait_for("the action told", lambda: tuned.events("TuningApplied"))
        assert f"max_num_seqs: {START} -> {baseline.after}" in told[0], told
        wait_for("its rollout told", lambda: tuned.events("RolloutComplete"))
        plane.evaluations(NAMESPACE, tuned.name, 3)  # evaluated by the new operator
        outage.record(
            "helm upgrade, the operator replaced with its patch in flight", record_testsuite_property
        )
        assert_nothing_lost(tuned, baseline)
        assert_applied_once_on_fresh_data(tuned, catcher, baseline)
    finally:
        replaced.stop()
        print(f"--- the upgraded operator's log (the end) ---\n{replaced.output()[-3000:]}")
