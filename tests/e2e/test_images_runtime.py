"""The release's images run by a real OCI runtime, as the chart runs them (oci_runtime.py).

- The chart is installed from the release's package with the operator's image pinned by the digest the
  release wrote. That Deployment's container is run by runc from the release's archive: the pod's user
  (65532) and fsGroup, a read-only root filesystem, no capabilities, no privilege escalation, an emptyDir
  /tmp and the ServiceAccount token a pod is given, in this machine's network namespace. The kernel is asked
  whether each of those took effect. The operator joins its peering as the chart's ServiceAccount (the real
  authorizer judges every call), answers the chart's probe, and writes a recommendation for a real kvtune
  engine under a load that preempts, changing nothing on the engine.
- The proxy image, run as the chart's vllmProxy example runs its sidecar (its args, securityContext and
  volumes: the model read-only, the admin token 0440 for the pod's group), serves a completion from a real
  engine and counts it in its metrics.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlsplit

import httpx
import pytest
import yaml

from kvtune.harness.local_http import free_port
from kvtune.harness.server import ServerProcess
from tests.chart.release_build import artifact, digest, version
from tests.e2e.cluster import REGISTRY, Cluster, peers, wait_for
from tests.e2e.oci_runtime import (
    SERVICE_ACCOUNT_DIR,
    Container,
    Mount,
    hosts_file,
    image_config,
    process_identity,
    require,
    require_root,
    runtime_config,
    service_account_files,
    unpack,
)
from tests.e2e.service_relay import service_relay
from tests.e2e.workloads import ADMIN_TOKEN, preempting_load

RELEASE = "pinned"  # its objects are pinned-kvtune
SYSTEM = "images-e2e-system"
NAMESPACE = "images-e2e"  # what the release watches
SECRET = "tiny-images-admin"
POLICY = "tiny-images"
PROXY_TOKEN = "e2e-proxy-admin-token"
RECOMMEND_WAIT_S = 240.0  # the policy samples every second; a first recommendation takes about a window
NO_CAPABILITIES = "0000000000000000"


@pytest.fixture(scope="module")
def runtime() -> None:
    """Root and Debian's runc, umoci and skopeo, or a one-line failure saying which is missing."""
    require_root()
    for name in ("runc", "umoci", "skopeo"):
        require(name)


def pinned_values(image: str) -> list[str]:
    """`--set` flags naming the release's image in REGISTRY by its tag and its digest."""
    return [
        "--set",
        f"image.repository={REGISTRY}/kvtune-{image}",
        "--set",
        f"image.tag={version()}@{digest(image)}",
    ]


@pytest.fixture(scope="module")
def pinned(cluster: Cluster, runtime: None) -> Iterator[dict[str, Any]]:
    """The chart from the release's package, its operator image pinned by digest, watching NAMESPACE and
    allowed to read the engine's admin-token Secret."""
    cluster.namespace(NAMESPACE)
    cluster.helm("install", RELEASE, str(artifact("chart")), "--namespace", SYSTEM, "--create-namespace",
                 *pinned_values("operator"), "--set-json", f'watchNamespaces=["{NAMESPACE}"]',
                 "--set-json", f'adminTokenSecrets=["{SECRET}"]')  # fmt: skip
    deployment = cluster.get("deployment", f"{RELEASE}-kvtune", SYSTEM)
    try:
        yield deployment
    finally:
        cluster.helm("uninstall", RELEASE, "--namespace", SYSTEM, check=False)


def volume_mounts(container: dict[str, Any], pod: dict[str, Any], sources: dict[str, Path]) -> list[Mount]:
    """The container's volumeMounts as runtime mounts: an emptyDir is a tmpfs of its sizeLimit, any other
    volume the host folder `sources` names for it (what a kubelet would have put there)."""
    volumes = {volume["name"]: volume for volume in pod.get("volumes") or []}
    mounts = []
    for mount in container.get("volumeMounts") or []:
        volume = volumes[mount["name"]]
        if "emptyDir" in volume:
            limit = str(volume["emptyDir"].get("sizeLimit", "64Mi"))
            size = (
                int(limit.removesuffix("Mi"))
                if limit.endswith("Mi")
                else int(limit.removesuffix("Gi")) * 1024
            )
            mounts.append(Mount(mount["mountPath"], size_mib=size))
        else:
            mounts.append(Mount(mount["mountPath"], sources[mount["name"]], read_only=True))
    return mounts


def with_ports(args: list[str], ports: dict[str, int]) -> list[str]:
    """The args with each `--flag VALUE` of `ports` given a free port (every container here shares this
    machine's network, where a pod's fixed ports may be taken)."""
    changed = list(args)
    for flag, port in ports.items():
        changed[changed.index(flag) + 1] = str(port)
    return changed


def run_container(archive: Path, folder: Path, container: dict[str, Any], pod: dict[str, Any],
                  mounts: list[Mount], env: dict[str, str], name: str) -> Container:  # fmt: skip
    """The container unpacked from the release's archive and started by runc, as the pod spec says; the
    cluster's DNS name of the API server points at the kubernetes Service's relay (service_relay.py)."""
    bundle = folder / "bundle"
    config = unpack(archive, bundle)
    hosts = hosts_file(folder / "hosts", name, {"kubernetes.default.svc": "127.0.0.1"})
    spec = runtime_config(config, image_config(archive), container, pod.get("securityContext") or {},
                          [*mounts, Mount("/etc/hosts", hosts, read_only=True)], env, name)  # fmt: skip
    state = folder / "runc"
    state.mkdir()
    return Container(bundle, f"{name}-{os.getpid()}", folder / f"{name}.log", state).start(spec)


def assert_as_the_chart_asks(running: Container) -> dict[str, str]:
    """The container's process as the kernel sees it: the pod's user and group, no capability, no privilege
    escalation, a read-only root filesystem."""
    pid = wait_for("runc to start the container", lambda: running.pid() or (not running.running() and -1))
    assert pid > 0, running.output()[-3000:]
    identity = process_identity(pid)
    assert (identity["uid"], identity["gid"]) == ("65532", "65532"), identity
    assert "65532" in identity["groups"].split(), identity  # the pod's fsGroup
    assert identity["capabilities"] == identity["bounding"] == NO_CAPABILITIES, identity
    assert identity["no_new_privs"] == "1", identity
    assert identity["root"].split(",")[0] == "ro", identity
    return identity


@pytest.fixture(scope="module")
def operator_container(
    cluster: Cluster, pinned: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    """The release's Deployment's operator container, run from the release's archive by runc, with a token
    of the chart's ServiceAccount where a pod finds it and the API server where a pod is told it is."""
    folder = tmp_path_factory.mktemp("operator-image")
    pod = pinned["spec"]["template"]["spec"]
    (container,) = [c for c in pod["containers"] if c["name"] == "operator"]
    assert container["image"] == f"{REGISTRY}/kvtune-operator:{version()}@{digest('operator')}", container
    health = free_port()
    container = {**container, "args": with_ports(container["args"], {"--metrics-port": free_port(),
                                                                     "--liveness-port": health})}  # fmt: skip
    kubeconfig = json.loads(cluster.service_account_kubeconfig(pod["serviceAccountName"], SYSTEM).read_text())
    token = kubeconfig["users"][0]["user"]["token"]
    account = service_account_files(
        folder / "serviceaccount", token, cluster.folder / "pki" / "ca.crt", SYSTEM
    )
    mounts = [*volume_mounts(container, pod, {}), Mount(SERVICE_ACCOUNT_DIR, account, read_only=True)]
    peering = container["args"][container["args"].index("--peering") + 1]
    with service_relay(int(urlsplit(cluster.server).port or 0)) as port:
        env = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(port)}  # as in a pod
        running = run_container(artifact("operator"), folder, container, pod, mounts, env, "kvtune-operator")
        try:
            wait_for(f"the operator in its image to join the KopfPeering {NAMESPACE}/{peering}",
                     lambda: peers(cluster, NAMESPACE, peering) or not running.running())  # fmt: skip
            assert running.running(), running.output()[-3000:]
            yield {"container": running, "health": health}
        finally:
            running.stop()
    assert "Traceback" not in running.output(), running.output()[-3000:]


def answers(url: str) -> bool:
    """Whether `url` answers 200 (a probe: refused or timed out is not yet)."""
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def engine_admin(engine: ServerProcess) -> dict[str, Any]:
    answer = httpx.get(
        f"{engine.url}/admin/config", timeout=10, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
    )
    answer.raise_for_status()
    found: dict[str, Any] = answer.json()
    return found


def kvtune_policy(engine: ServerProcess) -> dict[str, Any]:
    """A Recommend policy over one kvtune engine, read and asked directly, sampled every second."""
    return {
        "apiVersion": "kvtune.dev/v1alpha1", "kind": "KVTuningPolicy",
        "metadata": {"name": POLICY, "namespace": NAMESPACE},
        "spec": {"target": {"name": "tiny", "engine": "kvtune", "adminUrl": engine.url,
                            "adminTokenSecretRef": {"name": SECRET}},
                 "metrics": {"metricsUrl": f"{engine.url}/metrics"}, "mode": "Recommend",
                 "bounds": {"minMaxNumSeqs": 2, "maxMaxNumSeqs": 256},
                 "intervalSeconds": 1, "evaluationWindowSeconds": 600, "cooldownSeconds": 0},
    }  # fmt: skip


def test_the_operator_image_acts_on_a_policy_as_the_charts_service_account(
    cluster: Cluster, operator_container: dict[str, Any], engines: list[ServerProcess]
) -> None:
    running: Container = operator_container["container"]
    assert_as_the_chart_asks(running)
    probe = f"http://127.0.0.1:{operator_container['health']}/healthz"  # the chart's liveness and readiness
    wait_for("the chart's probe to pass", lambda: answers(probe))

    engine = engines[0]
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": SECRET, "namespace": NAMESPACE},
              "data": {"token": base64.b64encode(ADMIN_TOKEN.encode()).decode()}}  # fmt: skip
    before = engine_admin(engine)["max_num_seqs"]
    try:
        with preempting_load([engine]):
            cluster.apply(secret, kvtune_policy(engine))
            status = wait_for("a recommendation in the policy's status",
                              lambda: (cluster.policy(NAMESPACE, POLICY).get("status") or {}).get("recommended"),
                              timeout=RECOMMEND_WAIT_S)  # fmt: skip
            recommended = wait_for("the TuningRecommended Event", lambda: [
                e["message"] for e in cluster.events(NAMESPACE, POLICY) if e["reason"] == "TuningRecommended"])  # fmt: skip
        assert status["maxNumSeqs"] < before, (status, recommended)
        assert engine_admin(engine)["max_num_seqs"] == before  # Recommend changes nothing
        warnings = [e["message"] for e in cluster.events(NAMESPACE, POLICY) if e["type"] == "Warning"]
        assert not [m for m in warnings if "forbidden" in m.lower()], warnings
        assert running.running(), running.output()[-3000:]
    finally:  # deleted while the operator runs, which takes kopf's finalizer off
        cluster.kubectl("delete", "kvtp", POLICY, "-n", NAMESPACE, "--ignore-not-found", "--wait=true")


def proxy_sidecar(cluster: Cluster) -> tuple[dict[str, Any], dict[str, Any]]:
    """The chart's vllmProxy example, rendered from the release's package with the proxy image pinned by
    digest: its kvtune-proxy container and its pod spec."""
    values = ["--set", "examples.vllmProxy.enabled=true", "--set", "examples.vllmProxy.vllmImage.tag=v0.32.0",
              "--set", "examples.vllmProxy.modelClaimName=models",
              "--set", f"examples.vllmProxy.proxyImage.repository={REGISTRY}/kvtune-proxy",
              "--set", f"examples.vllmProxy.proxyImage.tag={version()}@{digest('proxy')}"]  # fmt: skip
    rendered = cluster.helm("template", RELEASE, str(artifact("chart")), "--namespace", SYSTEM,
                            *pinned_values("operator"), *values).stdout  # fmt: skip
    (deployment,) = [d for d in yaml.safe_load_all(rendered) if d and d["kind"] == "Deployment"
                     and d["metadata"]["name"].endswith("example-vllm")]  # fmt: skip
    pod = deployment["spec"]["template"]["spec"]
    (container,) = [c for c in pod["containers"] if c["name"] == "kvtune-proxy"]
    assert container["image"] == f"{REGISTRY}/kvtune-proxy:{version()}@{digest('proxy')}", container
    return container, pod


def secret_volume(folder: Path, token: str) -> Path:
    """The admin-token Secret as a kubelet mounts it with the example's defaultMode 0440 and the pod's fsGroup."""
    folder.mkdir()
    (folder / "token").write_text(token)
    os.chown(folder / "token", 0, 65532)
    (folder / "token").chmod(0o440)
    folder.chmod(0o755)
    return folder


def test_the_proxy_image_serves_a_completion_as_the_charts_sidecar(
    cluster: Cluster, runtime: None, engines: list[ServerProcess], tmp_path: Path
) -> None:
    container, pod = proxy_sidecar(cluster)
    engine = engines[0]
    args = list(container["args"])
    model_path = args[args.index("--model-dir") + 1]  # /models/<modelDir> in the pod
    models = tmp_path / "models"
    command = [str(word) for word in cast(list[str], engine.process.args)]  # the engine's own argv
    model = Path(command[command.index("--model") + 1])
    shutil.copytree(model, models / Path(model_path).name)
    for path in [models, *models.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    port, admin = free_port(), free_port()
    args = with_ports(args, {"--port": port, "--admin-port": admin})
    args[args.index("--upstream") + 1] = engine.url  # the engine in its pod, for vLLM on the pod's localhost
    container = {**container, "args": args}
    sources = {"model": models, "admin-token": secret_volume(tmp_path / "admin-token", PROXY_TOKEN)}
    running = run_container(artifact("proxy"), tmp_path, container, pod, volume_mounts(container, pod, sources),
                            {}, "kvtune-proxy")  # fmt: skip
    try:
        assert_as_the_chart_asks(running)
        url = f"http://127.0.0.1:{port}"
        wait_for("the chart's readiness probe (/health) to pass",
                 lambda: not running.running() or answers(f"{url}/health"))  # fmt: skip
        assert running.running(), running.output()[-3000:]
        answer = httpx.post(f"{url}/v1/completions", timeout=60,
                            json={"model": "tiny", "prompt": "The KV cache holds", "max_tokens": 8})  # fmt: skip
        assert answer.status_code == 200, answer.text
        completion = answer.json()
        assert completion["choices"][0]["text"] and completion["usage"]["completion_tokens"] > 0, completion
        guarded = httpx.get(f"http://127.0.0.1:{admin}/admin/config", timeout=10,
                            headers={"Authorization": f"Bearer {PROXY_TOKEN}"})  # fmt: skip
        assert guarded.status_code == 200, guarded.text  # it read the token mounted for its group
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        assert "kvtune:" in metrics, metrics[:2000]
    finally:
        running.stop()
    assert "Traceback" not in running.output(), running.output()[-3000:]
