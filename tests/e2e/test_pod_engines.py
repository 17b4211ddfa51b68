"""A kvtune Deployment scaled as an autoscaler scales it (its scale subresource): every pod it has gets a real
engine at its status.podIP (tests/e2e/pod_engines.py), and a pod it loses takes its engine with it."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from kubernetes import client

from kvtune.harness.engine_process import write_tiny_model_in_subprocess
from kvtune.harness.server import ServerProcess
from tests.e2e.cluster import Cluster, kwok_node, wait_for
from tests.e2e.pod_engines import PodEngines
from tests.e2e.pod_network import PodNetwork
from tests.e2e.scaled_deployment import NAME, NAMESPACE, POOL, PORT, kvtune_deployment
from tests.e2e.workloads import ADMIN_TOKEN, KV_CACHE_TOKENS, MAX_NUM_SEQS

BROKEN = "broken-kvtune"  # a second Deployment, whose pods' engines cannot start


def scale(cluster: Cluster, replicas: int) -> None:
    """Through the Deployment's scale subresource, as the HorizontalPodAutoscaler and KEDA do."""
    client.AppsV1Api(cluster.api).patch_namespaced_deployment_scale(
        NAME, NAMESPACE, {"spec": {"replicas": replicas}}
    )


def pod_ips(cluster: Cluster) -> dict[str, str]:
    """The Deployment's pods that are not going, and their IPs as the API shows them."""
    pods: Any = client.CoreV1Api(cluster.api).list_namespaced_pod(NAMESPACE, label_selector=f"app={NAME}")
    return {
        pod.metadata.name: pod.status.pod_ip for pod in pods.items if pod.metadata.deletion_timestamp is None
    }


def listens(address: str, port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(2)
        return probe.connect_ex((address, port)) == 0


@pytest.fixture(scope="module")
def pod_engines(
    cluster: Cluster, pods: PodNetwork, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PodEngines]:
    """The Deployment with one replica, and an engine for each of its pods, for as long as the module runs."""
    folder = tmp_path_factory.mktemp("pod-engines")
    token = folder / "token"
    token.write_text(ADMIN_TOKEN + "\n")
    model = write_tiny_model_in_subprocess(folder / "tiny")
    cluster.namespace(NAMESPACE)
    kwok_node(cluster, f"{POOL}-0", POOL)
    cluster.apply(kvtune_deployment(replicas=1))
    flags = ("--kv-cache-tokens", str(KV_CACHE_TOKENS), "--max-num-seqs", str(MAX_NUM_SEQS))
    with PodEngines(cluster, pods, NAMESPACE, f"app={NAME}", model, token, folder / "engines", port=PORT,
                    engine_flags=flags) as engines:  # fmt: skip
        yield engines
    cluster.kubectl("delete", "deployment", NAME, "-n", NAMESPACE, "--wait=true")


def assert_serves_at_its_pod_ip(cluster: Cluster, engines: dict[str, ServerProcess]) -> None:
    """Each pod's IP, as the API shows it, is its own engine's address, where /health and vLLM's /metrics
    answer from this machine (as the operator and Prometheus reach pods)."""
    ips = pod_ips(cluster)
    assert set(ips) == set(engines), (ips, engines)
    assert len(set(ips.values())) == len(ips), ips
    for name, ip in ips.items():
        assert ip == engines[name].host, (name, ip, engines[name].url)
        assert httpx.get(f"http://{ip}:{PORT}/health", timeout=10).status_code == 200, ip
        metrics = httpx.get(f"http://{ip}:{PORT}/metrics", timeout=10)
        assert metrics.status_code == 200 and "vllm:num_requests_running" in metrics.text, (
            ip,
            metrics.text[:500],
        )


def test_each_pod_the_deployment_has_gets_an_engine_and_a_pod_that_goes_takes_it_along(
    cluster: Cluster, pod_engines: PodEngines, tmp_path: Path
) -> None:
    (first,) = pod_engines.wait_for_engines(1).items()
    assert_serves_at_its_pod_ip(cluster, dict([first]))

    scale(cluster, 3)
    three = pod_engines.wait_for_engines(3)
    assert first in three.items()  # the pod that was there keeps its engine
    assert_serves_at_its_pod_ip(cluster, three)

    scale(cluster, 1)
    (kept,) = pod_engines.wait_for_engines(1).items()
    wait_for("the API to show one pod", lambda: len(pod_ips(cluster)) == 1)
    assert_serves_at_its_pod_ip(cluster, dict([kept]))
    gone = {name: engine for name, engine in three.items() if name != kept[0]}
    assert len(gone) == 2, (three, kept)
    for name, engine in gone.items():
        assert engine.process.poll() is not None, f"the engine of removed pod {name} still runs"
        assert not listens(engine.host, PORT), f"the port of removed pod {name} is still open at {engine.url}"


def test_an_engine_that_cannot_boot_and_a_pod_with_no_address_left_are_raised(
    cluster: Cluster, pods: PodNetwork, pod_engines: PodEngines, tmp_path: Path
) -> None:
    """Neither is swallowed: the waiting caller gets the first at once, and leaving the block the second."""
    cluster.apply(kvtune_deployment(replicas=1, name=BROKEN))
    common = (cluster, pods, NAMESPACE, f"app={BROKEN}", pod_engines.model_dir, pod_engines.token_file)
    # an address the scaled Deployment's engines never reach here (they are 1 to 3), and this one never binds
    with (
        pytest.raises(RuntimeError, match=f"the engine of pod {BROKEN}-.* did not start") as failed,
        PodEngines(*common, tmp_path / "unbootable", port=PORT, engine_flags=("--no-such-flag",),
                   indexes=(15,)) as unbootable,
    ):  # fmt: skip
        unbootable.wait_for_engines(1)
    assert "--no-such-flag" in str(failed.value), failed.value  # the engine's log tail says why
    with (
        pytest.raises(RuntimeError, match=f"pod {BROKEN}-.*: all 0 pod addresses are taken"),
        PodEngines(*common, tmp_path / "starved", port=PORT, indexes=()) as starved,
    ):
        wait_for("a pod with no address left to be a failure", lambda: starved.errors)
    cluster.kubectl("delete", "deployment", BROKEN, "-n", NAMESPACE, "--wait=true")
