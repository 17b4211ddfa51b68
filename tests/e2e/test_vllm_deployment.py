"""A vLLM Deployment of 3 replicas tuned for real. Its Service's EndpointSlices point at 3 real engines in
the run's pod network under a load that preempts; the operator (a process, as the chart's ServiceAccount) pools the
pods and patches the admission flag once:
- the other container, the other args and every field the API server defaulted are unchanged;
- kube-controller-manager rolls out a new ReplicaSet, and the patch is the audit trail: field manager
  `kvtune`, a `kubernetes.io/change-cause` with the evidence, in `kubectl rollout history`;
- while the rollout is held half done (the node its new pods need is full, the others cordoned) the
  operator waits ("waiting for rollout") and neither judges nor patches again, then carries on once it
  completes; a rollout past its progress deadline is a RolloutStalled condition and Event;
- a concurrent writer makes the patch meet a real resourceVersion conflict, which is retried;
- a GitOps tool (server-side apply, another field manager) puts the old args back: the operator names it,
  re-applies a bounded number of times, then stops and keeps its value as a recommendation.

The tests of this module run in order: the later ones continue from the Deployment the first one tuned."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import yaml
from kubernetes import client, config

from kvtune.harness.server import ServerProcess
from kvtune.operator.k8s.kube_api import KubeApi
from kvtune.operator.k8s.workload_actuator import (
    CHANGE_CAUSE,
    CONFLICT_RETRIES,
    WorkloadArgsActuator,
    read_flag,
)
from kvtune.operator.k8s.workload_watch import REVERTS_TOLERATED
from tests.e2e.cluster import Cluster, Operator, cordon, kwok_node, wait_for
from tests.e2e.workloads import (
    VLLM_ARGS,
    args_owner_managers,
    container,
    endpoint_slice,
    engine_port,
    pods_policy,
    preempting_load,
    service,
    vllm_deployment,
)

NAME = "llama-vllm"
SERVICE = "llama-vllm-engine"
POOL = "llama-vllm"
ACTIVE = "--max-num-active-seqs"
GITOPS_MANAGER = "argocd-controller"


@pytest.fixture(scope="module")
def world(
    cluster: Cluster, acting_release: dict[str, str], operator: Operator, engines: list[ServerProcess]
) -> Iterator[dict[str, Any]]:
    """The watched namespace with the engines' Service and EndpointSlice, under a preempting load."""
    namespace = acting_release["watch"]
    port = engine_port(engines)
    pods = {f"{NAME}-pod-{i}": engine.url.split("//")[1].split(":")[0] for i, engine in enumerate(engines)}
    cluster.apply(service(namespace, SERVICE, port), endpoint_slice(namespace, SERVICE, port, pods))
    with preempting_load(engines):
        yield {"namespace": namespace, "port": port, "operator": operator}
    for policy in ("llama-vllm", "llama-stall"):
        cluster.kubectl("delete", "kvtp", policy, "-n", namespace, "--ignore-not-found", "--wait=true")


def deployment(cluster: Cluster, namespace: str, name: str = NAME) -> dict[str, Any]:
    return cluster.get("deployment", name, namespace)


def replica_sets(cluster: Cluster, namespace: str, name: str) -> list[dict[str, Any]]:
    found = json.loads(
        cluster.kubectl("get", "rs", "-n", namespace, "-l", f"app={name}", "-o", "json").stdout
    )
    return sorted(
        found["items"], key=lambda rs: int(rs["metadata"]["annotations"]["deployment.kubernetes.io/revision"])
    )


def rolled_out(cluster: Cluster, namespace: str, name: str) -> None:
    cluster.kubectl("rollout", "status", f"deployment/{name}", "-n", namespace, "--timeout", "90s")


def events(cluster: Cluster, namespace: str, policy: str, reason: str) -> list[str]:
    return [e["message"] for e in cluster.events(namespace, policy) if e["reason"] == reason]


def without_args(template: dict[str, Any]) -> dict[str, Any]:
    stripped = copy.deepcopy(template)
    for each in stripped["spec"]["containers"]:
        if each["name"] == "vllm":
            each.pop("args")
    return stripped


def test_the_operator_patches_the_admission_flag_once_and_waits_for_its_rollout(
    cluster: Cluster, world: dict[str, Any]
) -> None:
    namespace = world["namespace"]
    kwok_node(cluster, "vllm-main", POOL)
    cluster.apply(vllm_deployment(NAME, namespace, POOL))
    rolled_out(cluster, namespace, NAME)
    before = deployment(cluster, namespace)
    # hold the next rollout half done: the old pods' node takes no new pod, a spare node takes one
    cordon(cluster, "vllm-main")
    kwok_node(cluster, "vllm-spare", POOL, pods=1)

    cluster.apply(pods_policy(NAME, namespace, NAME, SERVICE, world["port"]))
    patched = wait_for(
        "the operator's patch",
        lambda: (d := deployment(cluster, namespace))["metadata"]["generation"] > 1 and d,
    )

    # one patch: the admission flag lowered; everything else as it was, defaulted fields included
    old_args = container(before, "vllm")["args"]
    new_args = container(patched, "vllm")["args"]
    lowered = read_flag(new_args, ACTIVE)
    assert lowered is not None and 2 <= lowered < 64, new_args
    assert new_args == [
        str(lowered) if i == old_args.index(ACTIVE) + 1 else a for i, a in enumerate(old_args)
    ]
    assert without_args(patched["spec"]["template"]) == without_args(before["spec"]["template"])
    assert container(patched, "log-shipper") == container(before, "log-shipper")
    for field in ("replicas", "selector", "strategy", "revisionHistoryLimit", "progressDeadlineSeconds"):
        assert patched["spec"][field] == before["spec"][field], field
    cause = patched["metadata"]["annotations"][CHANGE_CAUSE]
    assert cause.startswith(f"kvtune: {ACTIVE} 64 -> {lowered}; lower_max_num_seqs: "), cause
    assert "preempt" in cause, cause
    assert args_owner_managers(patched) == ["kvtune/Update"]
    applied = wait_for("the TuningApplied Event", lambda: events(cluster, namespace, NAME, "TuningApplied"))
    assert len(applied) == 1 and f"through {ACTIVE}" in applied[0], applied

    # kube-controller-manager rolls out a new ReplicaSet; held: 2 of 3 updated, one new pod cannot be placed
    wait_for("a second ReplicaSet", lambda: len(replica_sets(cluster, namespace, NAME)) == 2)
    wait_for("the rollout held half done", lambda: (s := deployment(cluster, namespace)["status"]).get(
        "updatedReplicas") == 2 and s.get("availableReplicas") == 3)  # fmt: skip
    wait_for("the policy to say it waits for the rollout", lambda: "waiting for rollout" in (
        cluster.policy(namespace, NAME)["status"].get("note") or ""))  # fmt: skip
    cluster.evaluations(namespace, NAME, 3)  # while held, the operator neither judges nor patches again
    status = cluster.policy(namespace, NAME)["status"]
    assert "waiting for rollout" in status["note"] and "2 of 3 replicas updated" in status["note"], status[
        "note"
    ]
    assert status["workload"]["rolloutGeneration"] == 2
    assert deployment(cluster, namespace)["metadata"]["generation"] == 2
    assert len(events(cluster, namespace, NAME, "TuningApplied")) == 1

    cordon(cluster, "vllm-main", False)  # the rollout completes; the operator carries on
    rolled_out(cluster, namespace, NAME)
    wait_for(
        "the operator to see the rollout complete",
        lambda: events(cluster, namespace, NAME, "RolloutComplete"),
    )
    wait_for("the policy to stop waiting", lambda: "waiting for rollout" not in (
        cluster.policy(namespace, NAME)["status"].get("note") or ""))  # fmt: skip
    stalled = cluster.condition(namespace, NAME, "RolloutStalled")
    assert stalled is not None and (stalled["status"], stalled["reason"]) == ("False", "RolloutComplete")
    assert deployment(cluster, namespace)["metadata"]["generation"] == 2  # still the one patch
    history = cluster.kubectl("rollout", "history", f"deployment/{NAME}", "-n", namespace).stdout
    assert f"kvtune: {ACTIVE} 64 -> {lowered}; lower_max_num_seqs" in history, history


def service_account_login(cluster: Cluster, release: dict[str, str]) -> Callable[[], client.Configuration]:
    """How the operator's own client logs in, here as the chart's ServiceAccount (a TokenRequest token)."""
    kubeconfig = cluster.service_account_kubeconfig(release["name"], release["namespace"])

    def load() -> client.Configuration:
        configuration = client.Configuration()
        config.load_kube_config(str(kubeconfig), client_configuration=configuration)
        return configuration

    return load


def test_a_concurrent_write_makes_a_real_conflict_that_is_retried(
    cluster: Cluster, world: dict[str, Any], release: dict[str, str]
) -> None:
    """Between the actuator's read and its patch another client writes the Deployment: the API server
    refuses the stale resourceVersion with 409, the actuator reads again and patches; nothing is lost."""
    namespace, name = world["namespace"], "llama-conflict"
    kwok_node(cluster, "conflict-main", "conflict")
    cluster.apply(vllm_deployment(name, namespace, "conflict", replicas=1))
    # the controllers' status writes done first: each changes the resourceVersion too, and a conflict with
    # one of them would be a second conflict the test did not make
    rolled_out(cluster, namespace, name)
    admin = client.AppsV1Api(cluster.api)

    class RacedApi(KubeApi):
        raced = False

        def read_workload(self, kind: Any, ns: str, workload: str, fresh: bool = False) -> dict[str, Any]:
            read = super().read_workload(kind, ns, workload, fresh)
            if not self.raced:  # the other writer lands after this read, before the patch
                self.raced = True
                admin.patch_namespaced_deployment(
                    workload, ns, {"metadata": {"annotations": {"team": "serving"}}}
                )
            return read

    raced = RacedApi(service_account_login(cluster, release))
    actuator = WorkloadArgsActuator(raced, "Deployment", namespace, name, "vllm", "vllm")
    result = actuator.apply("max_num_seqs", 24, "e2e: a conflict")
    assert result.ok and result.values == {"max_num_seqs": 24}, result
    # the API server's own 409, met and retried; the controllers keep writing the Deployment's status, and on
    # a busy machine one of those can land in a retry's read-to-patch gap too: a real conflict, also retried
    assert raced.raced and 1 <= actuator.conflicts < CONFLICT_RETRIES
    after = deployment(cluster, namespace, name)
    assert read_flag(container(after, "vllm")["args"], ACTIVE) == 24
    assert after["metadata"]["annotations"]["team"] == "serving"  # the other writer's change survives
    assert after["metadata"]["annotations"][CHANGE_CAUSE] == f"kvtune: {ACTIVE} 64 -> 24; e2e: a conflict"
    raced.close()


def test_a_rollout_past_its_progress_deadline_is_a_condition(cluster: Cluster, world: dict[str, Any]) -> None:
    namespace, name = world["namespace"], "llama-stall"
    kwok_node(cluster, "stall-main", "stall")
    cluster.apply(vllm_deployment(name, namespace, "stall"))
    rolled_out(cluster, namespace, name)
    # a short deadline once it runs (set at creation, a slow first rollout could exceed it), and nowhere for
    # new pods to go
    cluster.kubectl("patch", "deployment", name, "-n", namespace, "--type", "merge", "-p",
                    json.dumps({"spec": {"progressDeadlineSeconds": 5}}))  # fmt: skip
    set_up = deployment(cluster, namespace, name)["metadata"]["generation"]
    cordon(cluster, "stall-main")
    cluster.apply(pods_policy(name, namespace, name, SERVICE, world["port"]))
    wait_for(
        "the operator's patch",
        lambda: deployment(cluster, namespace, name)["metadata"]["generation"] > set_up,
    )
    wait_for("the RolloutStalled condition", lambda: (c := cluster.condition(namespace, name, "RolloutStalled"))
             and c["status"] == "True")  # fmt: skip
    condition = cluster.condition(namespace, name, "RolloutStalled")
    assert condition is not None and condition["reason"] == "ProgressDeadlineExceeded"
    assert "progress" in condition["message"], condition
    (stalled,) = wait_for(
        "the RolloutStalled Event", lambda: events(cluster, namespace, name, "RolloutStalled")
    )
    assert f"deployment {namespace}/{name} stopped rolling out" in stalled, stalled
    cluster.evaluations(namespace, name, 3)
    assert "rollout stalled" in cluster.policy(namespace, name)["status"]["note"]
    assert deployment(cluster, namespace, name)["metadata"]["generation"] == set_up + 1  # no second patch

    cordon(cluster, "stall-main", False)
    rolled_out(cluster, namespace, name)
    wait_for("the condition to clear", lambda: (c := cluster.condition(namespace, name, "RolloutStalled"))
             and (c["status"], c["reason"]) == ("False", "RolloutComplete"))  # fmt: skip


def gitops_apply(cluster: Cluster, namespace: str) -> None:
    """What Argo CD or Flux do: server-side apply of the manifest in Git (the old args), taking the fields."""
    manifest = vllm_deployment(NAME, namespace, POOL, args=VLLM_ARGS)
    cluster.kubectl("apply", "--server-side", f"--field-manager={GITOPS_MANAGER}", "--force-conflicts", "-f", "-",
                    stdin=yaml.safe_dump(manifest))  # fmt: skip


def test_a_gitops_revert_is_named_and_not_fought_forever(cluster: Cluster, world: dict[str, Any]) -> None:
    namespace = world["namespace"]
    ours = read_flag(container(deployment(cluster, namespace), "vllm")["args"], ACTIVE)
    assert ours is not None and ours < 64
    for revert in range(1, REVERTS_TOLERATED + 2):
        wait_for("kvtune's value in the args", lambda: (d := deployment(cluster, namespace)) and read_flag(
            container(d, "vllm")["args"], ACTIVE) == ours and "kvtune/Update" in args_owner_managers(d))  # fmt: skip
        rolled_out(cluster, namespace, NAME)
        gitops_apply(cluster, namespace)
        if revert <= REVERTS_TOLERATED:
            reverted = wait_for(f"revert {revert} noticed", lambda n=revert: [
                m for m in events(cluster, namespace, NAME, "ChangeReverted") if f"(revert {n};" in m])  # fmt: skip
            assert f"{GITOPS_MANAGER} (server-side apply" in reverted[0], reverted
            assert (
                f"put {ACTIVE} back to 64 on deployment {namespace}/{NAME}, over kvtune's {ours}"
                in reverted[0]
            )
    (yielded,) = wait_for(
        "the operator to stop", lambda: events(cluster, namespace, NAME, "YieldedToFieldManager")
    )
    assert (
        f"{GITOPS_MANAGER} (server-side apply" in yielded and f"keeps {ours} as a recommendation" in yielded
    )
    condition = cluster.condition(namespace, NAME, "ChangeReverted")
    assert condition is not None and (condition["status"], condition["reason"]) == (
        "True",
        "YieldedToFieldManager",
    )
    assert GITOPS_MANAGER in condition["message"]
    cluster.evaluations(namespace, NAME, 5)  # it leaves the args alone from now on
    held = deployment(cluster, namespace)
    assert read_flag(container(held, "vllm")["args"], ACTIVE) == 64
    assert args_owner_managers(held) == [f"{GITOPS_MANAGER}/Apply"]
    status = cluster.policy(namespace, NAME)["status"]
    assert status["recommended"]["maxNumSeqs"] == ours and status["workload"]["yieldedValue"] == ours
    assert status["workload"]["reverts"] == REVERTS_TOLERATED + 1
    assert "maxNumSeqs" not in (status.get("desired") or {})
