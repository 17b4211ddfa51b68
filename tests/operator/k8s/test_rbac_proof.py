"""Least privilege, proved (issue 15): kopf runs the operator with the peering the chart gives it, against
kmock, over every path that calls the Kubernetes API: a kvtune workload through its pods' EndpointSlices
(the admin-token Secret read by name, the policy's status, Events), an old vLLM Deployment patched through
`--max-num-seqs`, a vLLM 0.32 StatefulSet patched through `--max-num-active-seqs`, and kopf's own watching,
annotations and peering. Every call is recorded (tests/operator/api_calls.py) and compared, both ways, with
the rules `helm template` renders: each call must be granted, and each grant used by some call. Namespaced,
against the Role in the watched namespace; cluster-wide, against the ClusterRole.

Each mode has its own rights (issue 37): the same policies, all asking for Apply, run under the ceiling of
each `maxMode`. Under Apply the operator patches its workloads; under Observe and Recommend it writes no
workload, and the chart rendered with that maxMode grants exactly its calls (no `patch` on Deployments or
StatefulSets). An undo under a Recommend ceiling patches the Deployment back: `rbac.allowUndo` grants that,
and nothing without it does."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any, NamedTuple

import kmock
import kopf
import pytest

import kvtune.operator.k8s.handlers  # noqa: F401  (registers the handlers with kopf)
from kvtune.operator.decide.policy import Mode
from kvtune.operator.io.own_metrics import OperatorMetrics
from kvtune.operator.k8s.workload_actuator import read_flag
from tests.chart.helm import by_kind, render
from tests.operator.api_calls import ApiCall, api_calls
from tests.operator.helpers import local_url, serving
from tests.operator.kmock_world import (
    DEPLOYMENTS,
    NS,
    POLICIES,
    OptimisticEmulator,
    add_admin_secret,
    add_policy,
    ask_for_undo,
    conditions,
    container_args,
    kopf_running,
    our_events,
    ours,
    policy_status,
    undo_done,
)
from tests.operator.pods_world import Workload, kvtune_spec
from tests.operator.rbac_world import (
    OLD_VLLM_IMAGE,
    PEERING,
    STS_MAX_NUM_SEQS,
    Grant,
    VllmHandler,
    add_peering,
    granting,
    rule_grants,
    vllm_policy,
)

ADMIN_SECRET = "llama-admin"  # what add_admin_secret creates and kvtune_spec names
STATEFULSETS = kmock.resource("apps/v1/statefulsets")
POLICY_NAMES = ("pods", "vllm", "sts")  # the three paths set_up gives a policy each


@pytest.fixture
def engines() -> Iterator[Callable[[str | None], str]]:
    """Start a vLLM-like engine (its /version answering the given version, or 404): its base URL."""
    files = ["kvtune_preempting_t0.prom", "kvtune_preempting_t1.prom"]
    with ExitStack() as servers:

        def start(version: str | None) -> str:
            engine = serving(VllmHandler, files=files, admin_tokens=[], version=version)
            return local_url(servers.enter_context(engine))

        yield start


def add_workload(cluster: OptimisticEmulator, kind: str, name: str, image: str, args: list[str]) -> None:
    resource = DEPLOYMENTS if kind == "Deployment" else STATEFULSETS
    cluster.objects[resource, NS, name] = {
        "apiVersion": "apps/v1",
        "kind": kind,
        "metadata": {"name": name, "namespace": NS, "resourceVersion": "1", "generation": 1},
        "spec": {"template": {"spec": {"containers": [{"name": "vllm", "image": image, "args": args}]}}},
    }


def workload_args(cluster: OptimisticEmulator, resource: kmock.resource, name: str) -> list[str]:
    return [
        str(a)
        for a in cluster.objects[resource, NS, name]["spec"]["template"]["spec"]["containers"][0]["args"]
    ]


class Scenario(NamedTuple):
    """What the operator must have done on each path before its calls are complete."""

    pods: Workload

    def done(self, cluster: OptimisticEmulator) -> bool:
        reasons = {event["reason"] for event in our_events(cluster)}
        return (
            all(pod.patches for pod in self.pods.pods.values())
            and read_flag(workload_args(cluster, DEPLOYMENTS, "llama-vllm"), "--max-num-seqs") != 64
            and read_flag(workload_args(cluster, STATEFULSETS, "llama-sts"), "--max-num-active-seqs")
            is not None
            and "TuningApplied" in reasons
        )

    def capped(self, cluster: OptimisticEmulator) -> bool:
        """Under an Observe or Recommend ceiling: every policy evaluated and capped (condition ModeCapped)."""
        found = [cluster.objects[POLICIES, NS, name].get("status") or {} for name in POLICY_NAMES]
        return all(conditions(status).get("ModeCapped") == "True" for status in found)


def set_up(
    cluster: OptimisticEmulator, pods: Workload, engines: Callable[[str | None], str], clusterwide: bool
) -> Scenario:
    cluster.resources["apps/v1/statefulsets"] = kmock.ResourceInfo(
        kind="StatefulSet", namespaced=True, verbs={"get", "list", "watch", "patch"}
    )
    # the autoscalers a policy with spec.scaling looks for (none here: the signal is exported, not withdrawn)
    cluster.resources["autoscaling/v2/horizontalpodautoscalers"] = kmock.ResourceInfo(
        kind="HorizontalPodAutoscaler", namespaced=True
    )
    cluster.resources["keda.sh/v1alpha1/scaledobjects"] = kmock.ResourceInfo(
        kind="ScaledObject", namespaced=True
    )
    add_peering(cluster, clusterwide)
    # a kvtune engine of two pods behind a Service: EndpointSlices, the admin token Secret, every pod's admin API
    pods.start("llama-a", "127.0.0.2", [46, 95])
    pods.start("llama-b", "127.0.0.3", [46, 146])
    add_admin_secret(cluster, "pods-token", "1")
    add_policy(cluster, kvtune_spec(pods.port), "pods")
    # vLLM 0.31 (by its image tag; its /version answers 404): the Deployment's --max-num-seqs
    add_workload(
        cluster, "Deployment", "llama-vllm", OLD_VLLM_IMAGE, ["--model", "/models/llama", "--max-num-seqs=64"]
    )
    # with the replica signal on: the operator lists the namespace's autoscalers each tick
    scaled = {
        **vllm_policy("Deployment", "llama-vllm", engines(None)),
        "scaling": {"minReplicas": 1, "maxReplicas": 4},
    }
    add_policy(cluster, scaled, "vllm")
    # vLLM 0.32 (by its /version; the image has no tag): the StatefulSet's --max-num-active-seqs
    add_workload(cluster, "StatefulSet", "llama-sts", "vllm/vllm-openai",
                 ["--model", "/models/llama", "--max-num-seqs", str(STS_MAX_NUM_SEQS)])  # fmt: skip
    add_policy(cluster, vllm_policy("StatefulSet", "llama-sts", engines("0.32.1")), "sts")
    return Scenario(pods)


def ticks(cluster: OptimisticEmulator) -> dict[str, int]:
    """Evaluations so far, by policy: every tick ends with a write of the policy's status."""
    writes = [r.name for r in ours(cluster[kmock.action.UPDATE, POLICIES]) if r.subresource == "status"]
    return {name: writes.count(name) for name in set(writes)}


async def operate(
    cluster: OptimisticEmulator, done: Callable[[OptimisticEmulator], bool], clusterwide: bool, max_mode: Mode
) -> set[ApiCall]:
    """Run kopf as `kvtune operator --peering NAME --max-mode MODE (--namespace NS | --all-namespaces)`
    does, until every path has done what it does in that mode, and two ticks more; every API call it made."""
    memo = kopf.Memo(operator_metrics=OperatorMetrics(max_mode.value), max_mode=max_mode)
    async with kopf_running(memo, clusterwide=clusterwide, peering=PEERING, stop_within=20) as operator:
        await operator.until(lambda: done(cluster), 45,
                             lambda: f"not every path acted within 45 s: {sorted(api_calls(list(cluster)))}")  # fmt: skip
        # two more ticks of every policy (each tick ends with its status write): the steady state's calls too
        after = ticks(cluster)
        await operator.until(lambda: all(ticks(cluster)[policy] >= count + 2 for policy, count in after.items()),
                             45, lambda: f"the policies did not tick on: {ticks(cluster)}")  # fmt: skip
    return api_calls(list(cluster))


def assert_each_path_acted(cluster: OptimisticEmulator, scenario: Scenario) -> None:
    """The paths themselves, explicitly: the cluster engineer's StatefulSet and admission-flag cases."""
    values = {pod.patches[0]["max_num_seqs"] for pod in scenario.pods.pods.values()}
    assert len(values) == 1 and all(len(pod.patches) == 1 for pod in scenario.pods.pods.values())
    # an old vLLM: --max-num-seqs lowered, the flag it lacks never written; one Deployment patch
    deployment = workload_args(cluster, DEPLOYMENTS, "llama-vllm")
    lowered = read_flag(deployment, "--max-num-seqs")
    assert lowered is not None and 2 <= lowered < 64
    assert read_flag(deployment, "--max-num-active-seqs") is None
    assert len([r for r in ours(cluster[kmock.action.UPDATE, DEPLOYMENTS]) if not r.subresource]) == 1
    # vLLM 0.32 on a StatefulSet: --max-num-active-seqs at most --max-num-seqs, which stays; one patch
    statefulset = workload_args(cluster, STATEFULSETS, "llama-sts")
    active = read_flag(statefulset, "--max-num-active-seqs")
    assert active is not None and 2 <= active <= STS_MAX_NUM_SEQS
    assert read_flag(statefulset, "--max-num-seqs") == STS_MAX_NUM_SEQS
    assert len([r for r in ours(cluster[kmock.action.UPDATE, STATEFULSETS]) if not r.subresource]) == 1
    assert policy_status(cluster, "sts")["admissionFlag"].startswith("--max-num-active-seqs")
    assert policy_status(cluster, "vllm")["admissionFlag"].startswith("--max-num-seqs")
    messages = [e["message"] for e in our_events(cluster) if e["reason"] == "TuningApplied"]
    assert any("through --max-num-active-seqs (vLLM 0.32.1 from the engine's /version" in m for m in messages)
    assert any("through --max-num-seqs (vLLM v0.31.0 from the image tag" in m for m in messages), messages


# Made only when the operator's watch has not yet brought the workload (a GET in its place); under Apply the
# read before each patch always makes it. Granted, and allowed to go unused in a run.
CACHE_MISS_GRANTS = {
    Grant("get", "apps", "deployments", "", ""),
    Grant("get", "apps", "statefulsets", "", ""),
}


def assert_exactly_granted(calls: set[ApiCall], role: dict[str, Any], namespace: str | None) -> None:
    print("API calls:", *sorted(calls), sep="\n  ")
    grants = rule_grants(role)
    missing = sorted(call for call in calls if not granting(call, grants, namespace))
    used = set().union(*(granting(call, grants, namespace) for call in calls))
    extra = sorted(grants - used - CACHE_MISS_GRANTS)
    where = f"the Role in {namespace}" if namespace else "the ClusterRole"
    assert not missing and not extra, (
        f"{where} must grant exactly the operator's calls.\n"
        + "".join(f"  missing (called, not granted): {call}\n" for call in missing)
        + "".join(f"  extra (granted, never called): {grant}\n" for grant in extra)
    )


@pytest.mark.asyncio
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("clusterwide", "scope", "granted_by", "not_rendered", "namespace"),
    [
        (False, {"watchNamespaces": [NS]}, "Role", "ClusterRole", NS),
        (True, {"clusterWide": True}, "ClusterRole", "Role", None),
    ],
    ids=["namespaced", "cluster-wide"],
)
async def test_the_role_of_each_scope_grants_exactly_the_calls_the_operator_makes(
    kube: OptimisticEmulator,
    workload: Workload,
    engines: Callable[[str | None], str],
    tmp_path: Path,
    clusterwide: bool,
    scope: dict[str, Any],
    granted_by: str,
    not_rendered: str,
    namespace: str | None,
) -> None:
    """Namespaced, the Role in the watched namespace grants them (and no ClusterRole is rendered);
    cluster-wide, the ClusterRole (and no Role)."""
    scenario = set_up(kube, workload, engines, clusterwide)
    calls = await operate(kube, scenario.done, clusterwide, max_mode=Mode.APPLY)
    assert_each_path_acted(kube, scenario)
    assert ApiCall("get", "", "secrets", "", NS, ADMIN_SECRET) in calls  # the one Secret, by its name
    assert {call.name for call in calls if call.resource == "secrets"} == {ADMIN_SECRET}

    objects = render({"maxMode": "Apply", **scope, "adminTokenSecrets": [ADMIN_SECRET]}, tmp_path)
    assert by_kind(objects, not_rendered) == []
    (role,) = [
        role for role in by_kind(objects, granted_by) if role["metadata"].get("namespace") == namespace
    ]
    assert_exactly_granted(calls, role, namespace)


def workload_writes(calls: set[ApiCall]) -> list[ApiCall]:
    """The calls that write a workload (anything in group apps but a read)."""
    return sorted(
        call for call in calls if call.group == "apps" and call.verb not in ("get", "list", "watch")
    )


@pytest.mark.asyncio
@pytest.mark.timeout(120)
@pytest.mark.parametrize("max_mode", [Mode.OBSERVE, Mode.RECOMMEND], ids=lambda mode: mode.value)
async def test_under_observe_and_recommend_the_role_grants_exactly_the_calls_and_no_workload_write(
    kube: OptimisticEmulator,
    workload: Workload,
    engines: Callable[[str | None], str],
    tmp_path: Path,
    max_mode: Mode,
) -> None:
    """The same three paths, their policies asking for Apply, under the ceiling of maxMode: nothing is
    written to a workload (nor to an engine's admin API), and the Role that maxMode renders grants exactly
    the calls the operator made, with `get` and no `patch` on Deployments and StatefulSets."""
    scenario = set_up(kube, workload, engines, clusterwide=False)
    calls = await operate(kube, scenario.capped, clusterwide=False, max_mode=max_mode)
    assert not workload_writes(calls), workload_writes(calls)
    assert not any(pod.patches for pod in workload.pods.values())
    assert read_flag(workload_args(kube, DEPLOYMENTS, "llama-vllm"), "--max-num-seqs") == 64
    assert read_flag(workload_args(kube, STATEFULSETS, "llama-sts"), "--max-num-active-seqs") is None

    values = {"maxMode": max_mode.value, "watchNamespaces": [NS], "adminTokenSecrets": [ADMIN_SECRET]}
    (role,) = by_kind(render(values, tmp_path), "Role")
    assert_exactly_granted(calls, role, NS)
    assert {(g.verb, g.resource) for g in rule_grants(role) if g.group == "apps"} == {
        (verb, resource) for verb in ("get", "list", "watch") for resource in ("deployments", "statefulsets")
    }


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_an_undo_under_recommend_needs_exactly_the_allow_undo_value(
    kube: OptimisticEmulator,
    metrics_url: str,
    tmp_path: Path,
) -> None:
    """An earlier Apply lowered the Deployment's flag from 64 to 20, then maxMode went down to Recommend and
    someone asked for an undo: the operator patches the flag back. Every call it makes is granted by the
    Recommend Role with `rbac.allowUndo: true`; without the value, that patch is the one call refused."""
    ask_for_undo(kube, metrics_url)
    memo = kopf.Memo(operator_metrics=OperatorMetrics(Mode.RECOMMEND.value), max_mode=Mode.RECOMMEND)
    async with kopf_running(memo) as operator:  # as `kvtune operator --namespace` runs it: no scanning
        await operator.until(
            lambda: undo_done(kube), 30, lambda: f"no undo within 30 s: {sorted(api_calls(list(kube)))}"
        )
    assert read_flag(container_args(kube), "--max-num-seqs") == 64
    calls = api_calls(list(kube))
    undo_patch = ApiCall("patch", "apps", "deployments", "", NS, "")
    assert workload_writes(calls) == [undo_patch]

    def refused(values: dict[str, object]) -> list[ApiCall]:
        (role,) = by_kind(render({"watchNamespaces": [NS], **values}, tmp_path), "Role")
        return sorted(call for call in calls if not granting(call, rule_grants(role), NS))

    assert refused({"rbac": {"allowUndo": True}}) == []
    assert refused({}) == [undo_patch]  # maxMode Recommend, the chart's default
    assert refused({"maxMode": "Observe"}) == [undo_patch]


def test_the_comparison_names_a_missing_and_an_extra_grant() -> None:
    """The proof's own check bites both ways, and a Role never grants another namespace's or a
    cluster-scoped call."""
    role = {"rules": [
        {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get"]},
        {"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["llama-admin"], "verbs": ["get"]},
    ]}  # fmt: skip
    calls = {
        ApiCall("get", "", "secrets", "", NS, ADMIN_SECRET),
        ApiCall("get", "", "secrets", "", NS, "another-secret"),
        ApiCall("create", "", "events", "", NS, ""),
    }
    with pytest.raises(AssertionError) as failed:
        assert_exactly_granted(calls, role, NS)
    message = str(failed.value)
    assert "missing (called, not granted): ApiCall(verb='get', group='', resource='secrets'" in message
    assert "name='another-secret'" in message and "resource='events'" in message
    assert "extra (granted, never called): Grant(verb='get', group='', resource='configmaps'" in message
    assert "name='llama-admin')" not in message.split("extra")[1]  # the named Secret's grant is used
    elsewhere = {ApiCall("get", "", "secrets", "", "other", ADMIN_SECRET)}
    assert not granting(next(iter(elsewhere)), rule_grants(role), NS)
    assert granting(next(iter(elsewhere)), rule_grants(role), None)  # a ClusterRole's grant is everywhere
