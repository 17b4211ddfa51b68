"""The chart's RBAC judged by the real authorizer. The operator runs as a process with a TokenRequest token
for the chart's ServiceAccount, over every path of the recorded proof (tests/operator/k8s/test_rbac_proof.py):
a kvtune workload through its pods' EndpointSlices (the admin-token Secret read by name, status, Events),
an old vLLM Deployment patched through `--max-num-seqs`, a vLLM 0.32 StatefulSet patched through
`--max-num-active-seqs`, and kopf's watching, annotations and peering. Every path acts and nothing is
forbidden.

Each maxMode's rights, as the authorizer answers the chart's ServiceAccount itself (SelfSubjectAccessReview,
`kubectl auth can-i`): under Observe and Recommend it may write no workload of any kind; Apply, or
`rbac.allowUndo` for an undo, adds `patch` on Deployments and StatefulSets and nothing else. An operator run
above its release's maxMode (its --max-mode raised by hand) is refused that patch by the API server, and
says so clearly: the Event and the log name the verb and the resource refused."""

from __future__ import annotations

import base64
import json
import re
import threading
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from kvtune.operator.k8s.workload_actuator import read_flag
from tests.e2e.chart_release import install, policy, workload
from tests.e2e.cluster import (
    CHART,
    Cluster,
    Operator,
    chart_operator,
    kwok_node,
    wait_for,
    wait_until_peered,
)
from tests.e2e.pod_network import PodNetwork
from tests.e2e.workloads import endpoint_slice, service
from tests.operator.pods_world import PodEngine, free_port
from tests.operator.rbac_world import OLD_VLLM_IMAGE, STS_MAX_NUM_SEQS, VllmHandler, vllm_policy

NAMESPACE = "rbac"
RELEASE = "kvtune-rbac"
SECRET = "pods-token"
POD_INDEXES = (5, 6)  # the pods' addresses in the run's pod network (the shared engines have 2 to 4)


@pytest.fixture
def vllm_engines() -> Iterator[Any]:
    """vLLM-like engines on loopback: the recorded preempting scrape, and `GET /version` (or 404)."""
    servers: list[ThreadingHTTPServer] = []

    def start(version: str | None) -> str:
        server = ThreadingHTTPServer(("127.0.0.1", 0), VllmHandler)
        server.files = ["kvtune_preempting_t0.prom", "kvtune_preempting_t1.prom"]  # type: ignore[attr-defined]
        server.admin_tokens = []  # type: ignore[attr-defined]
        server.version = version  # type: ignore[attr-defined]
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


# Every workload kind, by API group, and every verb that writes one: none may be granted below Apply.
WORKLOADS = ("deployments.apps", "statefulsets.apps", "daemonsets.apps", "replicasets.apps", "jobs.batch",
             "cronjobs.batch", "pods")  # fmt: skip
WRITES = ("create", "update", "patch", "delete")


def start_operator(cluster: Cluster, release: str, namespace: str, folder: Path) -> Operator:
    """The release's pod's operator, as a process with its ServiceAccount's token."""
    running = chart_operator(cluster, release, f"{release}-system", folder / "operator.log").start()
    wait_until_peered(cluster, running, namespace, running.peering)
    return running


def applied(cluster: Cluster, namespace: str, name: str) -> list[str]:
    return [e["message"] for e in cluster.events(namespace, name) if e["reason"] == "TuningApplied"]


def args_of(cluster: Cluster, kind: str, name: str, namespace: str) -> list[str]:
    return [
        str(a)
        for a in cluster.get(kind, name, namespace)["spec"]["template"]["spec"]["containers"][0]["args"]
    ]


def test_every_path_of_the_rbac_proof_works_against_the_real_authorizer(
    cluster: Cluster, vllm_engines: Any, pods: PodNetwork, tmp_path: Path
) -> None:
    install(cluster, RELEASE, NAMESPACE, secrets=(SECRET,))
    kwok_node(cluster, "rbac-main", "rbac")
    # a kvtune engine of two pods behind a Service: its EndpointSlice, the admin-token Secret, each pod's admin
    # API (each a server in the pods' network namespace)
    pod_addresses = [pods.address(index) for index in POD_INDEXES]
    port = pods.run(free_port, pod_addresses)
    engines = {f"llama-{i}": pods.run(PodEngine, address, port, [46, 95 + 50 * i])
               for i, address in enumerate(pod_addresses)}  # fmt: skip
    token = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": SECRET, "namespace": NAMESPACE},
             "data": {"token": base64.b64encode(b"pods-admin").decode()}}  # fmt: skip
    kvtune_spec = {"target": {"name": "llama", "engine": "kvtune", "adminTokenSecretRef": {"name": SECRET},
                              "podEndpoints": {"service": "llama", "metricsPort": port}},
                   "mode": "Apply", "intervalSeconds": 1, "evaluationWindowSeconds": 600, "cooldownSeconds": 0}  # fmt: skip
    addresses = {name: address for name, address in zip(engines, pod_addresses, strict=True)}
    cluster.apply(token, service(NAMESPACE, "llama", port), endpoint_slice(NAMESPACE, "llama", port, addresses),
                  policy("pods", NAMESPACE, kvtune_spec))  # fmt: skip
    # vLLM 0.31 by its image tag (its /version answers 404): a Deployment's --max-num-seqs
    cluster.apply(workload("Deployment", "llama-vllm", NAMESPACE, OLD_VLLM_IMAGE,
                           ["--model", "/models/llama", "--max-num-seqs=64"]),
                  policy("vllm", NAMESPACE, vllm_policy("Deployment", "llama-vllm", vllm_engines(None))))  # fmt: skip
    # vLLM 0.32 by its /version (the image has no tag): a StatefulSet's --max-num-active-seqs
    cluster.apply(workload("StatefulSet", "llama-sts", NAMESPACE, "vllm/vllm-openai",
                           ["--model", "/models/llama", "--max-num-seqs", str(STS_MAX_NUM_SEQS)]),
                  policy("sts", NAMESPACE, vllm_policy("StatefulSet", "llama-sts", vllm_engines("0.32.1"))))  # fmt: skip

    running = start_operator(cluster, RELEASE, NAMESPACE, tmp_path)
    try:
        wait_for(
            "every path to act",
            lambda: all(applied(cluster, NAMESPACE, name) for name in ("pods", "vllm", "sts")),
        )
        wait_for("every pod's admin API patched", lambda: all(pod.patches for pod in engines.values()))
        assert len({pod.patches[0]["max_num_seqs"] for pod in engines.values()}) == 1
        lowered = read_flag(args_of(cluster, "deployment", "llama-vllm", NAMESPACE), "--max-num-seqs")
        assert lowered is not None and lowered < 64
        assert (
            read_flag(args_of(cluster, "deployment", "llama-vllm", NAMESPACE), "--max-num-active-seqs")
            is None
        )
        sts = args_of(cluster, "statefulset", "llama-sts", NAMESPACE)
        active = read_flag(sts, "--max-num-active-seqs")
        assert (
            active is not None
            and active <= STS_MAX_NUM_SEQS
            and read_flag(sts, "--max-num-seqs") == STS_MAX_NUM_SEQS
        )
        for name in ("pods", "vllm", "sts"):
            status = cluster.policy(NAMESPACE, name)["status"]
            assert status["history"] and status["conditions"], (name, status)
        peering = cluster.kubectl("get", "kopfpeering", RELEASE, "-n", NAMESPACE, "-o", "json").stdout
        assert json.loads(peering).get("status"), peering  # kopf's keep-alive, written as the ServiceAccount
        log = running.output()
        # a refusal names Forbidden or the bare status 403 (not a figure such as 0.403 or 1,403)
        assert not re.search(r"forbidden|(?<![\d.,])403(?![\d.,])", log, re.IGNORECASE), log[-3000:]
        warnings = [
            e
            for e in cluster.events(NAMESPACE)
            if e["type"] == "Warning" and "forbidden" in e["message"].lower()
        ]
        assert not warnings, warnings
    finally:
        running.stop()
        for pod in engines.values():
            pod.shutdown()
            pod.server_close()


def can_i(cluster: Cluster, kubeconfig: Path, verb: str, resource: str, namespace: str) -> bool:
    """The authorizer's answer to the ServiceAccount itself (a SelfSubjectAccessReview)."""
    done = cluster.kubectl(
        "auth", "can-i", verb, resource, "-n", namespace, kubeconfig=kubeconfig, check=False
    )
    assert done.stdout.strip() in ("yes", "no"), (done.stdout, done.stderr)
    return done.stdout.strip() == "yes"


def rights(cluster: Cluster, kubeconfig: Path, namespace: str) -> set[tuple[str, str]]:
    """Every (verb, workload kind) write the ServiceAccount may make in `namespace`."""
    return {(verb, resource) for resource in WORKLOADS for verb in WRITES
            if can_i(cluster, kubeconfig, verb, resource, namespace)}  # fmt: skip


PATCH_WORKLOADS = {("patch", "deployments.apps"), ("patch", "statefulsets.apps")}


@pytest.mark.parametrize(
    ("values", "writes"),
    [
        (("maxMode=Observe",), set()),
        (("maxMode=Recommend",), set()),
        (("maxMode=Recommend", "rbac.allowUndo=true"), PATCH_WORKLOADS),
        (("maxMode=Apply",), PATCH_WORKLOADS),
    ],
    ids=["Observe", "Recommend", "Recommend+allowUndo", "Apply"],
)
def test_each_modes_rights_as_the_authorizer_answers(
    cluster: Cluster, values: tuple[str, ...], writes: set[tuple[str, str]]
) -> None:
    """`helm upgrade` through the modes of one release: the writes on workloads its ServiceAccount may make
    are exactly `writes`, and it may still read its Deployments and StatefulSets in every mode."""
    namespace, release = "modes", "kvtune-modes"
    system = f"{release}-system"
    if cluster.helm("status", release, "--namespace", system, check=False).returncode != 0:
        install(cluster, release, namespace, max_mode="Recommend")
    settings = [arg for value in values for arg in ("--set", value)]
    cluster.helm("upgrade", release, str(CHART), "--namespace", system, "--reuse-values",
                 "--set", "rbac.allowUndo=false", *settings)  # fmt: skip
    kubeconfig = cluster.service_account_kubeconfig(release, system)
    # the RBAC authorizer reads Roles through an informer: the answer follows the upgrade within moments
    wait_for(f"the rights of {values}", lambda: rights(cluster, kubeconfig, namespace) == writes)
    assert all(can_i(cluster, kubeconfig, "get", kind, namespace) for kind in WORKLOADS[:2])


def test_under_recommend_the_authorizer_refuses_the_operators_patch(
    cluster: Cluster, vllm_engines: Any, tmp_path: Path
) -> None:
    """A release in Recommend (the chart's default) whose operator runs with its --max-mode raised to Apply
    by hand: its patch of the Deployment is refused by the API server, nothing changes, and the operator
    still reads, decides and reports, saying exactly which call was refused (the verb and the resource, in an
    Event on the policy and in its log)."""
    namespace, release = "norule", "kvtune-norule"
    install(cluster, release, namespace, max_mode="Recommend")
    kwok_node(cluster, "norule-main", "norule")
    deployment = workload(
        "Deployment", "llama-vllm", namespace, OLD_VLLM_IMAGE, ["--model", "m", "--max-num-seqs=64"]
    )
    deployment["spec"]["template"]["spec"]["nodeSelector"] = {"kvtune-e2e/pool": "norule"}
    cluster.apply(
        deployment, policy("vllm", namespace, vllm_policy("Deployment", "llama-vllm", vllm_engines(None)))
    )
    raised = chart_operator(cluster, release, f"{release}-system", tmp_path / "operator.log")
    assert raised.args[raised.args.index("--max-mode") + 1] == "Recommend", raised.args  # the release's
    raised.args[raised.args.index("--max-mode") + 1] = "Apply"
    running = raised.start()
    wait_until_peered(cluster, running, namespace, running.peering)
    try:
        refused = 'cannot patch resource "deployments" in API group "apps"'
        (failed,) = wait_for("an ApplyFailed Event", lambda: [
            e["message"] for e in cluster.events(namespace, "vllm") if e["reason"] == "ApplyFailed"][:1])  # fmt: skip
        assert refused in failed and "max_num_seqs 64 ->" in failed and "HTTP 403 Forbidden" in failed, failed
        wait_for("the refusal in the log", lambda: refused in running.output())
        assert args_of(cluster, "deployment", "llama-vllm", namespace) == [
            "--model",
            "m",
            "--max-num-seqs=64",
        ]
        assert cluster.policy(namespace, "vllm")["status"]["conditions"]  # status is still written
    finally:
        running.stop()
