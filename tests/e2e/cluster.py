"""The e2e tests' view of the local control plane (scripts/local_cluster.py): the admin's API client, kubectl
and helm against it, the operator as a process with a ServiceAccount's token, and waiting for events.

Without the binaries the tests FAIL with the command that builds them, never skip: `make test` builds them
(`make k8s-tools`), so a run that lacks them is a broken setup, not an optional part.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import pytest
import yaml
from kubernetes import client

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kvtune"
WAIT_S = 90.0  # catches a hang; every wait ends as soon as its event happens
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


@dataclass
class Cluster:
    """The running control plane, as its admin."""

    folder: Path
    kubeconfig: Path
    server: str
    api: client.ApiClient

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

    def start(self) -> Operator:
        command = [sys.executable, "-m", "kvtune.cli", "operator", *self.args,
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
