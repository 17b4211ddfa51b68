"""One real control plane for the whole e2e run (package scope: it goes when the last e2e test is done) (scripts/local_cluster.py `up`, then `down`), the chart
installed the way the README's install section says, the operator running as that release's ServiceAccount,
and three real engines on loopback that the tests' EndpointSlices point at."""

from __future__ import annotations

import re
import shlex
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import yaml
from kubernetes import config

from kvtune.bench.engine_process import EngineProcess, start_engine, write_tiny_model
from tests.e2e.cluster import REPO, Cluster, Operator, local_cluster, wait_until_peered
from tests.e2e.workloads import ADMIN_TOKEN, KV_CACHE_TOKENS, MAX_NUM_SEQS
from tests.operator.test_pods_kmock import free_port

README_SECTION = "## Install in a cluster"
# The API server refuses loopback addresses in an EndpointSlice (as it should: a pod is never at 127.x), so
# the "pods" listen on addresses of a /24 of the pod network that the e2e run routes to this machine's
# loopback (`ip route add local ... dev lo`, removed after): real pod-like addresses, nothing leaves the host.
POD_SUBNET = "10.244.255.0/24"
ENGINE_ADDRESSES = ("10.244.255.2", "10.244.255.3", "10.244.255.4")


@pytest.fixture(scope="package")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    lc = local_cluster()
    bins = lc.kbins_dir()
    missing = lc.missing_binaries(bins)
    if missing:
        pytest.fail(
            f"the local control plane's binaries are missing from {bins} ({', '.join(missing)}): run `make "
            "k8s-tools` (python scripts/local_cluster.py build; ~25 min once, from the Go module proxy), which "
            "`make test` does",
            pytrace=False,
        )
    folder = tmp_path_factory.mktemp("control-plane")
    began = time.monotonic()
    started = lc.up(folder, bins)
    print(f"control plane up in {time.monotonic() - began:.1f} s at {started.server}")
    api = config.new_client_from_config(config_file=str(started.kubeconfig))
    state = (folder / lc.STATE_FILE).read_text()
    ports = sorted({int(port) for port in re.findall(r"127\.0\.0\.1:(\d+)", state)})
    try:
        yield Cluster(folder, started.kubeconfig, started.server, api)
    finally:
        api.close()
        lc.down(folder)
    left = [name for name, pid in started.pids.items() if lc.alive(pid, name)]
    assert not left, f"`down` left {left} running"
    listening = [port for port in ports if accepts(port)]
    assert not listening, f"`down` left ports {listening} open"


def accepts(port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(1)
        return probe.connect_ex(("127.0.0.1", port)) == 0


def readme_install_command() -> str:
    """The first `helm install` of the README's install section, joined across its continuation lines."""
    text = (REPO / "README.md").read_text()
    section = text[text.index(README_SECTION) :]
    block = section[section.index("```sh") + len("```sh") : section.index("```", section.index("```sh") + 5)]
    command = block.replace("\\\n", " ")
    line = next(line for line in command.splitlines() if line.strip().startswith("helm install"))
    return " ".join(line.split())


@pytest.fixture(scope="package")
def release(cluster: Cluster) -> dict[str, str]:
    """The chart installed exactly as the README says (its watched namespace created first, as it would
    exist in a user's cluster)."""
    command = shlex.split(readme_install_command())
    assert command[:2] == ["helm", "install"], command
    watched = yaml.safe_load(next(a.split("=", 1)[1] for a in command if a.startswith("watchNamespaces=")))
    secrets = yaml.safe_load(next(a.split("=", 1)[1] for a in command if a.startswith("adminTokenSecrets=")))
    namespace = command[command.index("--namespace") + 1]
    for watched_namespace in watched:
        cluster.namespace(watched_namespace)
    cluster.helm(*command[1:])
    return {"name": command[2], "namespace": namespace, "watch": watched[0], "secret": secrets[0]}


@pytest.fixture(scope="package")
def operator(
    cluster: Cluster, release: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Operator]:
    """`kvtune operator` for the README release's watched namespace, as the release's ServiceAccount."""
    folder = tmp_path_factory.mktemp("operator")
    account = release["name"]  # the chart names its ServiceAccount after the release (fullname)
    kubeconfig = cluster.service_account_kubeconfig(account, release["namespace"])
    running = Operator(["--namespace", release["watch"], "--peering", account], kubeconfig,
                       folder / "operator.log").start()  # fmt: skip
    wait_until_peered(cluster, running, release["watch"], account)
    yield running
    running.stop()


@pytest.fixture(scope="package")
def pod_addresses() -> Iterator[str]:
    """POD_SUBNET answering on this machine for the whole run (its route removed after, when it was added
    here)."""
    ip = shutil.which("ip")
    if ip is None:
        pytest.fail("`ip` (iproute2) is not on PATH: the e2e run routes its pods' subnet to loopback with it "
                    "(apt-get install iproute2)", pytrace=False)  # fmt: skip
    present = subprocess.run(
        [ip, "route", "show", "table", "local", POD_SUBNET], capture_output=True, text=True
    )
    added = False
    if POD_SUBNET not in present.stdout:
        done = subprocess.run(
            [ip, "route", "add", "local", POD_SUBNET, "dev", "lo"], capture_output=True, text=True
        )
        if done.returncode != 0:
            pytest.fail(f"`ip route add local {POD_SUBNET} dev lo` failed ({done.stderr.strip()}): the e2e run "
                        "needs root with CAP_NET_ADMIN to give its pods addresses the API server accepts",
                        pytrace=False)  # fmt: skip
        added = True
    try:
        yield POD_SUBNET
    finally:
        if added:
            subprocess.run(
                [ip, "route", "del", "local", POD_SUBNET, "dev", "lo"], capture_output=True, check=True
            )


@pytest.fixture(scope="package")
def engines(pod_addresses: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[EngineProcess]]:
    """Three real engines (`kvtune serve`, the tiny model, a 512-token pool), one per pod address, on one
    port: the pods of one Service."""
    folder = tmp_path_factory.mktemp("engines")
    token = folder / "token"
    token.write_text(ADMIN_TOKEN + "\n")
    model = write_tiny_model(folder / "tiny")
    port = free_port(list(ENGINE_ADDRESSES))
    flags = ("--kv-cache-tokens", str(KV_CACHE_TOKENS), "--max-num-seqs", str(MAX_NUM_SEQS))
    with ThreadPoolExecutor(len(ENGINE_ADDRESSES)) as pool:  # they boot side by side, slower each on 2 cores
        booting = [pool.submit(start_engine, model, token, folder / f"engine-{index}.log", *flags, port=port,
                               host=address, boot_timeout=240) for index, address in enumerate(ENGINE_ADDRESSES)]  # fmt: skip
    started = [future.result() for future in booting if future.exception() is None]
    try:
        failed = [future.exception() for future in booting if future.exception() is not None]
        assert not failed, f"engines did not start: {failed}"
        yield started
    finally:
        for engine in started:
            engine.stop()
