"""KEDA beside the local control plane: its operator and its metrics API server (external.metrics.k8s.io
through the aggregation layer), built from the Go module once per machine and started by
`local_cluster.py up DIR --keda`.

    python scripts/local_keda.py build     build the pinned binaries when missing (minutes, once)

KEDA is github.com/kedacore/keda/v2 at KEDA_VERSION (v2.21 needs Go 1.27.4 or newer), built from a copy of its
module source into $KVTUNE_KEDA_BINS_DIR, else ~/.cache/kvtune/kedabins/<version>, with its own CRDs
(config/crd, with the JSON patches its kustomization applies). The copy is patched in one way: only the
scalers in SCALERS stay registered (their files kept in pkg/scalers, the others' deleted and their cases cut
from buildScaler's switch), because the other ~60 pull in every cloud's and broker's SDK: on 2 cores with an
empty Go cache the whole of KEDA took 10 min (about 10 CPU-minutes), this about 3.5 (about 6). The operator,
the metrics server and the kept scalers (the prometheus scaler with its cloud authentication) are KEDA's own
code.

Both run as processes with the admin's kubeconfig, in namespace `keda` as far as KEDA knows. The metrics
server calls the operator's gRPC metrics service on loopback over mutual TLS: both read one certificate
directory (ca.crt, tls.crt, tls.key) made here, signed by the control plane's CA, so KEDA's own certificate
rotation (which writes a Secret and patches the APIService) stays off. The APIService
v1beta1.external.metrics.k8s.io names the Service keda/keda-operator-metrics-apiserver, whose Endpoints and
EndpointSlice hold this machine's non-loopback address (the API server refuses loopback endpoints), where
the metrics server listens; the API server, with --enable-aggregator-routing, dials that endpoint. The
admission webhooks are left out: they reject a bad ScaledObject at admission (two on one workload, say),
which the operator otherwise reports in its status.
Standard library only, with local_cluster.py's and local_monitoring.py's helpers.
"""

from __future__ import annotations

import base64
import fcntl
import json
import re
import shutil
import socket
import ssl
import struct
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

if "local_cluster" not in sys.modules:  # run as a script: scripts/ is on sys.path
    import local_cluster  # noqa: F401
lc = sys.modules["local_cluster"]  # one module, whoever loaded it first (its ClusterError is the one caught)

KEDA_MODULE = "github.com/kedacore/keda/v2"
KEDA_VERSION = "v2.20.2"
# the triggers kvtune's autoscaling uses (prometheus; cpu and memory for the usual companions) and those that
# cost next to nothing to compile (no SDK of their own)
SCALERS = {
    "prometheus": "prometheus_scaler.go",
    "cpu": "cpu_memory_scaler.go",
    "memory": "cpu_memory_scaler.go",
    "cron": "cron_scaler.go",
    "metrics-api": "metrics_api_scaler.go",
    "kubernetes-workload": "kubernetes_workload_scaler.go",
    "external": "external_scaler.go",
    "external-push": "external_scaler.go",
}
SCALER_COMMON = "scaler.go"  # the interfaces and helpers every scaler uses
COMMANDS = {"keda-operator": "./cmd/operator", "keda-adapter": "./cmd/adapter"}
CRD_FOLDER = "crds"
PATCH_SUFFIX = ".patch.json"  # beside a CRD: the JSON patch KEDA's kustomization applies to it
STAMP = "pins.json"

NAMESPACE = "keda"
METRICS_SERVICE = "keda-operator-metrics-apiserver"  # as KEDA's Helm chart names it
APISERVICE = "v1beta1.external.metrics.k8s.io"
EXTERNAL_METRICS = "/apis/external.metrics.k8s.io/v1beta1"
STATE_FILE = "keda.json"


def kedabins_dir() -> Path:
    return lc.tool_cache("KVTUNE_KEDA_BINS_DIR", "kedabins", KEDA_VERSION)


def pins() -> dict[str, str]:
    return {"keda": KEDA_VERSION, "scalers": ",".join(sorted(SCALERS))}


def missing(bins: Path) -> list[str]:
    """What `up --keda` needs that the cache lacks (all of it when built from other pins)."""
    return lc.missing_pinned(bins, pins(), tuple(COMMANDS), CRD_FOLDER)


# ------------------------------------------------------------------------------------------------- build


def registered_only(builder: str, triggers: set[str]) -> str:
    """scalers_builder.go with buildScaler's switch (between KEDA's TRIGGERS-START and TRIGGERS-END marks)
    cut to the cases of `triggers` and its default; a comment goes with the case below it."""
    head, rest = builder.split("// TRIGGERS-START\n", 1)
    switch, tail = rest.split("// TRIGGERS-END\n", 1)
    indent = switch[len(switch.rstrip(" \t")) :]  # the end mark's
    lines = switch.rstrip().splitlines(keepends=True)
    opening, closing = lines[0], lines[-1]
    if opening.strip() != "switch triggerType {" or closing.strip() != "}":
        raise lc.ClusterError(f"KEDA {KEDA_VERSION}'s buildScaler changed shape: {opening.strip()!r}")
    cases: list[list[str]] = []
    pending: list[str] = []
    for line in lines[1:-1]:
        if line.strip().startswith("//"):
            pending.append(line)
        elif re.match(r"\s*(case |default:)", line):
            cases.append([*pending, line])
            pending = []
        elif cases:
            cases[-1] += [*pending, line]
            pending = []
    kept, seen = [], set()
    for case in cases:
        label = next(line for line in case if not line.strip().startswith("//"))
        names = set(re.findall(r'"([^"]+)"', label)) if label.lstrip().startswith("case ") else {""}
        seen |= names
        if names & (triggers | {""}):
            kept.append("".join(case))
    if not triggers <= seen:
        raise lc.ClusterError(f"KEDA {KEDA_VERSION} registers no scaler {sorted(triggers - seen)}")
    return f"{head}// TRIGGERS-START\n{opening}{''.join(kept)}{closing}\n{indent}// TRIGGERS-END\n{tail}"


def trim_scalers(source: Path) -> None:
    """Keep only SCALERS (and what every scaler shares) in the copied source. One constant the kept scalers
    use is declared in a dropped scaler's file (azure_queue_scaler.go), so it is declared again, alone."""
    package = source / "pkg" / "scalers"
    keep = {SCALER_COMMON, *SCALERS.values()}
    for path in package.glob("*.go"):
        if path.name not in keep:
            path.unlink()
    kept = "".join((package / name).read_text() for name in keep)
    if not re.search(r"\bexternalMetricType\s*=", kept):
        (package / "kvtune_shared.go").write_text(
            'package scalers\n\nconst externalMetricType = "External"\n'
        )
    builder = source / "pkg" / "scaling" / "scalers_builder.go"
    builder.write_text(registered_only(builder.read_text(), set(SCALERS)))


def json_patch(text: str) -> list[dict[str, Any]]:
    """One of KEDA's CRD patches (a YAML list of `op`, `path` and a scalar `value`) as JSON patch
    operations; anything else in it fails the build rather than being dropped."""
    operations: list[dict[str, Any]] = []
    for line in text.splitlines():
        if not line.strip() or line.startswith(("#", "---")):
            continue
        found = re.fullmatch(r"(- |  )(op|path|value): (.*)", line)
        if found is None or (found.group(1) == "- ") != (found.group(2) == "op"):
            raise lc.ClusterError(
                f"KEDA {KEDA_VERSION}'s CRD patch has a line this build cannot read: {line!r}"
            )
        if found.group(1) == "- ":
            operations.append({})
        key, value = found.group(2), found.group(3).strip()
        try:
            operations[-1][key] = json.loads(value) if key == "value" else value
        except ValueError:
            operations[-1][key] = value  # a bare YAML string
    return operations


def crd_patches(kustomization: str) -> dict[str, str]:
    """The kustomization's `patches`: patch file -> the CRD it targets."""
    targets, path = {}, None
    for line in kustomization.splitlines():
        if found := re.fullmatch(r"- path: (\S+)", line.strip()):
            path = found.group(1)
        elif (found := re.fullmatch(r"name: (\S+)", line.strip())) and path is not None:
            targets[path], path = found.group(1), None
    return targets


def copy_crds(source: Path, out: Path) -> None:
    """KEDA's CRDs as its kustomization makes them: the bases, and each patch as JSON to apply after."""
    crds = out / CRD_FOLDER
    crds.mkdir()
    for crd in sorted((source / "config" / "crd" / "bases").glob("*.yaml")):
        shutil.copyfile(crd, crds / crd.name)
    config = source / "config" / "crd"
    for patch, target in crd_patches((config / "kustomization.yaml").read_text()).items():
        (crds / f"{target}{PATCH_SUFFIX}").write_text(json.dumps(json_patch((config / patch).read_text())))


def build_keda(work: Path, out: Path, progress: Any) -> None:
    monitoring = lc.monitoring_stack()
    progress.begin(
        f"copying {KEDA_MODULE}@{KEDA_VERSION} and keeping the scalers {', '.join(sorted(SCALERS))}"
    )
    source = monitoring.writable_copy(monitoring.module_dir(work, KEDA_MODULE, KEDA_VERSION), work / "keda")
    trim_scalers(source)
    copy_crds(source, out)
    version = f"{KEDA_MODULE}/version"
    stamps = f"-X {version}.Version={KEDA_VERSION.lstrip('v')} -X {version}.GitCommit=module"
    for name, package in COMMANDS.items():
        progress.begin(f"compiling {name} (KEDA {KEDA_VERSION}, {package})")
        lc.go(["build", "-trimpath", "-ldflags", f"-s -w {stamps}", "-o", str(out / name), package], source,
              {"CGO_ENABLED": "0"})  # fmt: skip


def build(bins: Path | None = None) -> Path:
    """Build KEDA when the cache lacks it; the cache folder. Everything lands in the cache in one rename
    per file once built, so an interrupted build never leaves a binary a later run would trust."""
    bins = bins or kedabins_dir()
    wanted = missing(bins)
    if not wanted:
        return bins
    if bins.exists():
        shutil.rmtree(bins)
    bins.mkdir(parents=True)
    print(f"building KEDA {KEDA_VERSION} ({', '.join(wanted)}) into {bins} from the Go module proxy: "
          "once per machine, ~4 min on 2 cores", flush=True)  # fmt: skip
    progress = lc.Progress(total=1 + len(COMMANDS), label="kedabins")

    def run_steps(work: Path, partial: Path) -> None:
        lc.go(["mod", "init", "kedabins.local"], work)
        build_keda(work, partial, progress)

    return lc.staged_build(bins, "kedabins-module-", progress, run_steps, pins(), f"KEDA {KEDA_VERSION}")


# ---------------------------------------------------------------------------------------------------- up

SIOCGIFADDR = 0x8915  # Linux's ioctl for an interface's IPv4 address


def interface_address(name: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            answer = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(answer[20:24])


def host_address() -> str:
    """An IPv4 address of this machine that is not loopback, for the endpoints of a Service whose server runs
    here: the default route's interface's (it stays while tests add and remove links), else any other's."""
    try:
        routes = [line.split() for line in Path("/proc/net/route").read_text().splitlines()[1:]]
    except OSError:
        routes = []
    default = [fields[0] for fields in routes if len(fields) > 1 and fields[1] == "00000000"]
    others = [name for _, name in socket.if_nameindex() if name != "lo"]
    for name in dict.fromkeys([*default, *others]):
        address = interface_address(name)
        if address and not address.startswith(("127.", "169.254.")):
            return address
    raise lc.ClusterError(
        "this machine has no IPv4 address but loopback: an aggregated API server's endpoints may not be "
        "loopback addresses, so KEDA's metrics server cannot be registered"
    )


def certificates(pki: Path, certs: Path, host: str) -> None:
    """One certificate (server and client, signed by the control plane's CA) and that CA in the layout KEDA
    reads (ca.crt, tls.crt, tls.key): the operator's gRPC server and the metrics server's client present it
    to each other, and the API server verifies the metrics server's against the APIService's caBundle."""
    certs.mkdir(parents=True)
    shutil.copyfile(pki / "ca.crt", certs / "ca.crt")
    names = [f"DNS:{service}.{NAMESPACE}.svc{suffix}" for service in ("keda-operator", METRICS_SERVICE)
             for suffix in ("", ".cluster.local")]  # fmt: skip
    san = ",".join(["IP:127.0.0.1", f"IP:{host}", "DNS:localhost", *names])
    key, csr, crt, extensions = (certs / name for name in ("tls.key", "tls.csr", "tls.crt", "tls.ext"))
    lc.openssl("req", "-new", "-newkey", "rsa:2048", "-nodes", "-subj", "/O=KEDAORG/CN=keda",
               "-keyout", str(key), "-out", str(csr))  # fmt: skip
    extensions.write_text("extendedKeyUsage=serverAuth,clientAuth\n"
                          f"keyUsage=digitalSignature,keyEncipherment\nsubjectAltName={san}\n")  # fmt: skip
    lc.openssl("x509", "-req", "-in", str(csr), "-CA", str(pki / "ca.crt"), "-CAkey", str(pki / "ca.key"),
               "-CAcreateserial", "-days", "30", "-extfile", str(extensions), "-out", str(crt))  # fmt: skip


def apply_crds(api: Any, bins: Path, processes: dict[str, Any], logs: Path) -> None:
    """KEDA's CRDs, each patched as its kustomization patches it, and wait until they are established."""
    monitoring = lc.monitoring_stack()
    names = []
    for crd in sorted((bins / CRD_FOLDER).glob("*.yaml")):
        group, plural = crd.stem.split("_", 1)
        name = f"{plural}.{group}"
        monitoring.create(api, monitoring.CRD_API, crd.read_bytes(), "application/yaml")
        patch = crd.with_name(f"{name}{PATCH_SUFFIX}")
        if patch.is_file():
            request = urllib.request.Request(
                f"{api.server}{monitoring.CRD_API}/{name}", data=patch.read_bytes(), method="PATCH",
                headers={"Content-Type": "application/json-patch+json"},
            )  # fmt: skip
            try:
                with urllib.request.urlopen(request, context=api.context, timeout=30):
                    pass
            except urllib.error.HTTPError as err:
                raise lc.ClusterError(
                    f"KEDA's patch of CRD {name}: HTTP {err.code}: {err.read()[:300]!r}"
                ) from None
        names.append(name)
    lc.wait_until("KEDA's CRDs", lambda: monitoring.crds_established(api, names), processes, logs)


def registration(host: str, port: int, ca: bytes) -> list[tuple[str, dict[str, Any]]]:
    """The metrics server's Service, its endpoints (this machine's address: no pod, no endpoints controller)
    and the APIService that sends external.metrics.k8s.io to it: (collection path, object)."""
    base = f"/api/v1/namespaces/{NAMESPACE}"
    meta = {"name": METRICS_SERVICE, "namespace": NAMESPACE}
    service = {"apiVersion": "v1", "kind": "Service", "metadata": meta,
               "spec": {"ports": [{"name": "https", "port": 443, "targetPort": port}]}}  # fmt: skip
    subset = {"addresses": [{"ip": host}], "ports": [{"name": "https", "port": port}]}
    endpoints = {"apiVersion": "v1", "kind": "Endpoints", "metadata": meta, "subsets": [subset]}
    labels = {
        "kubernetes.io/service-name": METRICS_SERVICE,
        "endpointslice.kubernetes.io/managed-by": "kvtune-local",
    }
    endpoint_slice = {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": f"{METRICS_SERVICE}-local", "namespace": NAMESPACE, "labels": labels},
        "addressType": "IPv4", "ports": [{"name": "https", "port": port, "protocol": "TCP"}],
        "endpoints": [{"addresses": [host], "conditions": {"ready": True}}],
    }  # fmt: skip
    api_service = {
        "apiVersion": "apiregistration.k8s.io/v1", "kind": "APIService", "metadata": {"name": APISERVICE},
        "spec": {"service": {"name": METRICS_SERVICE, "namespace": NAMESPACE, "port": 443},
                 "group": "external.metrics.k8s.io", "version": "v1beta1",
                 "caBundle": base64.b64encode(ca).decode(),
                 "groupPriorityMinimum": 100, "versionPriority": 100},
    }  # fmt: skip
    return [
        (f"{base}/services", service),
        (f"{base}/endpoints", endpoints),
        (f"/apis/discovery.k8s.io/v1/namespaces/{NAMESPACE}/endpointslices", endpoint_slice),
        ("/apis/apiregistration.k8s.io/v1/apiservices", api_service),
    ]


def answers(url: str, context: ssl.SSLContext | None = None) -> bool:
    with urllib.request.urlopen(url, timeout=2, context=context) as answer:
        return bool(answer.status == 200)


def up(folder: Path, server: str, processes: dict[str, Any]) -> dict[str, str]:
    """KEDA's CRDs, its operator and its metrics server, registered as the external metrics API, started into
    `processes` (so `down` stops them with the control plane); their addresses, also written to
    DIR/keda.json. Returns once the API server answers GET /apis/external.metrics.k8s.io/v1beta1."""
    bins = build()
    pki, logs = folder / "pki", folder / "logs"
    api = lc.Api(server, pki)
    host = host_address()
    keda_dir = folder / "keda"
    shutil.rmtree(keda_dir, ignore_errors=True)
    certs = keda_dir / "certs"
    certificates(pki, certs, host)
    apply_crds(api, bins, processes, logs)
    monitoring = lc.monitoring_stack()
    monitoring.create(api, "/api/v1/namespaces",
                      {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})  # fmt: skip

    grpc, health, operator_metrics, secure, adapter_metrics = (lc.free_port() for _ in range(5))
    addresses = {
        "metrics-apiserver": f"https://{host}:{secure}",
        "metrics-apiserver-metrics": f"http://127.0.0.1:{adapter_metrics}",
        "operator-grpc": f"127.0.0.1:{grpc}",
        "operator-health": f"http://127.0.0.1:{health}",
        "operator-metrics": f"http://127.0.0.1:{operator_metrics}",
    }
    kubeconfig = str(folder / lc.KUBECONFIG)
    env = {"KUBECONFIG": kubeconfig, "POD_NAMESPACE": NAMESPACE, "KEDA_CLUSTER_OBJECT_NAMESPACE": NAMESPACE,
           "WATCH_NAMESPACE": ""}  # fmt: skip
    processes["keda-operator"] = lc.start("keda-operator", [
        str(bins / "keda-operator"), "--leader-elect=false", "--zap-log-level=info", "--zap-encoder=console",
        f"--metrics-bind-address=127.0.0.1:{operator_metrics}",
        f"--health-probe-bind-address=127.0.0.1:{health}", f"--metrics-service-bind-address=127.0.0.1:{grpc}",
        f"--cert-dir={certs}", "--enable-cert-rotation=false",
    ], logs, env)  # fmt: skip
    processes["keda-adapter"] = lc.start("keda-adapter", [
        str(bins / "keda-adapter"), f"--secure-port={secure}", f"--bind-address={host}",
        f"--cert-dir={certs}",
        f"--tls-cert-file={certs / 'tls.crt'}", f"--tls-private-key-file={certs / 'tls.key'}",
        f"--client-ca-file={certs / 'ca.crt'}", f"--lister-kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}", f"--authorization-kubeconfig={kubeconfig}",
        f"--metrics-service-address=127.0.0.1:{grpc}", f"--port={adapter_metrics}", "--zap-log-level=info",
        "--zap-encoder=console",
    ], logs, env)  # fmt: skip
    (folder / STATE_FILE).write_text(json.dumps(addresses, indent=2) + "\n")
    lc.wait_until("KEDA's operator /readyz", lambda: answers(f"{addresses['operator-health']}/readyz"),
                  processes, logs)  # fmt: skip
    trusted = ssl.create_default_context(cafile=str(certs / "ca.crt"))
    adapter_ready = f"{addresses['metrics-apiserver']}/readyz"
    lc.wait_until("KEDA's metrics server /readyz", lambda: answers(adapter_ready, trusted), processes, logs)
    # registered once it serves, so the API server's first calls to it find it
    for path, body in registration(host, secure, (pki / "ca.crt").read_bytes()):
        monitoring.create(api, path, body)
    lc.wait_until(f"the external metrics API ({APISERVICE}, KEDA's metrics server)",
                  lambda: api.call("GET", EXTERNAL_METRICS)[0] == 200, processes, logs)  # fmt: skip
    return addresses


def main(argv: list[str]) -> int:
    def run() -> bool:
        if argv != ["build"]:
            return False
        print(f"KEDA's binaries ready in {build()}")
        return True

    return lc.cli("usage: python scripts/local_keda.py build", run)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
