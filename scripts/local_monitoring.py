"""The monitoring stack people run, beside the local control plane: prometheus-operator, Prometheus 3 and
Alertmanager, built from Go modules once per machine and started by `local_cluster.py up DIR --monitoring`.

    python scripts/local_monitoring.py build         build the pinned binaries when missing (minutes, once)
    python scripts/local_monitoring.py reload DIR    the config reloader `up --monitoring` runs (not by hand)

prometheus-operator reconciles the chart's ServiceMonitor, PodMonitor and PrometheusRule for a Prometheus
resource that selects them as kube-prometheus-stack's does (`release: kube-prometheus-stack`, every
namespace). In a cluster its StatefulSet's pod runs Prometheus with a config-reloader sidecar; kwok runs no
containers, so here Prometheus 3 runs as a process on loopback and `reload` plays the sidecar: it reads the
operator's generated configuration Secret, rule-file ConfigMaps and TLS-asset Secrets, writes them where
the config expects them (the pod's /etc/prometheus, under DIR), points Kubernetes service discovery at the
control plane through a kubeconfig, and asks Prometheus to reload. Alertmanager is named to the Prometheus
resource through `additionalAlertManagerConfigs` (a loopback address, which no EndpointSlice may hold).

Builds: prometheus-operator from its module source with the replaces of its own `pkg/client` and
`pkg/apis/monitoring` dropped (`go install` refuses a module with replaces; both are published at the same
version); Prometheus by `go install` with Kubernetes discovery only; Alertmanager from its module source with
a page in place of its web UI (the module lacks the built UI its binary embeds). Versions are stamped through
ldflags (else /api/v1/status/buildinfo reports an empty version). The build needs the standard library and
local_cluster.py; the reloader reads the operator's YAML with PyYAML.
"""

from __future__ import annotations

import base64
import gzip
import json
import os
import shutil
import stat
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

if "local_cluster" not in sys.modules:  # run as a script: scripts/ is on sys.path
    import local_cluster  # noqa: F401
lc = sys.modules["local_cluster"]  # one module, whoever loaded it first (its ClusterError is the one caught)

OPERATOR_MODULE = "github.com/prometheus-operator/prometheus-operator"
OPERATOR_VERSION = "v0.85.0"  # the newest the module proxy serves as a whole module
PROMETHEUS_MODULE = "github.com/prometheus/prometheus"
PROMETHEUS_MODULE_VERSION = "v0.316.0"  # Prometheus 3.16.0 (its module is tagged v0.3MM.P)
PROMETHEUS_VERSION = "3.16.0"
PROMETHEUS_TAGS = "remove_all_sd,enable_kubernetes_sd"  # file and static discovery are always in
ALERTMANAGER_MODULE = "github.com/prometheus/alertmanager"
ALERTMANAGER_VERSION = "v0.35.0"
BINARIES = ("prometheus-operator", "prometheus", "alertmanager")
CRD_FOLDER = "crds"  # the operator's monitoring.coreos.com CRDs, from its module at the pinned version
STAMP = "pins.json"

# What `up --monitoring` creates: a Prometheus resource named as kube-prometheus-stack names its own, selecting
# monitors and rules by the label that stack's default Prometheus selects (its release name), in every
# namespace.
NAMESPACE = "monitoring"
PROMETHEUS_NAME = "kube-prometheus-stack-prometheus"
SELECTOR_LABELS = {"release": "kube-prometheus-stack"}
SCRAPE_INTERVAL = "5s"  # kube-prometheus-stack's default is 30s; tests set their monitors' own intervals
EVALUATION_INTERVAL = "2s"
ALERTMANAGER_SECRET = "kvtune-local-alertmanagers"
STATE_FILE = "monitoring.json"
RELOAD_EVERY_S = 0.5


def monbins_dir() -> Path:
    return lc.tool_cache("KVTUNE_MONBINS_DIR", "monbins", f"{OPERATOR_VERSION}-{PROMETHEUS_VERSION}")


def pins() -> dict[str, str]:
    return {"prometheus-operator": OPERATOR_VERSION, "prometheus": PROMETHEUS_MODULE_VERSION,
            "prometheus-tags": PROMETHEUS_TAGS, "alertmanager": ALERTMANAGER_VERSION}  # fmt: skip


def missing(bins: Path) -> list[str]:
    """What `up --monitoring` needs that the cache lacks (all of it when built from other pins)."""
    return lc.missing_pinned(bins, pins(), BINARIES, CRD_FOLDER)


def version_ldflags(package: str, version: str) -> str:
    """Stamps for github.com/prometheus/common/version, which buildinfo and `--version` report."""
    stamps = {"Version": version, "Revision": "module-" + version, "Branch": "module",
              "BuildUser": "kvtune", "BuildDate": "19700101-00:00:00"}  # fmt: skip
    return " ".join(["-s", "-w", *(f"-X {package}.{name}={value}" for name, value in stamps.items())])


def module_dir(work: Path, module: str, version: str) -> Path:
    info = json.loads(lc.go(["mod", "download", "-json", f"{module}@{version}"], work, capture=True))
    return Path(info["Dir"])


def writable_copy(source: Path, target: Path) -> Path:
    """A copy of a (read-only) module cache folder that `go mod edit` may change."""
    shutil.copytree(source, target, symlinks=True)
    for root, dirs, files in os.walk(target):
        for name in [*dirs, *files]:
            path = Path(root) / name
            if not path.is_symlink():
                path.chmod(path.stat().st_mode | stat.S_IWUSR)
    return target


def build_operator(work: Path, out: Path, progress: Any) -> None:
    progress.begin(f"compiling prometheus-operator {OPERATOR_VERSION} from its module source")
    source = writable_copy(module_dir(work, OPERATOR_MODULE, OPERATOR_VERSION), work / "prometheus-operator")
    lc.go(["mod", "edit", f"-dropreplace={OPERATOR_MODULE}/pkg/client",
           f"-dropreplace={OPERATOR_MODULE}/pkg/apis/monitoring"], source)  # fmt: skip
    # the two modules, no longer local, need their own go.sum lines
    lc.go(
        ["mod", "download", f"{OPERATOR_MODULE}/pkg/client", f"{OPERATOR_MODULE}/pkg/apis/monitoring"], source
    )
    lc.go(["build", "-mod=mod", "-trimpath", "-ldflags",
           version_ldflags("github.com/prometheus/common/version", OPERATOR_VERSION.lstrip("v")),
           "-o", str(out / "prometheus-operator"), "./cmd/operator"], source, {"CGO_ENABLED": "0"})  # fmt: skip
    crds = out / CRD_FOLDER
    crds.mkdir()
    for crd in sorted((source / "example" / "prometheus-operator-crd").glob("*.yaml")):
        shutil.copyfile(crd, crds / crd.name)


def build_prometheus(work: Path, out: Path, progress: Any) -> None:
    """With Kubernetes service discovery only (Prometheus' own build tags): the clouds' SDKs are most of
    its compile time, and prometheus-operator's configurations discover through Kubernetes alone."""
    progress.begin(
        f"compiling Prometheus {PROMETHEUS_VERSION} ({PROMETHEUS_MODULE}@{PROMETHEUS_MODULE_VERSION})"
    )
    lc.go(["install", "-trimpath", "-tags", PROMETHEUS_TAGS, "-ldflags",
           version_ldflags("github.com/prometheus/common/version", PROMETHEUS_VERSION),
           f"{PROMETHEUS_MODULE}/cmd/prometheus@{PROMETHEUS_MODULE_VERSION}"],
          work, {"CGO_ENABLED": "0", "GOBIN": str(out)})  # fmt: skip


def build_alertmanager(work: Path, out: Path, progress: Any) -> None:
    """From its module source: its UI is embedded from app/dist, which the module does not ship (it is built
    by npm), so one page saying so stands in for each of the two UIs; the API is all the tests use."""
    progress.begin(f"compiling Alertmanager {ALERTMANAGER_VERSION} from its module source (no web UI)")
    source = writable_copy(module_dir(work, ALERTMANAGER_MODULE, ALERTMANAGER_VERSION), work / "alertmanager")
    for ui in ("elm", "mantine"):
        page = source / "ui" / "app" / "dist" / ui / "index.html"
        page.parent.mkdir(parents=True, exist_ok=True)
        page.write_text(
            "<!doctype html><title>Alertmanager</title><p>Built without its web UI: use /api/v2.\n"
        )
    lc.go(["build", "-trimpath", "-ldflags",
           version_ldflags("github.com/prometheus/common/version", ALERTMANAGER_VERSION.lstrip("v")),
           "-o", str(out / "alertmanager"), "./cmd/alertmanager"], source, {"CGO_ENABLED": "0"})  # fmt: skip


def build(bins: Path | None = None) -> Path:
    """Build whatever of the pinned monitoring binaries the cache lacks; the cache folder. Each lands in the
    cache as soon as it is built (renamed in whole), so a failed step keeps what was built before it."""
    bins = bins or monbins_dir()
    wanted = missing(bins)
    if not wanted:
        return bins
    try:
        stale = json.loads((bins / STAMP).read_text()) != pins()
    except (OSError, ValueError):
        stale = bins.exists()
    if stale:
        shutil.rmtree(bins)
    bins.mkdir(parents=True, exist_ok=True)
    (bins / STAMP).write_text(json.dumps(pins()) + "\n")
    print(f"building {', '.join(wanted)} into {bins} from the Go module proxy: once per machine, "
          "~5 min on 2 cores", flush=True)  # fmt: skip
    steps = {"prometheus-operator": build_operator, "prometheus": build_prometheus,
             "alertmanager": build_alertmanager}  # fmt: skip
    todo = [
        name
        for name in BINARIES
        if name in wanted or (name == "prometheus-operator" and CRD_FOLDER in wanted)
    ]
    progress = lc.Progress(total=len(todo), label="monbins")
    with tempfile.TemporaryDirectory(prefix="monbins-module-") as work_dir:
        work = Path(work_dir)
        lc.go(["mod", "init", "monbins.local"], work)
        try:
            for name in todo:
                with tempfile.TemporaryDirectory(prefix=".partial-", dir=bins) as partial_dir:
                    partial = Path(partial_dir)
                    steps[name](work, partial, progress)
                    for built in partial.iterdir():
                        if (bins / built.name).is_dir():
                            shutil.rmtree(bins / built.name)
                        os.replace(built, bins / built.name)
        finally:
            progress.end()
    print(f"built {', '.join(wanted)} in {time.monotonic() - progress.started:.0f} s into {bins}", flush=True)
    return bins


# ------------------------------------------------------------------------------------------------ objects


def prometheus_resource(alertmanager_secret: str) -> dict[str, Any]:
    """A Prometheus selecting monitors and rules as kube-prometheus-stack's default Prometheus does."""
    selector = {"matchLabels": dict(SELECTOR_LABELS)}
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "Prometheus",
        "metadata": {"name": PROMETHEUS_NAME, "namespace": NAMESPACE},
        "spec": {
            "version": f"v{PROMETHEUS_VERSION}",
            "replicas": 1,
            "scrapeInterval": SCRAPE_INTERVAL,
            "evaluationInterval": EVALUATION_INTERVAL,
            "serviceMonitorSelector": selector,
            "serviceMonitorNamespaceSelector": {},
            "podMonitorSelector": selector,
            "podMonitorNamespaceSelector": {},
            "ruleSelector": selector,
            "ruleNamespaceSelector": {},
            "additionalAlertManagerConfigs": {"name": alertmanager_secret, "key": "alertmanagers.yaml"},
        },
    }


def alertmanagers_secret(alertmanager_address: str) -> dict[str, Any]:
    """Prometheus' `alerting.alertmanagers` entry for the Alertmanager on loopback (JSON is YAML)."""
    entry = [{"static_configs": [{"targets": [alertmanager_address]}], "api_version": "v2"}]
    return {"apiVersion": "v1", "kind": "Secret",
            "metadata": {"name": ALERTMANAGER_SECRET, "namespace": NAMESPACE},
            "stringData": {"alertmanagers.yaml": json.dumps(entry)}}  # fmt: skip


# ----------------------------------------------------------------------------------------------------- up

CRD_API = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
ALERTMANAGER_CONFIG = """route:
  receiver: keep
  group_wait: 0s
  group_interval: 1s
receivers:
- name: keep
"""


def create(api: Any, path: str, body: dict[str, Any] | bytes, content_type: str = "application/json") -> None:
    """POST an object (JSON, or YAML bytes as the API server takes them); one that exists already is fine."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(api.server + path, data=data, method="POST",
                                     headers={"Content-Type": content_type})  # fmt: skip
    try:
        with urllib.request.urlopen(request, context=api.context, timeout=30):
            return
    except urllib.error.HTTPError as err:
        if err.code != 409:
            raise lc.ClusterError(f"could not create {path}: HTTP {err.code}: {err.read()[:300]!r}") from None


def crds_established(api: Any, names: list[str]) -> bool:
    for name in names:
        status, crd = api.call("GET", f"{CRD_API}/{name}")
        conditions = crd.get("status", {}).get("conditions", []) if status == 200 else []
        if not any(c.get("type") == "Established" and c.get("status") == "True" for c in conditions):
            return False
    return True


def http_ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=2) as answer:
        return bool(answer.status == 200)


def alertmanager_known(prometheus: str) -> bool:
    """Whether Prometheus runs the operator's config: only that config names the Alertmanager."""
    with urllib.request.urlopen(f"{prometheus}/api/v1/alertmanagers", timeout=2) as answer:
        return bool(json.loads(answer.read())["data"]["activeAlertmanagers"])


def up(folder: Path, server: str, processes: dict[str, Any]) -> dict[str, str]:
    """CRDs, Alertmanager, Prometheus 3, the Prometheus resource, prometheus-operator and the reloader,
    started into `processes` (so `down` stops them with the control plane); their base URLs, also written to
    DIR/monitoring.json. Returns once Prometheus runs the configuration the operator generated."""
    try:
        import yaml  # noqa: F401  (the reloader's, checked before anything starts)
    except ImportError:
        raise lc.ClusterError(
            "--monitoring needs PyYAML for its config reloader: run `up` with kvtune's .venv/bin/python, or "
            "`pip install pyyaml`"
        ) from None
    bins = build()
    pki, logs = folder / "pki", folder / "logs"
    api = lc.Api(server, pki)
    names = []
    for crd in sorted((bins / CRD_FOLDER).glob("*.yaml")):
        create(api, CRD_API, crd.read_bytes(), "application/yaml")
        group, plural = "monitoring.coreos.com", crd.stem.split("_", 1)[1]
        names.append(f"{plural}.{group}")
    lc.wait_until("the monitoring.coreos.com CRDs", lambda: crds_established(api, names), processes, logs)
    create(
        api, "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}
    )

    alertmanager_dir, prometheus_dir = folder / "alertmanager", folder / "prometheus"
    for stale in (alertmanager_dir, prometheus_dir):
        shutil.rmtree(stale, ignore_errors=True)
        stale.mkdir()
    (alertmanager_dir / "alertmanager.yml").write_text(ALERTMANAGER_CONFIG)
    am_port, prom_port, operator_port = lc.free_port(), lc.free_port(), lc.free_port()
    urls = {"prometheus": f"http://127.0.0.1:{prom_port}", "alertmanager": f"http://127.0.0.1:{am_port}"}
    processes["alertmanager"] = lc.start("alertmanager", [
        str(bins / "alertmanager"), "--config.file", str(alertmanager_dir / "alertmanager.yml"),
        "--storage.path", str(alertmanager_dir / "data"), "--web.listen-address", f"127.0.0.1:{am_port}",
        "--cluster.listen-address=",
    ], logs)  # fmt: skip
    (prometheus_dir / "prometheus.yaml").write_text("global: {}\n")  # until the operator's arrives
    processes["prometheus"] = lc.start("prometheus", [
        str(bins / "prometheus"), "--config.file", str(prometheus_dir / "prometheus.yaml"),
        "--storage.tsdb.path", str(prometheus_dir / "data"), "--web.listen-address", f"127.0.0.1:{prom_port}",
        "--web.enable-lifecycle",
    ], logs)  # fmt: skip
    lc.wait_until(
        "Alertmanager /-/ready", lambda: http_ok(f"{urls['alertmanager']}/-/ready"), processes, logs
    )
    lc.wait_until("Prometheus /-/ready", lambda: http_ok(f"{urls['prometheus']}/-/ready"), processes, logs)
    (folder / STATE_FILE).write_text(json.dumps(urls, indent=2) + "\n")

    create(api, f"/api/v1/namespaces/{NAMESPACE}/secrets", alertmanagers_secret(f"127.0.0.1:{am_port}"))
    create(api, f"/apis/monitoring.coreos.com/v1/namespaces/{NAMESPACE}/prometheuses",
           prometheus_resource(ALERTMANAGER_SECRET))  # fmt: skip
    processes["prometheus-operator"] = lc.start("prometheus-operator", [
        str(bins / "prometheus-operator"), f"--apiserver={server}",
        f"--cert-file={pki / 'admin.crt'}", f"--key-file={pki / 'admin.key'}", f"--ca-file={pki / 'ca.crt'}",
        f"--web.listen-address=127.0.0.1:{operator_port}", "--log-level=info",
    ], logs)  # fmt: skip
    processes["local_monitoring.py"] = lc.start("config-reloader", [
        sys.executable, str(Path(__file__).resolve()), "reload", str(folder),
    ], logs)  # fmt: skip
    lc.wait_until("Prometheus to run prometheus-operator's configuration (its Alertmanager)",
                  lambda: alertmanager_known(urls["prometheus"]), processes, logs)  # fmt: skip
    return urls


# ------------------------------------------------------------------------------------------------- reload

POD_ROOT = "/etc/prometheus/"  # where the operator's config expects its files inside Prometheus' pod


def localised(value: Any, root: Path, kubeconfig: Path) -> Any:
    """The operator's config with the pod's /etc/prometheus under `root`, and every Kubernetes service
    discovery reaching the control plane through `kubeconfig` (a pod would use its ServiceAccount)."""
    if isinstance(value, dict):
        out = {key: localised(item, root, kubeconfig) for key, item in value.items()}
        if "kubernetes_sd_configs" in out:
            out["kubernetes_sd_configs"] = [
                {**{k: v for k, v in sd.items() if k not in ("api_server", "authorization", "tls_config")},
                 "kubeconfig_file": str(kubeconfig)}
                for sd in out["kubernetes_sd_configs"]
            ]  # fmt: skip
        return out
    if isinstance(value, list):
        return [localised(item, root, kubeconfig) for item in value]
    if isinstance(value, str) and value.startswith(POD_ROOT):
        return str(root / value[len(POD_ROOT) :])
    return value


class Reloader:
    """Plays the config-reloader sidecar: the operator's objects onto disk, then POST /-/reload."""

    def __init__(self, folder: Path) -> None:
        state = json.loads((folder / lc.STATE_FILE).read_text())
        monitoring = json.loads((folder / STATE_FILE).read_text())
        self.api = lc.Api(state["server"], folder / "pki")
        self.root = folder / "prometheus" / "etc"
        self.kubeconfig = folder / lc.KUBECONFIG
        self.prometheus = monitoring["prometheus"]
        self.config_file = folder / "prometheus" / "prometheus.yaml"
        self.last: str | None = None

    def objects(self) -> tuple[str, dict[str, bytes]] | None:
        """The generated config (text) and every file the pod would mount, or None before the operator wrote it."""
        base = f"/api/v1/namespaces/{NAMESPACE}"
        status, secret = self.api.call("GET", f"{base}/secrets/prometheus-{PROMETHEUS_NAME}")
        if status != 200 or "prometheus.yaml.gz" not in secret.get("data", {}):
            return None
        config = gzip.decompress(_b64(secret["data"]["prometheus.yaml.gz"])).decode()
        # the sidecar expands its environment in it: the pod's name (the replica's external label) and its
        # shard's number (sharding keeps the targets whose address hashes to it: one shard here, 0)
        for name, value in {"POD_NAME": f"prometheus-{PROMETHEUS_NAME}-0", "SHARD": "0"}.items():
            config = config.replace(f"$({name})", value)
        files: dict[str, bytes] = {}
        selector = f"prometheus-name={PROMETHEUS_NAME}"
        status, maps = self.api.call("GET", f"{base}/configmaps?labelSelector={_quote(selector)}")
        for item in maps.get("items", []) if status == 200 else []:
            for key, text in (item.get("data") or {}).items():
                files[f"rules/{item['metadata']['name']}/{key}"] = text.encode()
        status, secrets = self.api.call("GET", f"{base}/secrets")
        prefix = f"prometheus-{PROMETHEUS_NAME}-tls-assets"
        for item in secrets.get("items", []) if status == 200 else []:
            if item["metadata"]["name"].startswith(prefix):
                for key, data in (item.get("data") or {}).items():
                    files[f"certs/{key}"] = _b64(data)
        return config, files

    def sync(self) -> bool:
        """One pass; whether Prometheus was asked to reload."""
        found = self.objects()
        if found is None:
            return False
        config, files = found
        fingerprint = json.dumps([config, sorted((k, v.hex()) for k, v in files.items())])
        if fingerprint == self.last:
            return False
        if self.root.exists():
            shutil.rmtree(self.root)
        for name, data in files.items():
            target = self.root / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        # the operator writes YAML; Prometheus reads JSON as YAML, so the localised config is written as JSON
        parsed = _yaml(config)
        staged = self.config_file.with_suffix(".tmp")
        staged.write_text(json.dumps(localised(parsed, self.root, self.kubeconfig), indent=1))
        os.replace(staged, self.config_file)
        request = urllib.request.Request(f"{self.prometheus}/-/reload", method="POST", data=b"")
        try:
            with urllib.request.urlopen(request, timeout=10) as answer:
                ok = answer.status == 200
        except (urllib.error.URLError, OSError) as err:
            print(f"reload refused: {err}", flush=True)
            return False
        if ok:
            self.last = fingerprint
            print(f"reloaded Prometheus with {len(files)} file(s)", flush=True)
        return ok

    def run(self) -> None:
        while True:
            try:
                self.sync()
            except (OSError, ValueError, KeyError) as err:
                print(f"sync failed, retrying: {err}", flush=True)
            time.sleep(RELOAD_EVERY_S)


def _b64(text: str) -> bytes:
    return base64.b64decode(text)


def _quote(text: str) -> str:
    return urllib.parse.quote(text, safe="")


def _yaml(text: str) -> Any:
    """The operator's config: YAML, which PyYAML reads (the reloader runs where kvtune's venv or the
    system's python3-yaml is; `up` picks that interpreter)."""
    import yaml

    return yaml.safe_load(text)


def main(argv: list[str]) -> int:
    def run() -> bool:
        if argv == ["build"]:
            print(f"monitoring binaries ready in {build()}")
            return True
        if len(argv) == 2 and argv[0] == "reload":
            Reloader(Path(argv[1]).resolve()).run()
            return True
        return False

    return lc.cli("usage: python scripts/local_monitoring.py build | reload DIR", run)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
