"""A real Kubernetes control plane on loopback, for trying the chart and for the e2e tests.

    python scripts/local_cluster.py build        build the pinned binaries when missing (minutes, once)
    python scripts/local_cluster.py up DIR [--monitoring] [--keda]
                                                 start etcd, kube-apiserver, kube-controller-manager,
                                                 kube-scheduler and kwok; print DIR/kubeconfig. With
                                                 --monitoring also prometheus-operator, Prometheus 3 and
                                                 Alertmanager (scripts/local_monitoring.py), their URLs
                                                 in DIR/monitoring.json; with --keda KEDA's operator and
                                                 metrics API server (scripts/local_keda.py), theirs in
                                                 DIR/keda.json
    python scripts/local_cluster.py token DIR NS/SA
                                                 a kubeconfig for ServiceAccount SA of namespace NS (a
                                                 TokenRequest token); print its path
    python scripts/local_cluster.py restart DIR COMPONENT [--kill]
                                                 stop one component (SIGKILL with --kill) and start it again
                                                 with the same flags, ports and data (the fault tests' tool)
    python scripts/local_cluster.py down DIR     stop every process `up` started in DIR

The binaries are built by `go` from the Go module proxy (nothing fetched is kept in the repository) into a
cache outside the clone: $KVTUNE_KBINS_DIR, else ~/.cache/kvtune/kbins/<kubernetes version>. k8s.io/kubernetes
cannot be built as a plain dependency (its go.mod maps every staging module to `v0.0.0` through local
replaces), so a throw-away wrapper module replaces each of those with its published tag; etcd is the version
k8s.io/kubernetes itself requires; kwok (sigs.k8s.io/kwok) stands in for the kubelet, so pods become Running
and Ready and Deployment rollouts complete. The API server runs the aggregation layer (front-proxy
certificates; --enable-aggregator-routing, as no kube-proxy makes a Service's ClusterIP reachable) so an
APIService such as KEDA's external metrics works, and the controller manager the HPA controller, syncing every
5 s (the default is 15 s) so a test sees an HPA act within seconds. Standard library only; certificates come
from `openssl`.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

if __name__ == "__main__":  # so local_monitoring.py and local_keda.py, loaded from here, share this module
    sys.modules.setdefault("local_cluster", sys.modules[__name__])

KUBERNETES_VERSION = "1.36.3"  # the minor of the kubectl and helm scripts/install_helm.py installs
KWOK_VERSION = "v0.8.0"
KUBERNETES_COMMANDS = ("kube-apiserver", "kube-controller-manager", "kube-scheduler")
BINARIES = ("etcd", *KUBERNETES_COMMANDS, "kwok")
STAGES_FILE = "kwok-stages.yaml"
# kwok's "fast" stages, by their path in its module: a node becomes Ready, a pod bound to it Running and Ready
# at once, a Job's pod completes, a deleted pod goes
KWOK_STAGES = (
    "kustomize/stage/node/fast/node-initialize.yaml",
    "kustomize/stage/pod/fast/pod-ready.yaml",
    "kustomize/stage/pod/fast/pod-complete.yaml",
    "kustomize/stage/pod/fast/pod-delete.yaml",
)
STAMP = "pins.json"
HEARTBEAT_S = 30.0


class ClusterError(Exception):
    """Why the control plane could not be built, started or stopped, printed as one line."""


def tool_cache(override_variable: str, *parts: str) -> Path:
    """Where a pinned build lives: $override_variable, else ~/.cache/kvtune/<parts>."""
    override = os.environ.get(override_variable)
    return Path(override) if override else Path.home().joinpath(".cache", "kvtune", *parts)


def missing_pinned(
    bins: Path, wanted_pins: dict[str, str], names: tuple[str, ...], crd_folder: str
) -> list[str]:
    """What a cache of built binaries and CRDs lacks (all of it when built from other pins)."""
    try:
        built_from = json.loads((bins / STAMP).read_text())
    except (OSError, ValueError):
        built_from = None
    if built_from != wanted_pins:
        return [*names, crd_folder]
    wanted = [name for name in names if not os.access(bins / name, os.X_OK)]
    return wanted + ([crd_folder] if not any((bins / crd_folder).glob("*.yaml")) else [])


def kbins_dir() -> Path:
    return tool_cache("KVTUNE_KBINS_DIR", "kbins", KUBERNETES_VERSION)


def pins() -> dict[str, str]:
    return {"kubernetes": KUBERNETES_VERSION, "kwok": KWOK_VERSION}


def stale_pins(bins: Path) -> bool:
    """Whether the cache holds binaries built from other pins (then all of them are rebuilt)."""
    try:
        built_from = json.loads((bins / STAMP).read_text())
    except (OSError, ValueError):
        return any((bins / name).exists() for name in BINARIES)
    return not isinstance(built_from, dict) or {k: built_from.get(k) for k in pins()} != pins()


def missing_binaries(bins: Path) -> list[str]:
    """What `up` needs that the cache lacks: binaries, and kwok's stages."""
    if stale_pins(bins):
        return [*BINARIES, STAGES_FILE]
    wanted = [name for name in BINARIES if not os.access(bins / name, os.X_OK)]
    return wanted + ([STAGES_FILE] if not (bins / STAGES_FILE).is_file() else [])


def go_executable() -> str:
    found = shutil.which("go")
    if found is None:
        raise ClusterError(
            "`go` (1.26 or newer) is not on PATH: it builds etcd, kube-apiserver, kube-controller-manager, "
            "kube-scheduler and kwok from the Go module proxy"
        )
    return found


def go(args: list[str], cwd: Path, env: dict[str, str] | None = None, capture: bool = False) -> str:
    """Run `go ARGS` in `cwd`; its output on failure is the error."""
    done = subprocess.run(
        [go_executable(), *args],
        cwd=cwd,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-20:])
        raise ClusterError(f"`go {' '.join(args)}` failed in {cwd}:\n{tail}")
    return done.stdout


class Progress:
    """One line per step, and a heartbeat while a step runs, so a long build never looks hung."""

    def __init__(self, total: int, label: str = "kbins") -> None:
        self.total = total
        self.label = label
        self.step = 0
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _say(self, text: str) -> None:
        elapsed = time.monotonic() - self.started
        stamp = f"{self.step}/{self.total} {elapsed // 60:.0f}m{elapsed % 60:02.0f}s"
        print(f"[{self.label} {stamp}] {text}", flush=True)

    def begin(self, what: str) -> None:
        self.end()
        self.step += 1
        self._say(what)
        self._stop = threading.Event()
        stop = self._stop

        def beat() -> None:
            while not stop.wait(HEARTBEAT_S):
                self._say(f"still {what}")

        self._thread = threading.Thread(target=beat, daemon=True)
        self._thread.start()

    def end(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None


def staging_replaces(kubernetes_go_mod: str, staging_version: str) -> list[str]:
    """`go mod edit -replace` arguments pointing k/k's `k8s.io/* v0.0.0` requirements at published tags."""
    modules = []
    for line in kubernetes_go_mod.splitlines():
        fields = line.split()
        if fields[:1] == ["require"]:  # a one-line requirement, outside a require ( ... ) block
            fields = fields[1:]
        if len(fields) >= 2 and fields[0].startswith("k8s.io/") and fields[1] == "v0.0.0":
            modules.append(fields[0])
    if not modules:
        raise ClusterError("k8s.io/kubernetes' go.mod lists no staging modules at v0.0.0: the recipe changed")
    return [f"-replace={module}={module}@{staging_version}" for module in sorted(set(modules))]


def godebug_lines(kubernetes_go_mod: str) -> list[str]:
    """k/k's `godebug` settings: they apply only in the main module, so the wrapper must carry them."""
    return [line.split(None, 1)[1] for line in kubernetes_go_mod.splitlines() if line.startswith("godebug ")]


def kubernetes_ldflags() -> str:
    """Version stamps, else /version says v0.0.0-master and helm's kubeVersion checks fail."""
    major, minor, _ = KUBERNETES_VERSION.split(".")
    pkg = "k8s.io/component-base/version"
    stamps = {
        "gitVersion": f"v{KUBERNETES_VERSION}",
        "gitMajor": major,
        "gitMinor": minor,
        "gitTreeState": "clean",
        "buildDate": "1970-01-01T00:00:00Z",
    }
    return " ".join(["-s", "-w", *(f"-X {pkg}.{name}={value}" for name, value in stamps.items())])


def build_kubernetes(work: Path, out: Path, progress: Progress) -> None:
    """kube-apiserver, kube-controller-manager, kube-scheduler and etcd from one wrapper module."""
    k8s = f"v{KUBERNETES_VERSION}"
    staging = "v0." + KUBERNETES_VERSION.split(".", 1)[1]
    progress.begin(f"resolving k8s.io/kubernetes@{k8s} (the module proxy's go.mod)")
    work.mkdir()
    go(["mod", "init", "kbins.local"], work)
    info = json.loads(go(["mod", "download", "-json", f"k8s.io/kubernetes@{k8s}"], work, capture=True))
    kubernetes_go_mod = Path(info["GoMod"]).read_text()
    go(["mod", "edit", *staging_replaces(kubernetes_go_mod, staging)], work)
    for setting in godebug_lines(kubernetes_go_mod):
        go(["mod", "edit", f"-godebug={setting}"], work)
    tools = [f"k8s.io/kubernetes/cmd/{name}@{k8s}" for name in KUBERNETES_COMMANDS]
    progress.begin(f"downloading modules for {', '.join(KUBERNETES_COMMANDS)}")
    go(["get", "-tool", *tools], work)
    etcd = go(["list", "-m", "-f", "{{.Version}}", "go.etcd.io/etcd/server/v3"], work, capture=True).strip()
    go(["get", "-tool", f"go.etcd.io/etcd/server/v3@{etcd}"], work)
    env = {"CGO_ENABLED": "0"}
    for name in KUBERNETES_COMMANDS:
        progress.begin(f"compiling {name} {k8s}")
        package = f"k8s.io/kubernetes/cmd/{name}"
        go(
            ["build", "-trimpath", "-ldflags", kubernetes_ldflags(), "-o", str(out / name), package],
            work,
            env,
        )
    progress.begin(f"compiling etcd {etcd}")
    go(
        ["build", "-trimpath", "-ldflags", "-s -w", "-o", str(out / "etcd"), "go.etcd.io/etcd/server/v3"],
        work,
        env,
    )


def build_kwok(work: Path, out: Path, progress: Progress) -> None:
    """kwok in its own module, so its dependency versions never move the control plane's."""
    progress.begin(f"compiling kwok {KWOK_VERSION}")
    go(
        ["install", "-trimpath", "-ldflags", "-s -w", f"sigs.k8s.io/kwok/cmd/kwok@{KWOK_VERSION}"],
        work,
        {"CGO_ENABLED": "0", "GOBIN": str(out)},
    )


def fetch_kwok_stages(work: Path, out: Path, progress: Progress) -> None:
    """kwok's own "fast" stages (a node becomes Ready; a pod scheduled on it Running and Ready; a deleted
    pod goes), read from its module at the pinned version, so nothing of kwok is kept in this repository."""
    progress.begin(f"reading kwok {KWOK_VERSION}'s stages")
    info = json.loads(
        go(["mod", "download", "-json", f"sigs.k8s.io/kwok@{KWOK_VERSION}"], work, capture=True)
    )
    module = Path(info["Dir"])
    documents = [(module / stage).read_text().strip() for stage in KWOK_STAGES]
    (out / STAGES_FILE).write_text("\n---\n".join(documents) + "\n")


def build(bins: Path | None = None) -> Path:
    """Build whatever of the pinned binaries the cache lacks; the cache folder."""
    bins = bins or kbins_dir()
    missing = missing_binaries(bins)
    if not missing:
        return bins
    if stale_pins(bins) and bins.exists():
        shutil.rmtree(bins)
    bins.mkdir(parents=True, exist_ok=True)
    kubernetes = [name for name in missing if name in (*KUBERNETES_COMMANDS, "etcd")]
    steps = (3 + len(KUBERNETES_COMMANDS)) * bool(kubernetes) + ("kwok" in missing) + (STAGES_FILE in missing)
    print(
        f"building {', '.join(missing)} (Kubernetes {KUBERNETES_VERSION}, kwok {KWOK_VERSION}) into {bins} "
        "from the Go module proxy: once per machine, ~25 min on 2 cores",
        flush=True,
    )
    progress = Progress(total=steps)

    def run_steps(work: Path, partial: Path) -> None:
        if kubernetes:
            build_kubernetes(work / "kubernetes", partial, progress)
        if "kwok" in missing:
            build_kwok(work, partial, progress)
        if STAGES_FILE in missing:
            fetch_kwok_stages(work, partial, progress)

    return staged_build(bins, "kbins-module-", progress, run_steps, pins(), ", ".join(missing))


def staged_build(
    bins: Path,
    work_prefix: str,
    progress: Progress,
    run_steps: Callable[[Path, Path], None],
    built_from: dict[str, str],
    what: str,
) -> Path:
    """Run `run_steps(work, partial)` (a scratch folder, and one beside the cache that they write binaries to),
    then rename each into `bins` and stamp the pins: an interrupted build never leaves a half binary that a
    later run would trust. Used by this module's build and local_keda.py's."""
    with (
        tempfile.TemporaryDirectory(prefix=".partial-", dir=bins) as partial_dir,
        tempfile.TemporaryDirectory(prefix=work_prefix) as work_dir,
    ):
        partial = Path(partial_dir)
        try:
            run_steps(Path(work_dir), partial)
        finally:
            progress.end()
        for built in partial.iterdir():
            os.replace(built, bins / built.name)
    (bins / STAMP).write_text(json.dumps(built_from) + "\n")
    print(f"built {what} in {time.monotonic() - progress.started:.0f} s into {bins}", flush=True)
    return bins


# ---------------------------------------------------------------------------------------------- up / down

STATE_FILE = "cluster.json"
KUBECONFIG = "kubeconfig"
SERVICE_CIDR = "10.96.0.0/16"
POD_CIDR = "10.244.0.0/16"
KWOK_NODE = "kwok-node-0"
KWOK_ANNOTATION = "kwok.x-k8s.io/node"
READY_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 20.0
# the controllers a Deployment, a namespace and a ServiceAccount need; the node lifecycle controller is left
# out (kwok's nodes send no heartbeats, and it would evict their pods; so the API server must not taint new
# nodes not-ready either), as are the cloud's and the volumes'
CONTROLLERS = (
    "deployment-controller",
    "replicaset-controller",
    "statefulset-controller",
    "garbage-collector-controller",
    "namespace-controller",
    "serviceaccount-controller",
    "serviceaccount-token-controller",
    "root-ca-certificate-publisher-controller",
    "horizontal-pod-autoscaler-controller",
)
HPA_SYNC_PERIOD = "5s"
FRONT_PROXY_CLIENT = "front-proxy-client"  # the aggregator's client certificate, the one name allowed
_children: dict[int, subprocess.Popen[bytes]] = {}  # started by this process: reaped by `down`
# how each was started (its log's name, argv, env), kept in the state file: `restart` reruns it
_launches: dict[int, dict[str, Any]] = {}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def openssl(*args: str) -> None:
    if shutil.which("openssl") is None:
        raise ClusterError("`openssl` is not on PATH: it makes the control plane's certificates")
    done = subprocess.run(["openssl", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise ClusterError(f"`openssl {' '.join(args[:2])}` failed: {done.stderr.strip()[-300:]}")


def certificates(pki: Path) -> None:
    """A CA, the API server's serving certificate (127.0.0.1, localhost, the kubernetes Service), one client
    certificate per component and for the admin, and the ServiceAccount token signing key."""
    pki.mkdir(parents=True)
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "30", "-subj", "/CN=kvtune-local-ca",
            "-keyout", str(pki / "ca.key"), "-out", str(pki / "ca.crt"))  # fmt: skip
    service_ip = SERVICE_CIDR.split("/")[0].rsplit(".", 1)[0] + ".1"
    subjects = {
        "apiserver": ("/CN=kube-apiserver", f"subjectAltName=IP:127.0.0.1,DNS:localhost,IP:{service_ip},"
                      "DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc"),
        "admin": ("/O=system:masters/CN=kvtune-local-admin", None),
        "kube-controller-manager": ("/O=system:masters/CN=system:kube-controller-manager", None),
        "kube-scheduler": ("/O=system:masters/CN=system:kube-scheduler", None),
        "kwok": ("/O=system:masters/CN=kwok-controller", None),
    }  # fmt: skip
    for name, (subject, san) in subjects.items():
        key, csr, crt = pki / f"{name}.key", pki / f"{name}.csr", pki / f"{name}.crt"
        openssl(
            "req",
            "-new",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            subject,
            "-keyout",
            str(key),
            "-out",
            str(csr),
        )
        extensions = pki / f"{name}.ext"
        usage = "serverAuth" if san else "clientAuth"
        extensions.write_text(f"extendedKeyUsage={usage}\nkeyUsage=digitalSignature,keyEncipherment\n"
                              + (f"{san}\n" if san else ""))  # fmt: skip
        openssl("x509", "-req", "-in", str(csr), "-CA", str(pki / "ca.crt"), "-CAkey", str(pki / "ca.key"),
                "-CAcreateserial", "-days", "30", "-extfile", str(extensions), "-out", str(crt))  # fmt: skip
    openssl("genrsa", "-out", str(pki / "sa.key"), "2048")
    openssl("rsa", "-in", str(pki / "sa.key"), "-pubout", "-out", str(pki / "sa.pub"))
    front_proxy_certificates(pki)


def front_proxy_certificates(pki: Path) -> None:
    """The aggregation layer's: a CA of its own (an aggregated API server trusts the identity headers of
    whoever presents a certificate it signed, so no other client certificate may come from it) and the
    certificate the API server presents when it proxies to an APIService's server."""
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "30", "-subj", "/CN=kvtune-front-proxy-ca",
            "-keyout", str(pki / "front-proxy-ca.key"), "-out", str(pki / "front-proxy-ca.crt"))  # fmt: skip
    key, csr, crt = (pki / f"{FRONT_PROXY_CLIENT}.{ext}" for ext in ("key", "csr", "crt"))
    openssl("req", "-new", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={FRONT_PROXY_CLIENT}",
            "-keyout", str(key), "-out", str(csr))  # fmt: skip
    extensions = pki / f"{FRONT_PROXY_CLIENT}.ext"
    extensions.write_text("extendedKeyUsage=clientAuth\nkeyUsage=digitalSignature,keyEncipherment\n")
    openssl("x509", "-req", "-in", str(csr), "-CA", str(pki / "front-proxy-ca.crt"),
            "-CAkey", str(pki / "front-proxy-ca.key"), "-CAcreateserial", "-days", "30",
            "-extfile", str(extensions), "-out", str(crt))  # fmt: skip


def kubeconfig(path: Path, server: str, pki: Path, user: str) -> None:
    """A kubeconfig with embedded certificates: it still works when copied elsewhere."""

    def inline(name: str) -> str:
        return base64.b64encode((pki / name).read_bytes()).decode()

    path.write_text(json.dumps({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "kvtune-local", "cluster": {"server": server, "certificate-authority-data": inline("ca.crt")}}],
        "users": [{"name": user, "user": {"client-certificate-data": inline(f"{user}.crt"),
                                          "client-key-data": inline(f"{user}.key")}}],
        "contexts": [{"name": "kvtune-local", "context": {"cluster": "kvtune-local", "user": user}}],
        "current-context": "kvtune-local",
    }, indent=2) + "\n")  # fmt: skip
    path.chmod(0o600)


def start(
    name: str, command: list[str], logs: Path, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """`command` in a session of its own, logging to LOGS/NAME.log; `env` adds to this environment."""
    with (logs / f"{name}.log").open("ab") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   start_new_session=True, env={**os.environ, **(env or {})})  # fmt: skip
    _children[process.pid] = process
    _launches[process.pid] = {"log": name, "argv": command, "env": env or {}}
    return process


def log_tail(logs: Path, name: str, lines: int = 5) -> str:
    try:
        return " | ".join((logs / f"{name}.log").read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return "(no log)"


class Api:
    """Just enough of the API, over HTTPS with the admin's certificate, for `up` to wait and set up."""

    def __init__(self, server: str, pki: Path) -> None:
        self.server = server
        self.context = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        self.context.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.server + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})  # fmt: skip
        try:
            with urllib.request.urlopen(request, context=self.context, timeout=5) as answer:
                status, raw = answer.status, answer.read()
        except urllib.error.HTTPError as err:
            status, raw = err.code, err.read()
        try:
            return status, json.loads(raw) if raw else None
        except ValueError:
            return status, raw.decode(errors="replace")


def wait_until(what: str, check: Callable[[], bool], processes: dict[str, subprocess.Popen[bytes]],
               logs: Path, timeout: float = READY_TIMEOUT_S) -> None:  # fmt: skip
    """Poll `check` until it holds; a component that exits meanwhile fails at once, with its log."""
    deadline = time.monotonic() + timeout
    while True:
        for name, process in processes.items():
            if process.poll() is not None:
                raise ClusterError(f"{name} exited with {process.returncode} while waiting for {what}: "
                                   f"{log_tail(logs, name)}")  # fmt: skip
        try:
            if check():
                return
        except (OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise ClusterError(f"{what} not within {timeout:.0f} s (logs in {logs})")
        time.sleep(0.2)


@dataclass(frozen=True)
class Cluster:
    folder: Path
    server: str
    kubeconfig: Path
    pids: dict[str, int]


def running_cluster(folder: Path) -> dict[str, Any] | None:
    try:
        state: dict[str, Any] = json.loads((folder / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return state if any(alive(pid, name) for name, pid in state.get("pids", {}).items()) else None


def up(folder: Path, bins: Path | None = None, monitoring: bool = False, keda: bool = False) -> Cluster:
    """Start etcd, kube-apiserver (RBAC, ServiceAccount tokens), kube-controller-manager, kube-scheduler and
    kwok with one Ready node on loopback, with everything in `folder`; returns once a Deployment can roll out.
    With `monitoring`, also prometheus-operator, Prometheus 3 and Alertmanager (scripts/local_monitoring.py);
    with `keda`, KEDA's operator and metrics API server (scripts/local_keda.py)."""
    bins = build(bins)
    stacks = [load() for load, wanted in ((monitoring_stack, monitoring), (keda_stack, keda)) if wanted]
    for stack in stacks:
        stack.build()
    folder = folder.resolve()
    if running_cluster(folder) is not None:
        raise ClusterError(f"a control plane is already running from {folder}: `down {folder}` first")
    if folder.exists():
        for stale in ("pki", "etcd", "logs", "components"):
            shutil.rmtree(folder / stale, ignore_errors=True)
    folder.mkdir(parents=True, exist_ok=True)
    pki, logs, components = folder / "pki", folder / "logs", folder / "components"
    certificates(pki)
    logs.mkdir()
    components.mkdir()
    etcd_port, peer_port, api_port = free_port(), free_port(), free_port()
    server = f"https://127.0.0.1:{api_port}"
    processes: dict[str, subprocess.Popen[bytes]] = {}
    try:
        etcd_url = f"http://127.0.0.1:{etcd_port}"
        processes["etcd"] = start("etcd", [
            str(bins / "etcd"), "--name", "kvtune", "--data-dir", str(folder / "etcd"),
            "--listen-client-urls", etcd_url, "--advertise-client-urls", etcd_url,
            "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-cluster", f"kvtune=http://127.0.0.1:{peer_port}",
            "--unsafe-no-fsync", "--log-level", "warn",
        ], logs)  # fmt: skip
        wait_until("etcd", lambda: urllib.request.urlopen(f"{etcd_url}/health", timeout=2).status == 200,
                   processes, logs)  # fmt: skip
        processes["kube-apiserver"] = start("kube-apiserver", [
            str(bins / "kube-apiserver"), "--etcd-servers", etcd_url,
            "--bind-address", "127.0.0.1", "--advertise-address", "127.0.0.1", "--secure-port", str(api_port),
            "--tls-cert-file", str(pki / "apiserver.crt"), "--tls-private-key-file", str(pki / "apiserver.key"),
            "--client-ca-file", str(pki / "ca.crt"), "--authorization-mode", "RBAC",
            "--service-account-issuer", "https://kubernetes.default.svc.cluster.local",
            "--service-account-key-file", str(pki / "sa.pub"),
            "--service-account-signing-key-file", str(pki / "sa.key"),
            "--service-cluster-ip-range", SERVICE_CIDR, "--allow-privileged=true",
            "--endpoint-reconciler-type", "none", "--profiling=false", "--cert-dir", str(pki),
            # the aggregation layer; an APIService's Service is reached at its endpoints (no kube-proxy here)
            "--requestheader-client-ca-file", str(pki / "front-proxy-ca.crt"),
            "--requestheader-allowed-names", FRONT_PROXY_CLIENT,
            "--requestheader-username-headers", "X-Remote-User", "--requestheader-group-headers", "X-Remote-Group",
            "--requestheader-uid-headers", "X-Remote-Uid",
            "--requestheader-extra-headers-prefix", "X-Remote-Extra-",
            "--proxy-client-cert-file", str(pki / f"{FRONT_PROXY_CLIENT}.crt"),
            "--proxy-client-key-file", str(pki / f"{FRONT_PROXY_CLIENT}.key"), "--enable-aggregator-routing=true",
            # no node lifecycle controller here to take the not-ready taint off a new node
            "--disable-admission-plugins", "TaintNodesByCondition",
        ], logs)  # fmt: skip
        api = Api(server, pki)
        wait_until("kube-apiserver /readyz", lambda: api.call("GET", "/readyz")[0] == 200, processes, logs)
        for name in ("kube-controller-manager", "kube-scheduler", "kwok"):
            kubeconfig(components / f"{name}.kubeconfig", server, pki, name)
        kubeconfig(folder / KUBECONFIG, server, pki, "admin")
        processes["kube-controller-manager"] = start("kube-controller-manager", [
            str(bins / "kube-controller-manager"),
            "--kubeconfig", str(components / "kube-controller-manager.kubeconfig"),
            "--leader-elect=false", "--secure-port=0", "--controllers", ",".join(CONTROLLERS),
            "--service-account-private-key-file", str(pki / "sa.key"), "--root-ca-file", str(pki / "ca.crt"),
            "--concurrent-deployment-syncs", "2", "--concurrent-replicaset-syncs", "2",
            "--horizontal-pod-autoscaler-sync-period", HPA_SYNC_PERIOD,
        ], logs)  # fmt: skip
        processes["kube-scheduler"] = start("kube-scheduler", [
            str(bins / "kube-scheduler"), "--kubeconfig", str(components / "kube-scheduler.kubeconfig"),
            "--leader-elect=false", "--secure-port=0",
        ], logs)  # fmt: skip
        processes["kwok"] = start("kwok", [
            str(bins / "kwok"), "--kubeconfig", str(components / "kwok.kubeconfig"),
            "--config", str(bins / STAGES_FILE), "--cidr", POD_CIDR,
            "--manage-nodes-with-annotation-selector", f"{KWOK_ANNOTATION}=fake",
        ], logs)  # fmt: skip
        write_state(folder, server, processes)
        status, answer = api.call("POST", "/api/v1/nodes", kwok_node(KWOK_NODE))
        if status not in (200, 201):
            raise ClusterError(f"could not create the kwok node: HTTP {status}: {answer}")
        wait_until("the ServiceAccount controller (default/default)",
                   lambda: api.call("GET", "/api/v1/namespaces/default/serviceaccounts/default")[0] == 200,
                   processes, logs)  # fmt: skip
        wait_until(
            f"kwok to make node {KWOK_NODE} Ready", lambda: node_ready(api, KWOK_NODE), processes, logs
        )
        for stack in stacks:
            try:
                stack.up(folder, server, processes)
            finally:
                write_state(folder, server, processes)
    except BaseException:
        stop_processes({name: process.pid for name, process in processes.items()})
        raise
    return Cluster(folder, server, folder / KUBECONFIG, {name: p.pid for name, p in processes.items()})


def monitoring_stack() -> ModuleType:
    """scripts/local_monitoring.py, loaded beside this module (it reuses this one's helpers)."""
    return sibling("local_monitoring")


def keda_stack() -> ModuleType:
    """scripts/local_keda.py, loaded beside this module (it reuses this one's helpers)."""
    return sibling("local_keda")


def sibling(name: str) -> ModuleType:
    """scripts/NAME.py as the module NAME, loaded once."""
    loaded = sys.modules.get(name)
    if loaded is not None:
        return loaded
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def service_account_kubeconfig(folder: Path, namespace: str, account: str, hours: int = 3) -> Path:
    """A kubeconfig for a ServiceAccount, with a token from the TokenRequest API (what `kubectl create token`
    asks for), beside the admin's: run the operator with it and the real authorizer judges every call."""
    folder = folder.resolve()
    state = running_cluster(folder)
    if state is None:
        raise ClusterError(f"no control plane is running from {folder}")
    api = Api(state["server"], folder / "pki")
    body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
            "spec": {"expirationSeconds": hours * 3600}}  # fmt: skip
    status, answer = api.call("POST", f"/api/v1/namespaces/{namespace}/serviceaccounts/{account}/token", body)
    if status != 201 or not isinstance(answer, dict):
        raise ClusterError(f"no token for ServiceAccount {namespace}/{account}: HTTP {status}: {answer}")
    path = folder / f"{namespace}.{account}.kubeconfig"
    ca = base64.b64encode((folder / "pki" / "ca.crt").read_bytes()).decode()
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "kvtune-local", "cluster": {"server": state["server"], "certificate-authority-data": ca}}],
        "users": [{"name": account, "user": {"token": answer["status"]["token"]}}],
        "contexts": [{"name": account, "context": {"cluster": "kvtune-local", "user": account, "namespace": namespace}}],
        "current-context": account,
    }, indent=2) + "\n")  # fmt: skip
    path.chmod(0o600)
    return path


def kwok_node(name: str, pods: int | None = None) -> dict[str, Any]:
    """A Node kwok manages (the annotation); `pods` bounds how many pods the scheduler places on it."""
    node: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "annotations": {KWOK_ANNOTATION: "fake"},
                     "labels": {"kubernetes.io/hostname": name, "type": "kwok"}},
    }  # fmt: skip
    if pods is not None:
        capacity = {"cpu": "64", "memory": "256Gi", "pods": str(pods)}
        node["status"] = {"capacity": capacity, "allocatable": capacity}
    return node


def node_ready(api: Api, name: str) -> bool:
    status, node = api.call("GET", f"/api/v1/nodes/{name}")
    conditions = node.get("status", {}).get("conditions", []) if status == 200 else []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def write_state(folder: Path, server: str, processes: dict[str, subprocess.Popen[bytes]]) -> None:
    """The server, each component's pid, and how each was started (so `restart` can start it again)."""
    state = {"server": server, "pids": {name: process.pid for name, process in processes.items()},
             "launches": {name: _launches[p.pid] for name, p in processes.items() if p.pid in _launches}}  # fmt: skip
    (folder / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")


def alive(pid: int, name: str) -> bool:
    """Whether `pid` is still the component `name` (not a zombie, not a reused pid)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:2]
    except OSError:
        return False
    # a binary is named by its executable, a script (the config reloader) by its file
    names = {Path(part.decode(errors="replace")).name for part in command}
    return stat.rsplit(")", 1)[-1].split()[0] != "Z" and name in names


def stop_processes(pids: dict[str, int]) -> list[str]:
    """SIGTERM each component (the last started first), then SIGKILL what is left after STOP_TIMEOUT_S;
    the names of those that had to be killed."""
    killed = []
    for name, pid in reversed(list(pids.items())):
        if not alive(pid, name):
            continue
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        child = _children.get(pid)
        while alive(pid, name) and time.monotonic() < deadline:
            if child is not None and child.poll() is not None:
                break
            time.sleep(0.05)
        if alive(pid, name):
            os.kill(pid, signal.SIGKILL)
            killed.append(name)
    for pid in pids.values():
        child = _children.pop(pid, None)
        if child is not None:
            child.wait(STOP_TIMEOUT_S)
    return killed


def down(folder: Path) -> list[str]:
    """Stop every process `up` started from `folder`; the components that had to be killed."""
    folder = folder.resolve()
    try:
        state = json.loads((folder / STATE_FILE).read_text())
    except (OSError, ValueError) as err:
        raise ClusterError(f"no control plane was started from {folder} ({err})") from None
    killed = stop_processes({name: int(pid) for name, pid in state.get("pids", {}).items()})
    (folder / STATE_FILE).unlink()
    return killed


def component_state(folder: Path, component: str) -> dict[str, Any]:
    """The state file of the control plane started from `folder`, checked to know `component`."""
    try:
        state: dict[str, Any] = json.loads((folder.resolve() / STATE_FILE).read_text())
    except (OSError, ValueError) as err:
        raise ClusterError(f"no control plane was started from {folder} ({err})") from None
    if component not in state.get("launches", {}):
        raise ClusterError(f"{component} was not started by `up` in {folder}: {', '.join(state['pids'])}")
    return state


def stop_component(folder: Path, component: str, kill: bool = False) -> None:
    """Stop one component of the control plane: SIGKILL with `kill` (a crash), else as `down` stops it."""
    pid = int(component_state(folder, component)["pids"][component])
    if kill and alive(pid, component):
        os.kill(pid, signal.SIGKILL)
    stop_processes({component: pid})


def start_component(folder: Path, component: str) -> int:
    """Start a stopped component again exactly as `up` did (same command line: flags, ports, data folder),
    record its new pid in the state file, and wait until it is healthy where it has a health check (etcd,
    kube-apiserver); its pid."""
    folder = folder.resolve()
    state = component_state(folder, component)
    if alive(int(state["pids"][component]), component):
        raise ClusterError(f"{component} is still running from {folder}: stop it first")
    launch = state["launches"][component]
    logs = folder / "logs"
    process = start(launch["log"], launch["argv"], logs, launch["env"] or None)
    state["pids"][component], state["launches"][component] = process.pid, _launches[process.pid]
    (folder / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")
    healthy = component_health(folder, component, launch["argv"], state["server"])
    if healthy is not None:
        wait_until(f"{component} healthy again", healthy, {component: process}, logs)
    return process.pid


def component_health(folder: Path, component: str, argv: list[str], server: str) -> Callable[[], bool] | None:
    """How `up` knows etcd or kube-apiserver is ready (None for a component it does not wait on)."""
    if component == "etcd":
        url = argv[argv.index("--listen-client-urls") + 1]
        return lambda: urllib.request.urlopen(f"{url}/health", timeout=2).status == 200
    if component == "kube-apiserver":
        api = Api(server, folder / "pki")
        return lambda: api.call("GET", "/readyz")[0] == 200
    return None


def restart(folder: Path, component: str, kill: bool = False) -> int:
    """Stop one component (SIGKILL with `kill`) and start it again with the same flags; its new pid."""
    stop_component(folder, component, kill)
    return start_component(folder, component)


STACKS = {"--monitoring": "monitoring.json", "--keda": "keda.json"}  # `up`'s options, and what each writes


def cli(usage: str, command: Callable[[], bool]) -> int:
    """The exit status of a script's `main` (this one's, local_monitoring's, local_keda's): 0 when `command`
    ran (True), 2 with the usage when the arguments matched none of its commands, 1 with a ClusterError's line."""
    try:
        if command():
            return 0
    except ClusterError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(usage, file=sys.stderr)
    return 2


def main(argv: list[str]) -> int:
    usage = (
        "usage: python scripts/local_cluster.py build | up DIR [--monitoring] [--keda] | down DIR | "
        "token DIR NAMESPACE/SERVICEACCOUNT | restart DIR COMPONENT [--kill]"
    )
    command = argv[0] if argv else ""

    def run() -> bool:
        if command == "build" and len(argv) == 1:
            print(f"binaries ready in {build()}")
            return True
        options = set(argv[2:])  # each at most once
        if command == "up" and len(argv) >= 2 and len(options) == len(argv) - 2 and options <= set(STACKS):
            began = time.monotonic()
            cluster = up(Path(argv[1]), monitoring="--monitoring" in options, keda="--keda" in options)
            print(f"control plane up in {time.monotonic() - began:.0f} s: {cluster.server} (logs in "
                  f"{cluster.folder / 'logs'}; stop it with `{Path(__file__).name} down {argv[1]}`)")  # fmt: skip
            for option in sorted(options):
                print(f"{option[2:]}: {(cluster.folder / STACKS[option]).read_text().strip()}")
            print(cluster.kubeconfig)
            return True
        if command == "token" and len(argv) == 3 and argv[2].count("/") == 1:
            namespace, account = argv[2].split("/")
            print(service_account_kubeconfig(Path(argv[1]), namespace, account))
            return True
        if command == "restart" and len(argv) in (3, 4) and argv[3:] in ([], ["--kill"]):
            pid = restart(Path(argv[1]), argv[2], kill=argv[3:] == ["--kill"])
            print(f"{argv[2]} running again as pid {pid}")
            return True
        if command == "down" and len(argv) == 2:
            killed = down(Path(argv[1]))
            print("stopped" + (f" ({', '.join(killed)} had to be killed)" if killed else ""))
            return True
        return False

    return cli(usage, run)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
