"""What the operator follows on a workload it patches, without a cluster: where a rollout stands (done, in
progress, stalled), who owns a container's args (managedFields), and how an evaluation waits for a rollout,
notices a revert, names its author, and yields after a bounded number of them. The same paths run against
a real control plane in tests/e2e/test_vllm_deployment.py."""

from __future__ import annotations

from typing import Any

import pytest

from kvtune.operator.k8s.crd import WorkloadWatch
from kvtune.operator.k8s.managed_fields import args_owners, container_key, other_owner
from kvtune.operator.k8s.workload_actuator import WorkloadArgsActuator
from kvtune.operator.k8s.workload_watch import (
    REVERTS_TOLERATED,
    after_patch,
    conditions,
    follow,
    needs_read,
    rollout,
)

ARGS = ["--model", "m", "--max-num-seqs", "64", "--max-num-active-seqs"]


def deployment(
    active: int = 24, generation: int = 2, observed: int = 2, updated: int = 3, available: int = 3,
    total: int = 3, manager: str = "kvtune", operation: str = "Update", progressing: dict[str, str] | None = None,
) -> dict[str, Any]:  # fmt: skip
    fields = {"f:spec": {"f:template": {"f:spec": {"f:containers": {container_key("vllm"): {"f:args": {}}}}}}}
    status: dict[str, Any] = {"observedGeneration": observed, "updatedReplicas": updated,
                              "availableReplicas": available, "replicas": total}  # fmt: skip
    if progressing:
        status["conditions"] = [{"type": "Progressing", **progressing}]
    return {
        "kind": "Deployment",
        "metadata": {
            "generation": generation,
            "managedFields": [
                {
                    "manager": "kubectl-client-side-apply",
                    "operation": "Update",
                    "time": "2026-12-02T00:00:00Z",
                    "fieldsV1": {"f:spec": {"f:replicas": {}}},
                },
                {
                    "manager": manager,
                    "operation": operation,
                    "time": "2026-12-02T00:01:00Z",
                    "fieldsV1": fields,
                },
            ],
        },
        "spec": {
            "replicas": 3,
            "template": {"spec": {"containers": [{"name": "vllm", "args": [*ARGS, str(active)]}]}},
        },
        "status": status,
    }


def actuator() -> WorkloadArgsActuator:
    return WorkloadArgsActuator(None, "Deployment", "inference", "llama", "vllm", "vllm")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("workload", "done", "stalled", "says"),
    [
        (deployment(), True, False, "3 of 3 replicas updated, 3 available"),
        (deployment(observed=1), False, False, "the controller has not seen it yet"),
        (deployment(updated=2, total=4), False, False, "2 of 3 replicas updated, 3 available, 2 old still running"),
        (deployment(updated=3, total=4), False, False, "1 old still running"),  # an old pod not yet gone
        (deployment(updated=1, total=4, progressing={"status": "False", "reason": "ProgressDeadlineExceeded",
                                                     "message": 'ReplicaSet "llama-5d9" has timed out progressing.'}),
         False, True, "has timed out progressing"),
    ],
)  # fmt: skip
def test_where_a_rollout_stands(workload: dict[str, Any], done: bool, stalled: bool, says: str) -> None:
    found = rollout(workload)
    assert (found.done, found.stalled) == (done, stalled) and says in found.summary, found


def test_a_statefulset_is_done_when_every_replica_runs_the_update_revision() -> None:
    sts = {"kind": "StatefulSet", "metadata": {"generation": 3}, "spec": {"replicas": 2},
           "status": {"observedGeneration": 3, "updatedReplicas": 2, "readyReplicas": 2, "replicas": 2,
                      "currentRevision": "a", "updateRevision": "b"}}  # fmt: skip
    assert not rollout(sts).done
    sts["status"]["currentRevision"] = "b"
    assert rollout(sts).done


def test_the_args_owner_comes_from_managed_fields() -> None:
    (owner,) = args_owners(deployment(manager="argocd-controller", operation="Apply"), "vllm")
    assert owner.describe() == "argocd-controller (server-side apply at 2026-12-02T00:01:00Z)"
    assert other_owner(deployment(), "vllm", "kvtune") is None
    assert args_owners(deployment(), "sidecar") == []


def test_a_patch_is_a_rollout_to_wait_for_until_it_completes() -> None:
    args = actuator()
    args.patched_generation = 2
    state = after_patch(WorkloadWatch(), args, now=100.0)
    assert state.rollout_generation == 2 and needs_read(state, None)
    held = follow(deployment(updated=2, total=4), args, state, 24, policy_generation=1, now=105.0)
    assert held.wait is not None and held.wait.startswith("waiting for rollout of deployment inference/llama")
    assert not held.rolled_out and not held.events
    assert conditions(held.state)[0][1:3] == ("False", "RolloutInProgress")
    done = follow(deployment(), args, held.state, 24, policy_generation=1, now=112.0)
    assert done.wait is None and done.rolled_out and done.state.rollout_generation is None
    assert [e.reason for e in done.events] == ["RolloutComplete"] and "in 12 s" in done.events[0].message
    assert not needs_read(done.state, None) and needs_read(done.state, 24)


def test_a_stalled_rollout_is_reported_once_and_still_waited_for() -> None:
    args = actuator()
    state = WorkloadWatch(rollout_generation=2, rollout_since=0.0)
    deadline = {"status": "False", "reason": "ProgressDeadlineExceeded", "message": "timed out progressing"}
    first = follow(deployment(updated=1, total=4, progressing=deadline), args, state, 24, 1, now=30.0)
    assert (
        [e.reason for e in first.events] == ["RolloutStalled"]
        and first.wait
        and "rollout stalled" in first.wait
    )
    assert conditions(first.state)[0][1:3] == ("True", "ProgressDeadlineExceeded")
    again = follow(deployment(updated=1, total=4, progressing=deadline), args, first.state, 24, 1, now=31.0)
    assert not again.events and again.wait  # one Event, and no action while it lasts


def test_reverts_are_named_tolerated_a_bounded_number_of_times_then_yielded_to() -> None:
    args = actuator()
    state = WorkloadWatch()
    for revert in range(1, REVERTS_TOLERATED + 2):
        reverted = deployment(
            active=64,
            generation=2 * revert,
            observed=2 * revert,
            manager="argocd-controller",
            operation="Apply",
        )
        seen = follow(reverted, args, state, 24, policy_generation=1, now=float(revert))
        assert seen.state.reverts == revert and seen.state.reverted_by == "argocd-controller"
        assert seen.wait is None  # the revert's own rollout is already complete here
        (event,) = [e for e in seen.events if e.reason != "RolloutComplete"]
        assert "argocd-controller (server-side apply" in event.message
        assert (
            "put --max-num-active-seqs back to 64 on deployment inference/llama, over kvtune's 24"
            in event.message
        )
        if revert <= REVERTS_TOLERATED:
            assert event.reason == "ChangeReverted" and not seen.yielded
        else:
            assert event.reason == "YieldedToFieldManager" and seen.yielded and seen.state.yielded_value == 24
        again = follow(reverted, args, seen.state, 24, policy_generation=1, now=float(revert) + 0.5)
        assert again.state.reverts == revert  # the same revert is counted once
        state = seen.state
    assert conditions(state)[1][1:3] == ("True", "YieldedToFieldManager")
    assert not needs_read(state, 24)  # yielded: nothing to hold, nothing to read
    edited = follow(deployment(active=64), args, state, None, policy_generation=2, now=10.0)
    assert edited.state.reverts == 0 and edited.state.yielded_value is None  # an edited policy acts again


def test_a_value_kvtune_still_owns_is_no_revert() -> None:
    seen = follow(deployment(active=64), actuator(), WorkloadWatch(), 24, policy_generation=1, now=1.0)
    assert seen.state.reverts == 0 and not seen.events  # our own write (e.g. a failed patch): not a revert


def test_the_device_comes_from_the_observed_container_as_the_doctor_reads_it() -> None:
    """A GPU request is CUDA, a CPU image is the CPU, neither is unknown: the operator then keeps the CRD's
    GPU rounding (8), and with a device rounds as the doctor does for it."""
    watched = actuator()
    assert watched.device() is None  # nothing observed yet
    gpu = deployment()
    gpu["spec"]["template"]["spec"]["containers"][0].update(
        {"image": "vllm/vllm-openai:v0.32.0", "resources": {"limits": {"nvidia.com/gpu": "1"}}}
    )
    watched.observe(gpu)
    assert watched.device() == "cuda"
    cpu = deployment()
    cpu["spec"]["template"]["spec"]["containers"][0]["image"] = "vllm/vllm-cpu:v0.32.0"
    watched.observe(cpu)
    assert watched.device() == "cpu"
    watched.observe(deployment())
    assert watched.device() is None
