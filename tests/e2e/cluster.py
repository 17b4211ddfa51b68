"""The e2e tests' view of the local control plane (scripts/local_cluster.py): the admin's API client, kubectl
and helm against it, the operator as a process with a ServiceAccount's token, and waiting for events.

Without the binaries the tests FAIL with the command that builds them, never skip: `make test` builds them
(`make k8s-tools`), so a run that lacks them is a broken setup, not an optional part.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import pytest
import yaml
from kubernetes import client, config

from tests.chart.monitoring_crds import monitoring_crds
from tests.chart.readme_blocks import readme_block
from tests.chart.release_build import built_release

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kvtune"
WAIT_S = 90.0  # catches a hang; every wait ends as soon as its event happens
# The registry a reader of the README pushed the operator's image to. Nothing pulls it: kwok "runs" pods
# without containers, and the tests run the operator as a process on this machine (test_images_runtime.py
# runs the release's image itself, with runc).
REGISTRY = "registry.example.com/platform"
BLOCK_TIMEOUT_S = 300.0  # a README block that takes longer hangs (each normally ends in seconds)
T = TypeVar("T")


def local_cluster() -> ModuleType:
    """scripts/local_cluster.py, the same module `make k8s-tools` and a user's `up` / `down` run."""
    loaded = sys.modules.get("local_cluster")
    if loaded is not None:
        return loaded
    spec = importlib.util.spec_from_file_location("local_cluster", REPO / "scripts" / "local_cluster.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["local_cluster"] = module
    spec.loader.exec_module(module)
    return module


def tool(name: str) -> str:
    """helm or kubectl: on PATH, beside this Python, or in the repository's .venv/bin."""
    for candidate in (shutil.which(name), Path(sys.executable).parent / name, REPO / ".venv" / "bin" / name):
        if candidate is not None and Path(candidate).is_file():
            return str(candidate)
    pytest.fail(f"`{name}` not found: run `make helm-tools` (python scripts/install_helm.py .venv/bin), which "
                "`make test` does", pytrace=False)  # fmt: skip


def wait_for(what: str, check: Callable[[], T | None], timeout: float = WAIT_S, every: float = 0.25) -> T:
    """Poll `check` until it returns something truthy (returned); a hang fails naming `what`."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(every)
    raise AssertionError(f"{what}: not within {timeout:.0f} s (last: {last!r:.500})")


def accepts(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as probe:
        probe.settimeout(1)
        return probe.connect_ex((host, port)) == 0


@contextmanager
def control_plane(folder: Path, monitoring: bool = False, keda: bool = False) -> Iterator[Cluster]:
    """scripts/local_cluster.py `up` in `folder` (with `--monitoring`: prometheus-operator, Prometheus 3 and
    Alertmanager too; with `--keda`: KEDA's operator and metrics server), and `down` after, which must leave no
    process it started and no port it listened on."""
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
    stacks = ((monitoring, "the monitoring stack's", lc.monitoring_stack, "monbins_dir", "monitoring"),
              (keda, "KEDA's", lc.keda_stack, "kedabins_dir", "keda"))  # fmt: skip
    for wanted, whose, load, directory, name in stacks:
        stack = load() if wanted else None
        cache = getattr(stack, directory)() if stack is not None else None
        absent = stack.missing(cache) if stack is not None else []
        if absent:
            pytest.fail(
                f"{whose} binaries are missing from {cache} ({', '.join(absent)}): run `make {name}-tools` "
                f"(python3 scripts/local_{name}.py build, from the Go module proxy, once per machine), which "
                "`make test` does",
                pytrace=False,
            )
    began = time.monotonic()
    started = lc.up(folder, bins, monitoring=monitoring, keda=keda)
    print(f"control plane up in {time.monotonic() - began:.1f} s at {started.server}")
    api = config.new_client_from_config(config_file=str(started.kubeconfig))
    state = (folder / lc.STATE_FILE).read_text()
    urls: dict[str, str] = json.loads((folder / "monitoring.json").read_text()) if monitoring else {}
    addresses: dict[str, str] = json.loads((folder / "keda.json").read_text()) if keda else {}
    text = state + json.dumps(urls) + json.dumps(addresses)
    ports = sorted({(host, int(port)) for host, port in re.findall(r"(\d+\.\d+\.\d+\.\d+):(\d+)", text)})
    try:
        yield Cluster(folder, started.kubeconfig, started.server, api, urls, addresses)
    finally:
        api.close()
        lc.down(folder)
    left = [name for name, pid in started.pids.items() if lc.alive(pid, name)]
    assert not left, f"`down` left {left} running"
    listening = [f"{host}:{port}" for host, port in ports if accepts(port, host)]
    assert not listening, f"`down` left ports {listening} open"


@dataclass
class Cluster:
    """The running control plane, as its admin."""

    folder: Path
    kubeconfig: Path
    server: str
    api: client.ApiClient
    monitoring: dict[str, str] = field(default_factory=dict)  # `up --monitoring`: prometheus, alertmanager
    keda: dict[str, str] = field(default_factory=dict)  # `up --keda`: its servers' addresses (DIR/keda.json)

    def env(self, kubeconfig: Path | None = None) -> dict[str, str]:
        return {**os.environ, "KUBECONFIG": str(kubeconfig or self.kubeconfig)}

    def run(self, name: str, *args: str, check: bool = True, stdin: str | None = None,
            kubeconfig: Path | None = None) -> subprocess.CompletedProcess[str]:  # fmt: skip
        done = subprocess.run([tool(name), *args], capture_output=True, text=True, input=stdin, timeout=180,
                              env=self.env(kubeconfig))  # fmt: skip
        if check and done.returncode != 0:
            raise AssertionError(
                f"`{name} {' '.join(args)}` failed ({done.returncode}): {done.stderr.strip()}"
            )
        return done

    def readme(self, block: str, timeout: float = BLOCK_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
        """The README's shell block marked `<!-- e2e:BLOCK -->`, as written, in bash from the repository's
        root, with REGISTRY and RELEASE (the release `make release-artifacts` built) set and helm and kubectl
        on PATH, as a reader would paste it (-e: the first failing command fails it). It must end within
        `timeout` (a hang fails)."""
        script = readme_block(block)
        tools = os.pathsep.join(dict.fromkeys(str(Path(tool(name)).parent) for name in ("helm", "kubectl")))
        env = {**self.env(), "REGISTRY": REGISTRY, "RELEASE": str(built_release()),
               "PATH": f"{tools}{os.pathsep}{os.environ.get('PATH', '')}"}  # fmt: skip
        try:
            done = subprocess.run(["bash", "-e", "-u", "-o", "pipefail", "-c", script], capture_output=True,
                                  text=True, timeout=timeout, env=env, cwd=REPO)  # fmt: skip
        except subprocess.TimeoutExpired as hung:
            raise AssertionError(f"the README's {block} block did not end within {timeout:.0f} s:\n{script}\n"
                                 f"{hung.stdout!r:.2000}\n{hung.stderr!r:.2000}") from None  # fmt: skip
        assert done.returncode == 0, (
            f"the README's {block} block failed ({done.returncode}):\n{script}\n{done.stdout}\n{done.stderr}"
        )
        return done

    def kubectl(self, *args: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        return self.run("kubectl", *args, **kwargs)

    def helm(self, *args: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        return self.run("helm", *args, **kwargs)

    def apply(self, *objects: dict[str, Any], extra: tuple[str, ...] = ()) -> None:
        """`kubectl apply` of these objects, as a user would."""
        self.kubectl("apply", "-f", "-", *extra, stdin=yaml.safe_dump_all(objects))

    def get(self, kind: str, name: str, namespace: str) -> dict[str, Any]:
        found: dict[str, Any] = json.loads(
            self.kubectl("get", kind, name, "-n", namespace, "-o", "json", "--show-managed-fields").stdout
        )
        return found

    def namespace(self, name: str) -> str:
        self.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
        wait_for(f"the default ServiceAccount of {name}",
                 lambda: self.kubectl("get", "sa", "default", "-n", name, check=False).returncode == 0)  # fmt: skip
        return name

    def service_account_kubeconfig(self, account: str, namespace: str) -> Path:
        """A kubeconfig holding a TokenRequest token of `account` (local_cluster.py `token`)."""
        path: Path = local_cluster().service_account_kubeconfig(self.folder, namespace, account)
        return path

    def events(self, namespace: str, involved: str | None = None) -> list[dict[str, Any]]:
        items = client.CoreV1Api(self.api).list_namespaced_event(namespace).to_dict()["items"]
        return [e for e in items if involved is None or e["involved_object"]["name"] == involved]

    def policy(self, namespace: str, name: str) -> dict[str, Any]:
        found: dict[str, Any] = client.CustomObjectsApi(self.api).get_namespaced_custom_object(
            "kvtune.dev", "v1alpha1", namespace, "kvtuningpolicies", name
        )
        return found

    def condition(self, namespace: str, name: str, kind: str) -> dict[str, Any] | None:
        conditions = self.policy(namespace, name).get("status", {}).get("conditions", [])
        return next((c for c in conditions if c["type"] == kind), None)

    def evaluations(self, namespace: str, name: str, count: int) -> None:
        """Wait until the operator has evaluated the policy `count` more times."""
        seen: list[str] = []

        def more() -> bool:
            stamp = self.policy(namespace, name).get("status", {}).get("lastEvaluationTime")
            if stamp and (not seen or seen[-1] != stamp):
                seen.append(stamp)
            return len(seen) > count

        wait_for(f"{count} evaluations of {namespace}/{name}", more)


def serve_monitoring_crds(cluster: Cluster) -> list[dict[str, Any]]:
    """The Prometheus Operator's own CRDs (ServiceMonitor, PodMonitor, PrometheusRule), created and
    established, and monitoring.coreos.com/v1 in discovery (so helm renders the chart's monitoring objects).
    Server-side apply: the CRDs are too large for client-side apply's last-applied annotation."""
    crds = monitoring_crds()
    cluster.kubectl("apply", "--server-side", "-f", "-", stdin=yaml.safe_dump_all(crds))
    for crd in crds:
        cluster.kubectl(
            "wait", "--for=condition=Established", f"crd/{crd['metadata']['name']}", "--timeout=60s"
        )
    wait_for("monitoring.coreos.com/v1 in discovery",
             lambda: "monitoring.coreos.com/v1" in cluster.kubectl("api-versions").stdout)  # fmt: skip
    return crds


def readme_release() -> dict[str, str]:
    """What the README's install block installs: the release's name and namespace and the namespace it
    watches, read from its `helm install` (a change to the block changes what the tests expect)."""
    joined = readme_block("install").replace("\\\n", " ")
    (line,) = [line for line in joined.splitlines() if line.strip().startswith("helm install")]
    words = shlex.split(line)
    (watch,) = yaml.safe_load(next(w.split("=", 1)[1] for w in words if w.startswith("watchNamespaces=")))
    return {"name": words[2], "namespace": words[words.index("--namespace") + 1], "watch": watch}


def kwok_node(cluster: Cluster, name: str, pool: str, pods: int | None = None) -> None:
    """A node kwok runs pods on, labelled `kvtune-e2e/pool=POOL` (a workload's nodeSelector picks it)."""
    node = local_cluster().kwok_node(name, pods)
    node["metadata"]["labels"]["kvtune-e2e/pool"] = pool
    client.CoreV1Api(cluster.api).create_node(node)
    wait_for(f"kwok to make node {name} Ready", lambda: any(
        c.type == "Ready" and c.status == "True"
        for c in client.CoreV1Api(cluster.api).read_node(name).status.conditions or []
    ))  # fmt: skip


def cordon(cluster: Cluster, node: str, unschedulable: bool = True) -> None:
    client.CoreV1Api(cluster.api).patch_node(node, {"spec": {"unschedulable": unschedulable}})


@dataclass
class Operator:
    """`kvtune operator` as its own process, with a ServiceAccount's kubeconfig: the real authorizer judges
    every call it makes."""

    args: list[str]
    kubeconfig: Path
    log: Path
    process: subprocess.Popen[bytes] | None = None
    metrics_port: int = 0
    extra_env: dict[str, str] = field(default_factory=dict)
    wrapper: list[str] = field(default_factory=list)  # a command it runs under (e.g. in a mount namespace)

    @property
    def peering(self) -> str:
        return self.args[self.args.index("--peering") + 1]

    def start(self) -> Operator:
        command = [*self.wrapper, sys.executable, "-m", "kvtune.cli", "operator", *self.args,
                   "--metrics-port", str(self.metrics_port)]  # fmt: skip
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig), "PYTHONUNBUFFERED": "1", **self.extra_env}
        env.pop("KUBERNETES_SERVICE_HOST", None)
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        return self

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGINT)  # kopf's graceful stop: it leaves the peering
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)


def chart_operator(cluster: Cluster, release: str, namespace: str, log: Path, **kwargs: Any) -> Operator:
    """The operator a release's pod would run, as a process here: the args of the chart's Deployment (its
    namespaces, peering and --max-mode, so the chart's maxMode holds) and a token of the chart's
    ServiceAccount. The pod's ports are left out: its metrics port is `metrics_port` (0: none), and kopf's
    health endpoint is for the kubelet's probes."""
    deployment = cluster.get("deployment", release, namespace)
    spec = deployment["spec"]["template"]["spec"]
    (container,) = [c for c in spec["containers"] if c["name"] == "operator"]
    args, kept = [str(a) for a in container["args"]], []
    assert args[0] == "operator", args
    words = iter(args[1:])
    for word in words:
        if word in ("--metrics-port", "--liveness-port"):
            next(words)
        else:
            kept.append(word)
    kubeconfig = cluster.service_account_kubeconfig(spec["serviceAccountName"], namespace)
    return Operator(kept, kubeconfig, log, **kwargs)


def peers(cluster: Cluster, namespace: str, peering: str) -> dict[str, object]:
    """The operators' keep-alives in a KopfPeering's status (kopf writes one entry per live operator)."""
    found = cluster.kubectl("get", "kopfpeerings.kopf.dev", peering, "-n", namespace, "-o", "json").stdout
    status = yaml.safe_load(found).get("status") or {}
    return {identity: entry for identity, entry in status.items() if entry}


def wait_until_peered(
    cluster: Cluster, running: Operator, namespace: str, peering: str, count: int = 1
) -> None:
    """Until `count` operators have announced themselves in the peering object (so the operator runs, is
    authorised to watch, and took part in peering); fails with its log if it exits first."""
    wait_for(f"{count} operator(s) in the KopfPeering {namespace}/{peering}",
             lambda: len(peers(cluster, namespace, peering)) >= count or not running.running())  # fmt: skip
    assert running.running(), running.output()[-3000:]
