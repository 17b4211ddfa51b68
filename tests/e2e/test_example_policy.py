"""A chart example, installed by the README's commands, is watched and acts: the README's release (its install
block, watching `inference`, then "Letting it act": `maxMode=Apply`) upgraded with the kvtune-engine example
on. The example's Secret, Deployment, Service and policy render into the watched namespace, and the
operator, as the chart's ServiceAccount, reads the example's admin token from that Secret, reads the engine
behind the Service and lowers its `max_num_seqs` on the engine's admin API under a load that preempts.

kwok runs the example's pod without its container, so one real engine stands in for it in the run's pod
network, with the token the chart generated, and the Service's EndpointSlice names it (as the EndpointSlice
controller would name the pod)."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvtune.harness.engine_process import start_engine, write_tiny_model_in_subprocess
from kvtune.harness.server import ServerProcess
from tests.e2e.cluster import CHART, REGISTRY, Cluster, Operator, wait_for
from tests.e2e.pod_network import PodNetwork
from tests.e2e.workloads import KV_CACHE_TOKENS, MAX_NUM_SEQS, endpoint_slice, preempting_load

ENGINE_INDEX = (
    8  # the example engine's address in the pods' /24 (the package's engines take 2-4, test_rbac 5-6)
)
PORT = 8000  # the example's container port: /metrics and the admin API


def example_name(release: dict[str, str]) -> str:
    return f"{release['name']}-example-engine"


@pytest.fixture(scope="module")
def example(
    cluster: Cluster, acting_release: dict[str, str], operator: Operator, pods: PodNetwork,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, Any]]:  # fmt: skip
    """The example on (policy in Apply), its engine up with the chart's token behind its Service; the
    example off again after, so the shared release is as the other tests found it."""
    upgrade = ("upgrade", acting_release["name"], str(CHART), "--namespace", acting_release["namespace"],
               "--reuse-values")  # fmt: skip
    cluster.helm(*upgrade, "--set", "examples.kvtuneEngine.enabled=true",
                 "--set", f"examples.kvtuneEngine.image.repository={REGISTRY}/kvtune-engine",
                 "--set", f"examples.kvtuneEngine.kvCacheTokens={KV_CACHE_TOKENS}",
                 "--set", f"examples.kvtuneEngine.maxNumSeqs={MAX_NUM_SEQS}",
                 "--set", "examples.kvtuneEngine.policyMode=Apply")  # fmt: skip
    namespace, name = acting_release["watch"], example_name(acting_release)
    secret = cluster.get("secret", f"{name}-admin", namespace)
    token = base64.b64decode(secret["data"]["token"]).decode()
    folder = tmp_path_factory.mktemp("example-engine")
    token_file = folder / "token"
    token_file.write_text(token + "\n")
    address = pods.address(ENGINE_INDEX)
    engine = pods.run(start_engine, write_tiny_model_in_subprocess(folder / "tiny"), token_file,
                      folder / "engine.log", "--kv-cache-tokens", str(KV_CACHE_TOKENS),
                      "--max-num-seqs", str(MAX_NUM_SEQS), port=PORT, host=address, boot_timeout=240)  # fmt: skip
    try:
        cluster.kubectl("rollout", "status", f"deployment/{name}", "-n", namespace, "--timeout", "90s")
        (pod,) = json.loads(cluster.kubectl("get", "pods", "-n", namespace, "-l",
                                            "app.kubernetes.io/component=example-engine", "-o", "json").stdout)["items"]  # fmt: skip
        cluster.apply(endpoint_slice(namespace, name, PORT, {pod["metadata"]["name"]: address}))
        yield {"namespace": namespace, "name": name, "engine": engine, "token": token}
    finally:
        cluster.helm(*upgrade, "--set", "examples.kvtuneEngine.enabled=false")
        wait_for("the example's policy gone with it", lambda: cluster.kubectl(
            "get", "kvtp", name, "-n", namespace, check=False).returncode != 0)  # fmt: skip
        engine.stop()


def max_num_seqs(engine: ServerProcess, token: str) -> int:
    answer = httpx.get(f"{engine.url}/admin/config", headers={"Authorization": f"Bearer {token}"}, timeout=10)
    answer.raise_for_status()
    return int(answer.json()["max_num_seqs"])


def test_the_examples_render_into_the_watched_namespace(cluster: Cluster, example: dict[str, Any]) -> None:
    namespace, name = example["namespace"], example["name"]
    for kind in ("secret", "deployment", "service", "kvtp"):
        assert cluster.get(kind, name if kind != "secret" else f"{name}-admin", namespace)


def test_the_example_policy_is_watched_and_acts(cluster: Cluster, example: dict[str, Any]) -> None:
    namespace, name, engine = example["namespace"], example["name"], example["engine"]
    with preempting_load([engine]):
        (applied,) = wait_for("the operator to act on the example's policy", lambda: [
            e["message"] for e in cluster.events(namespace, name) if e["reason"] == "TuningApplied"])  # fmt: skip
    value = max_num_seqs(engine, example["token"])
    assert value < MAX_NUM_SEQS and f"max_num_seqs: {MAX_NUM_SEQS} -> {value}" in applied, applied
    status = cluster.policy(namespace, name)["status"]
    assert status["mode"] == "Apply", status
