"""The release's images run as a kubelet would run them, without one: an OCI archive unpacked into a runtime
bundle (skopeo, umoci), its config.json made from a pod's container spec as the chart renders it (the
image's entrypoint with the container's args, its env, the pod's and the container's securityContext,
emptyDir and Secret volumes, the ServiceAccount token a pod gets), and run by Debian's runc. The container
shares this machine's network namespace, where the local control plane listens on 127.0.0.1 and the e2e
pods' network is routed. It needs root and the tools below: without them the test fails in one line that
names the command to run (`make release-artifacts` installs them), never skips."""

from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import subprocess
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
STOP_S = 30.0  # the chart's terminationGracePeriodSeconds default, as a kubelet waits after SIGTERM
NO_CAPABILITIES: dict[str, list[str]] = {
    kind: [] for kind in ("bounding", "effective", "inheritable", "permitted", "ambient")
}


def require(tool: str) -> str:
    """One of the runtime's tools (Debian's packages), or a one-line failure naming how to install them."""
    found = shutil.which(tool)
    if found is None:
        pytest.fail(f"`{tool}` is not on PATH: the images run with Debian's runc from a bundle umoci unpacks "
                    "(as root: apt-get install -y runc umoci skopeo; `make release-artifacts` does)",
                    pytrace=False)  # fmt: skip
    return found


def require_root() -> None:
    if os.geteuid() != 0:
        pytest.fail("running an OCI container needs root here (runc makes its mount, PID and UTS namespaces and "
                    "its cgroups): run the e2e tests as root, as `make test` does", pytrace=False)  # fmt: skip


def image_config(archive: Path) -> dict[str, Any]:
    """The image's configuration (Entrypoint, Cmd, Env, User), read from the archive through its index."""
    with tarfile.open(archive) as tar:

        def blob(digest: str) -> dict[str, Any]:
            member = tar.extractfile(f"blobs/{digest.replace(':', '/')}")
            assert member is not None, digest
            found: dict[str, Any] = json.load(member)
            return found

        index = json.load(tar.extractfile("index.json"))  # type: ignore[arg-type]
        manifest = blob(index["manifests"][0]["digest"])
        config: dict[str, Any] = blob(manifest["config"]["digest"])["config"]
    return config


def unpack(archive: Path, bundle: Path) -> dict[str, Any]:
    """The archive unpacked into `bundle` (rootfs/ and umoci's config.json, which is returned)."""
    layout = bundle.with_name(f"{bundle.name}-layout")
    for argv in ([require("skopeo"), "copy", "--quiet", f"oci-archive:{archive}", f"oci:{layout}:image"],
                 [require("umoci"), "unpack", "--image", f"{layout}:image", str(bundle)]):  # fmt: skip
        done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"`{' '.join(argv)}` failed: {done.stderr.strip()}"
    shutil.rmtree(layout)
    config: dict[str, Any] = json.loads((bundle / "config.json").read_text())
    return config


@dataclass(frozen=True)
class Mount:
    """A volume mount: a host folder or file bound in (a Secret, a ConfigMap, a PVC), or a tmpfs (an emptyDir)."""

    destination: str
    source: Path | None = None  # None: a tmpfs
    read_only: bool = False
    size_mib: int = 64

    def spec(self) -> dict[str, Any]:
        if self.source is None:
            return {"destination": self.destination, "type": "tmpfs", "source": "tmpfs",
                    "options": ["nosuid", "nodev", "mode=1777", f"size={self.size_mib}m"]}  # fmt: skip
        options = ["rbind", "rprivate", "nosuid", "nodev", "ro" if self.read_only else "rw"]
        return {
            "destination": self.destination,
            "type": "bind",
            "source": str(self.source),
            "options": options,
        }


def runtime_config(
    bundle_config: dict[str, Any], image: dict[str, Any], container: dict[str, Any],
    pod_security: dict[str, Any], mounts: list[Mount], env: dict[str, str], hostname: str,
) -> dict[str, Any]:  # fmt: skip
    """umoci's config.json turned into the container a kubelet would start: the image's entrypoint with the
    container's args (its `command` replaces the entrypoint), the pod's user and fsGroup, the container's
    securityContext, and no network namespace of its own. seccompProfile RuntimeDefault names the
    runtime's own profile (containerd's, CRI-O's); runc has none, so none is set here."""
    security = {**pod_security, **(container.get("securityContext") or {})}
    config = copy.deepcopy(bundle_config)
    process = config["process"]
    process["terminal"] = False
    process["args"] = [*(container.get("command") or image.get("Entrypoint") or []),
                       *(container.get("args") or image.get("Cmd") or [])]  # fmt: skip
    user: dict[str, Any] = {"uid": int(security["runAsUser"]), "gid": int(security.get("runAsGroup", 0))}
    if "fsGroup" in security:  # a kubelet adds the pod's fsGroup to every container's groups
        user["additionalGids"] = [int(security["fsGroup"])]
    if security.get("runAsNonRoot"):
        assert user["uid"] != 0, "runAsNonRoot with user 0: a kubelet refuses to start it"
    process["user"] = user
    declared = {e["name"]: str(e["value"]) for e in container.get("env") or [] if "value" in e}
    process["env"] = [*process.get("env", []), *(f"{k}={v}" for k, v in {**declared, **env}.items())]
    process["noNewPrivileges"] = security.get("allowPrivilegeEscalation") is False
    dropped = (security.get("capabilities") or {}).get("drop") or []
    if "ALL" in dropped:
        process["capabilities"] = copy.deepcopy(NO_CAPABILITIES)
    config["root"] = {"path": "rootfs", "readonly": bool(security.get("readOnlyRootFilesystem"))}
    config["hostname"] = hostname
    linux = config["linux"]
    linux["namespaces"] = [ns for ns in linux["namespaces"] if ns["type"] != "network"]  # the host's network
    config["mounts"] = [*config["mounts"], *(mount.spec() for mount in mounts)]
    return config


def service_account_files(folder: Path, token: str, ca: Path, namespace: str) -> Path:
    """What a pod finds at /var/run/secrets/kubernetes.io/serviceaccount: its token, the cluster's CA and
    its namespace, readable by the pod's user (a kubelet makes them 0644 in a projected volume)."""
    folder.mkdir(parents=True)
    (folder / "token").write_text(token)
    (folder / "ca.crt").write_bytes(ca.read_bytes())
    (folder / "namespace").write_text(namespace)
    for path in [folder, *folder.iterdir()]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return folder


def hosts_file(path: Path, hostname: str, names: dict[str, str] | None = None) -> Path:
    """The /etc/hosts a kubelet writes into a host-network pod (loopback, the pod's own name), and `names`
    (name -> address) where the cluster's DNS would answer."""
    lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback", f"127.0.1.1\t{hostname}",
             *(f"{address}\t{name}" for name, address in (names or {}).items())]  # fmt: skip
    path.write_text("\n".join(lines) + "\n")
    path.chmod(0o644)
    return path


@dataclass
class Container:
    """One container run by `runc run` in the foreground (its output to `log`); `stop` sends SIGTERM, then
    SIGKILL after STOP_S, and deletes it, as a kubelet does."""

    bundle: Path
    name: str
    log: Path
    state: Path  # runc's state folder of this run, not the machine's
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def runc(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([require("runc"), "--root", str(self.state), *args], capture_output=True,
                              text=True, timeout=60)  # fmt: skip
        if check:
            assert done.returncode == 0, f"`runc {' '.join(args)}` failed: {done.stderr.strip()}"
        return done

    def start(self, config: dict[str, Any]) -> Container:
        (self.bundle / "config.json").write_text(json.dumps(config, indent=2))
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                [require("runc"), "--root", str(self.state), "run", "--bundle", str(self.bundle), self.name],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )  # fmt: skip
        return self

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def pid(self) -> int | None:
        """The container's first process on this machine, once runc has started it."""
        done = self.runc("state", self.name, check=False)
        if done.returncode != 0:
            return None
        state = json.loads(done.stdout)
        return int(state["pid"]) if state.get("status") == "running" else None

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def stop(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.runc("kill", self.name, str(int(signal.SIGTERM)), check=False)
            try:
                self.process.wait(STOP_S)
            except subprocess.TimeoutExpired:
                self.runc("kill", self.name, str(int(signal.SIGKILL)), check=False)
                self.process.wait(10)
        self.runc("delete", "--force", self.name, check=False)


def process_identity(pid: int) -> dict[str, str]:
    """The kernel's view of a process: its user and groups, capabilities, no_new_privs, and how its root is
    mounted (what the securityContext asked for, checked where it took effect)."""
    status = dict(
        line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":\t" in line
    )
    mounts = [line.split() for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines()]
    root = [fields for fields in mounts if fields[4] == "/"][-1]  # the topmost mount on its /
    return {
        "uid": status["Uid"].split()[0],
        "gid": status["Gid"].split()[0],
        "groups": status.get("Groups", "").strip(),
        "capabilities": status["CapEff"].strip(),
        "bounding": status["CapBnd"].strip(),
        "no_new_privs": status.get("NoNewPrivs", "").strip(),
        "root": root[5],  # the mount options of / (ro or rw first)
    }
