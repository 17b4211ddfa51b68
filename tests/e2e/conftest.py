"""One real control plane for the whole e2e run (package scope: it goes when the last e2e test is done)
(scripts/local_cluster.py `up`, then `down`); the chart installed by the README's install block, run as
written; the same release allowed to act (`maxMode=Apply`, as the README's "Letting it act" says) for the
tests that need the operator to change a workload; the operator running as that release's ServiceAccount,
with its pod's args; and three real engines, the pods of one Service, in the run's own network namespace
(pod_network.py) where the tests' EndpointSlices point."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from kvtune.harness.engine_process import start_engine, write_tiny_model_in_subprocess
from kvtune.harness.server import ServerProcess
from tests.e2e.cluster import (
    REPO,
    Cluster,
    Operator,
    chart_operator,
    control_plane,
    readme_release,
    wait_until_peered,
)
from tests.e2e.pod_network import PodNetwork, links, namespaces, pod_network
from tests.e2e.workloads import ADMIN_TOKEN, KV_CACHE_TOKENS, MAX_NUM_SEQS
from tests.operator.pods_world import free_port

ENGINE_INDEXES = (2, 3, 4)  # the engines' addresses in the pods' /24 (test_rbac's pods take 5 and 6)
ADMIN_SECRET = "tiny-kvtune-admin"  # the kvtune engines' admin token, which the acting release may read


@pytest.fixture(scope="package")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with control_plane(tmp_path_factory.mktemp("control-plane")) as started:
        yield started


@pytest.fixture(scope="package")
def release(cluster: Cluster) -> dict[str, str]:
    """The chart installed by the README's install block, run as written (REGISTRY set; the watched
    namespace created first: the README says it must exist)."""
    installed = readme_release()
    cluster.namespace(installed["watch"])
    cluster.readme("install")
    return installed


@pytest.fixture(scope="package")
def acting_release(cluster: Cluster, release: dict[str, str]) -> dict[str, str]:
    """The README's release allowed to act, as its "Letting it act" says (`--set maxMode=Apply`), and to
    read the kvtune engines' admin-token Secret: a `helm upgrade` of the same release."""
    cluster.helm("upgrade", release["name"], str(REPO / "charts" / "kvtune"), "--namespace",
                 release["namespace"], "--reuse-values", "--set", "maxMode=Apply",
                 "--set-json", f"adminTokenSecrets={json.dumps([ADMIN_SECRET])}")  # fmt: skip
    return {**release, "secret": ADMIN_SECRET}


@pytest.fixture(scope="package")
def operator(
    cluster: Cluster, acting_release: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Operator]:
    """`kvtune operator` as the acting release's pod runs it, as its ServiceAccount."""
    folder = tmp_path_factory.mktemp("operator")
    running = chart_operator(cluster, acting_release["name"], acting_release["namespace"],
                             folder / "operator.log").start()  # fmt: skip
    assert running.args[running.args.index("--max-mode") + 1] == "Apply", running.args
    wait_until_peered(cluster, running, acting_release["watch"], running.peering)
    yield running
    running.stop()


@pytest.fixture(scope="package")
def pods() -> Iterator[PodNetwork]:
    """The run's network namespace for everything that stands in for a pod; after the run neither it nor
    its veth pair is left (`ip netns list`, `ip link`)."""
    with pod_network() as network:
        yield network
    assert network.name not in namespaces(), f"network namespace {network.name} left after the run"
    assert network.host_link not in links(), f"link {network.host_link} left after the run"


@pytest.fixture(scope="package")
def engines(pods: PodNetwork, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ServerProcess]]:
    """Three real engines (`kvtune serve`, the tiny model, a 512-token pool) in the pods' network namespace,
    one per pod address, on one port: the pods of one Service, reached from this machine through the veth."""
    folder = tmp_path_factory.mktemp("engines")
    token = folder / "token"
    token.write_text(ADMIN_TOKEN + "\n")
    model = write_tiny_model_in_subprocess(folder / "tiny")
    addresses = [pods.address(index) for index in ENGINE_INDEXES]
    port = pods.run(free_port, addresses)
    flags = ("--kv-cache-tokens", str(KV_CACHE_TOKENS), "--max-num-seqs", str(MAX_NUM_SEQS))
    with ThreadPoolExecutor(len(addresses)) as pool:  # they boot side by side, slower each on 2 cores
        booting = [pool.submit(pods.run, start_engine, model, token, folder / f"engine-{index}.log", *flags,
                               port=port, host=address, boot_timeout=240)
                   for index, address in enumerate(addresses)]  # fmt: skip
    started = [future.result() for future in booting if future.exception() is None]
    try:
        failed = [future.exception() for future in booting if future.exception() is not None]
        assert not failed, f"engines did not start: {failed}"
        for engine in started:  # from this machine, as the operator reaches them
            assert httpx.get(f"{engine.url}/health", timeout=10).status_code == 200, engine.url
        yield started
    finally:
        for engine in started:
            engine.stop()
