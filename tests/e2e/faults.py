"""What the fault tests (test_faults.py) share: a vLLM-shaped Deployment tuned by a policy in Apply over an
engine that replays recorded scrapes, an admission webhook that catches the operator's patch in flight (so a
fault lands exactly then), etcd's own API for compaction, and the checks every fault ends with.

The webhook is a real ValidatingWebhookConfiguration the API server calls over HTTPS (a certificate from the
control plane's CA): the operator's PATCH of the Deployment reaches it only once the API server has accepted
the request and before anything is stored, so "a patch in flight" is an event the test waits for, not a time
it guesses."""

from __future__ import annotations

import base64
import json
import re
import signal
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from kubernetes import client

from kvtune.harness.local_http import free_port
from kvtune.operator.k8s.workload_actuator import read_flag
from tests.e2e.chart_release import policy, workload
from tests.e2e.cluster import Cluster, local_cluster, wait_for
from tests.operator.rbac_world import OLD_VLLM_IMAGE, VllmHandler, vllm_policy

FLAG = "--max-num-seqs"  # the old vLLM image's admission flag, the one the operator patches
START = 64
INTERVAL_S = 1
WEBHOOK = "kvtune-faults"
SCRAPE_MS = 500  # the local Prometheus' scrape interval: well inside one policy interval


class ReplayHandler(VllmHandler):
    """The recorded preempting scrapes of a kvtune engine (the first read the first file, later reads the
    last), as a vLLM's /metrics; each read's time is kept (the data a decision stood on), and `after_read`
    is called with the count once a read is answered."""

    def do_GET(self) -> None:
        if self.path != "/metrics":
            super().do_GET()
            return
        self.server.read_times.append(time.time())  # type: ignore[attr-defined]
        super().do_GET()
        self.wfile.flush()
        self.server.after_read(len(self.server.read_times))  # type: ignore[attr-defined]


def in_this_namespace(make: Callable[[], ThreadingHTTPServer]) -> ThreadingHTTPServer:
    return make()


@contextmanager
def replayed_engine(
    host: str = "127.0.0.1",
    inside: Callable[[Callable[[], ThreadingHTTPServer]], ThreadingHTTPServer] = in_this_namespace,
    after_read: Callable[[int], None] = lambda count: None,
) -> Iterator[ThreadingHTTPServer]:
    """A vLLM-shaped engine replaying recorded scrapes at `host` (bound `inside` a network namespace: the
    pods'), read by the operator at its URL."""
    server = inside(lambda: ThreadingHTTPServer((host, 0), ReplayHandler))
    server.after_read = after_read  # type: ignore[attr-defined]
    server.files = ["kvtune_preempting_t0.prom", "kvtune_preempting_t1.prom"]  # type: ignore[attr-defined]
    server.admin_tokens = []  # type: ignore[attr-defined]
    server.version = None  # type: ignore[attr-defined]
    server.read_times = []  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def url_of(server: ThreadingHTTPServer) -> str:
    host, port = server.server_address[:2]
    return f"http://{host!s}:{port}"


@dataclass
class Tuned:
    """One vLLM-shaped Deployment (on kwok) and its KVTuningPolicy in Apply over a replayed engine."""

    cluster: Cluster
    namespace: str
    name: str
    engine: ThreadingHTTPServer
    pool: str

    def create_workload(self) -> None:
        deployment = workload("Deployment", self.name, self.namespace, OLD_VLLM_IMAGE,
                              ["--model", "m", f"{FLAG}={START}"])  # fmt: skip
        deployment["spec"]["template"]["spec"]["nodeSelector"] = {"kvtune-e2e/pool": self.pool}
        self.cluster.apply(deployment)
        self.cluster.kubectl("rollout", "status", f"deployment/{self.name}", "-n", self.namespace,
                             "--timeout", "90s")  # fmt: skip

    def create_policy(self, metrics: dict[str, Any] | None = None) -> None:
        """The policy, reading the engine's /metrics (or `metrics`: spec.metrics, e.g. through Prometheus)."""
        spec = vllm_policy("Deployment", self.name, url_of(self.engine))
        if metrics is not None:
            spec["metrics"] = metrics
        # a window longer than any fault: the evidence of the first two reads stays in it, so the decision
        # after a fault stands on the same figures as without one
        spec.update(intervalSeconds=INTERVAL_S, evaluationWindowSeconds=600)
        self.cluster.apply(policy(self.name, self.namespace, spec))

    def delete_policy(self) -> None:
        """The policy deleted (its engine goes with the test), not waited for: the operator removes its
        finalizer while it runs, and the control plane is this module's own."""
        self.cluster.kubectl(
            "delete", "kvtp", self.name, "-n", self.namespace, "--ignore-not-found", "--wait=false"
        )

    def status(self) -> dict[str, Any]:
        found: dict[str, Any] = self.cluster.policy(self.namespace, self.name).get("status") or {}
        return found

    def applied(self) -> list[dict[str, Any]]:
        return [h for h in self.status().get("history") or [] if h["kind"] == "applied"]

    def events(self, reason: str) -> list[str]:
        return [e["message"] for e in self.cluster.events(self.namespace, self.name) if e["reason"] == reason]

    def deployment(self) -> dict[str, Any]:
        return self.cluster.get("deployment", self.name, self.namespace)

    def held(self) -> int | None:
        (container,) = self.deployment()["spec"]["template"]["spec"]["containers"]
        return read_flag([str(a) for a in container["args"]], FLAG)

    def decided(self) -> dict[str, Any]:
        """The first action, once the TuningApplied Event and the status both show it."""
        wait_for(f"the operator to act on {self.name}", lambda: self.events("TuningApplied"))
        (entry,) = wait_for(f"the action in {self.name}'s status history", self.applied)
        return entry


@dataclass
class Decision:
    """What a policy decided: the knob, from, to (the figures of the action, without its times)."""

    knob: str
    before: Any
    after: Any
    remedy: str

    @staticmethod
    def of(entry: dict[str, Any]) -> Decision:
        return Decision(entry["knob"], entry["before"], entry["after"], entry["remedy"])


@dataclass
class Review:
    """One admission request for the operator's write of a Deployment, as the webhook saw it."""

    name: str
    at: float
    admitted: bool


@dataclass
class PatchCatcher:
    """An HTTPS validating webhook the API server calls for the operator's writes to Deployments: before
    answering the first one for an armed Deployment it runs that Deployment's fault (and refuses the write
    when armed so: a patch that is never stored); it admits every other."""

    server: ThreadingHTTPServer
    armed: dict[str, tuple[Callable[[], None], bool]] = field(default_factory=dict)
    fired: dict[str, threading.Event] = field(default_factory=dict)
    reviews: list[Review] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.server.server_address[1]}/validate"

    def arm(self, name: str, fault: Callable[[], None], admit: bool = True) -> threading.Event:
        self.fired[name] = threading.Event()
        self.armed[name] = (fault, admit)
        return self.fired[name]

    def review(self, request: dict[str, Any]) -> bool:
        """Run the armed fault, if any; whether the write is admitted."""
        name = str(request.get("name"))
        with self.lock:
            fault, admit = self.armed.pop(name, (None, True))
            self.reviews.append(Review(name, time.time(), admit))
        if fault is not None:
            fault()
            self.fired[name].set()
        return admit

    def landed(self, name: str) -> list[float]:
        """When the API server was let store each of the operator's writes of `name` (the last one stored)."""
        return [r.at for r in self.reviews if r.name == name and r.admitted]


class WebhookHandler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        request = body.get("request") or {}
        catcher: PatchCatcher = self.server.catcher  # type: ignore[attr-defined]
        allowed = catcher.review(request)
        response: dict[str, Any] = {"uid": request.get("uid"), "allowed": allowed}
        if not allowed:
            response["status"] = {
                "code": 503,
                "message": "kvtune-faults: the writer was lost before its patch",
            }
        answer = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response}
        data = json.dumps(answer).encode()
        try:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:  # the fault took the API server away while it waited for this answer
            pass

    def log_message(self, *args: Any) -> None:
        pass


def serving_certificate(pki: Path, folder: Path) -> tuple[Path, Path]:
    """A serving certificate for 127.0.0.1 signed by the control plane's CA (the webhook's caBundle)."""
    lc = local_cluster()
    key, csr, crt, ext = (folder / f"webhook.{suffix}" for suffix in ("key", "csr", "crt", "ext"))
    lc.openssl("req", "-new", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=kvtune-faults-webhook",
               "-keyout", str(key), "-out", str(csr))  # fmt: skip
    ext.write_text("extendedKeyUsage=serverAuth\nkeyUsage=digitalSignature,keyEncipherment\n"
                   "subjectAltName=IP:127.0.0.1\n")  # fmt: skip
    lc.openssl("x509", "-req", "-in", str(csr), "-CA", str(pki / "ca.crt"), "-CAkey", str(pki / "ca.key"),
               "-CAcreateserial", "-days", "1", "-extfile", str(ext), "-out", str(crt))  # fmt: skip
    return crt, key


@contextmanager
def patch_catcher(cluster: Cluster, namespace: str, username: str, folder: Path) -> Iterator[PatchCatcher]:
    """The webhook, registered for `username`'s UPDATEs (a merge patch is one) of Deployments in `namespace`;
    failurePolicy Ignore, so nothing is held once it is gone."""
    crt, key = serving_certificate(cluster.folder / "pki", folder)
    server = ThreadingHTTPServer(("127.0.0.1", 0), WebhookHandler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(str(crt), str(key))
    server.socket = context.wrap_socket(server.socket, server_side=True)
    catcher = PatchCatcher(server)
    server.catcher = catcher  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    ca = base64.b64encode((cluster.folder / "pki" / "ca.crt").read_bytes()).decode()
    configuration = {
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": WEBHOOK},
        "webhooks": [{
            "name": "patch-in-flight.faults.kvtune.dev", "clientConfig": {"url": catcher.url, "caBundle": ca},
            "rules": [{"apiGroups": ["apps"], "apiVersions": ["v1"], "operations": ["UPDATE"],
                       "resources": ["deployments"], "scope": "Namespaced"}],
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
            "matchConditions": [{"name": "the-operator", "expression": f"request.userInfo.username == '{username}'"}],
            "sideEffects": "None", "admissionReviewVersions": ["v1"], "failurePolicy": "Ignore", "timeoutSeconds": 30,
        }],
    }  # fmt: skip
    cluster.apply(configuration)
    try:
        yield catcher
    finally:
        cluster.kubectl("delete", "validatingwebhookconfiguration", WEBHOOK, "--ignore-not-found")
        server.shutdown()
        server.server_close()


def etcd_url(cluster: Cluster) -> str:
    """The etcd client URL `up` started etcd with (its state file)."""
    state = json.loads((cluster.folder / local_cluster().STATE_FILE).read_text())
    argv: list[str] = state["launches"]["etcd"]["argv"]
    return argv[argv.index("--listen-client-urls") + 1]


def etcd(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """One call of etcd's v3 JSON gateway (what etcdctl speaks over gRPC)."""
    request = urllib.request.Request(f"{url}{path}", data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=10) as answer:
        found: dict[str, Any] = json.loads(answer.read())
        return found


def etcd_revision(url: str) -> int:
    return int(
        etcd(url, "/v3/kv/range", {"key": base64.b64encode(b"/kvtune-faults").decode()})["header"]["revision"]
    )


def move_and_compact(url: str, writes: int) -> tuple[int, int]:
    """`writes` puts (outside the API server's keys) to move etcd's revision, then a physical compaction at
    it: every revision before is gone. The revisions before and after."""
    before = etcd_revision(url)
    for index in range(writes):
        value = base64.b64encode(str(index).encode()).decode()
        etcd(url, "/v3/kv/put", {"key": base64.b64encode(b"/kvtune-faults/filler").decode(), "value": value})
    after = etcd_revision(url)
    etcd(url, "/v3/kv/compaction", {"revision": str(after), "physical": True})
    return before, after


def compacted(url: str, revision: int) -> str | None:
    """etcd's refusal of a read at `revision` (compacted away), or None while it still serves it."""
    try:
        etcd(
            url,
            "/v3/kv/range",
            {"key": base64.b64encode(b"/kvtune-faults").decode(), "revision": str(revision)},
        )
    except urllib.error.HTTPError as refused:
        return str(json.loads(refused.read()).get("message"))
    return None


def watch_expired(cluster: Cluster, namespace: str, resource_version: str) -> str | None:
    """What a watch of the namespace's policies from `resource_version` answers: the 410's message, or None
    when it is still served."""
    path = (f"/apis/kvtune.dev/v1alpha1/namespaces/{namespace}/kvtuningpolicies?watch=true"
            f"&resourceVersion={resource_version}&timeoutSeconds=1")  # fmt: skip
    answer = cluster.kubectl("get", "--raw", path, check=False)
    if answer.returncode != 0:  # refused as a whole (HTTP 410) rather than as an ERROR event in the stream
        return answer.stderr.strip() if "410" in answer.stderr or "Gone" in answer.stderr else None
    for line in answer.stdout.splitlines():
        event = json.loads(line)
        if event["type"] == "ERROR" and event["object"].get("code") == 410:
            return str(event["object"].get("message"))
    return None


def policies_version(cluster: Cluster, namespace: str) -> str:
    """The resourceVersion a list of the namespace's policies is at now (where a watch from it would start)."""
    found: dict[str, Any] = client.CustomObjectsApi(cluster.api).list_namespaced_custom_object(
        "kvtune.dev", "v1alpha1", namespace, "kvtuningpolicies"
    )
    return str(found["metadata"]["resourceVersion"])


@dataclass
class Outage:
    """When a fault began and when it ended (the part back, the link up), on the monotonic clock: what it cost
    is recorded once the operator has acted."""

    began: float = field(default_factory=time.monotonic)
    ended: float | None = None

    def end(self) -> None:
        self.ended = time.monotonic()

    def record(self, fault: str, record: Callable[[str, object], None]) -> None:
        """The outage and the recovery (its end to the operator's action), printed (pytest -s) and in the run's
        report (record_testsuite_property: the junit XML)."""
        acted = time.monotonic()
        ended = self.ended if self.ended is not None else acted
        print(f"fault {fault}: outage {ended - self.began:.1f} s, recovered {acted - ended:.1f} s after it "
              f"({acted - self.began:.1f} s from the fault to the action)")  # fmt: skip
        record(f"outage_s[{fault}]", round(ended - self.began, 2))
        record(f"recovery_s[{fault}]", round(acted - ended, 2))


def operator_said(log: Callable[[], str], pattern: str, since: int) -> list[str]:
    """The operator's log lines after offset `since` that match `pattern`."""
    return re.findall(rf".*{pattern}.*", log()[since:])


def assert_nothing_lost(tuned: Tuned, baseline: Decision) -> None:
    """status.original holds the value before the operator's first change (what an undo puts back), the
    history holds exactly the one action, as without the fault, the tuner state has it pending (judged on
    the new pods' window: a rollout moves its start) and the value it holds is the one it set."""
    status = tuned.status()
    assert status.get("original") == {"maxNumSeqs": START}, status.get("original")
    applied = tuned.applied()
    assert [Decision.of(h) for h in applied] == [baseline], applied
    tuner = status["tunerState"]
    pending = tuner.get("pending") or {}
    assert (pending.get("knob"), pending.get("before"), pending.get("after")) == (
        baseline.knob, baseline.before, baseline.after), tuner  # fmt: skip
    assert tuner["lastActionAt"] >= applied[0]["at"], tuner
    assert (status.get("desired") or {}).get("maxNumSeqs") == baseline.after, status.get("desired")
    assert status.get("undo") is None  # nothing asked for an undo; nothing answered one


def assert_applied_once_on_fresh_data(tuned: Tuned, catcher: PatchCatcher, baseline: Decision) -> float:
    """One patch of the workload (one new generation, one TuningApplied Event, the decided value in its
    args), made within one interval of the scrape it was decided on (the policy's one reader reads, decides
    and patches in one evaluation: the last read before the patch is its evidence); the patch's time."""
    assert tuned.held() == baseline.after
    assert tuned.deployment()["metadata"]["generation"] == 2, "the workload was patched more than once"
    assert len(tuned.events("TuningApplied")) == 1, tuned.events("TuningApplied")
    landed = catcher.landed(tuned.name)[-1]  # the patch the API server stored: the last one it admitted
    reads = [t for t in tuned.engine.read_times if t <= landed]  # type: ignore[attr-defined]
    assert landed - reads[-1] <= INTERVAL_S, f"patched {landed - reads[-1]:.1f} s after the data it stood on"
    return landed


@dataclass
class LocalPrometheus:
    """A real Prometheus 3 (`make monitoring-tools`' binary) as its own process, scraping one engine every
    SCRAPE_MS under job `job`: stopped with SIGKILL and started again on the same TSDB, as a crashed pod is."""

    folder: Path
    target: str  # host:port
    job: str
    port: int = 0
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> LocalPrometheus:
        lc = local_cluster()
        binary = lc.monitoring_stack().monbins_dir() / "prometheus"
        assert binary.exists(), f"{binary} missing: run `make monitoring-tools`, which `make test` does"
        config = self.folder / "prometheus.yml"
        config.write_text(json.dumps({
            "global": {"scrape_interval": f"{SCRAPE_MS}ms", "scrape_timeout": f"{SCRAPE_MS}ms"},
            "scrape_configs": [{"job_name": self.job, "static_configs": [{"targets": [self.target]}]}],
        }))  # fmt: skip
        if not self.port:
            self.port = free_port()
        argv = [str(binary), f"--config.file={config}", f"--storage.tsdb.path={self.folder / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}"]  # fmt: skip
        with (self.folder / "prometheus.log").open("ab") as log:
            self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        wait_for(
            "Prometheus ready",
            lambda: self.ready() or self.process is None or self.process.poll() is not None,
        )
        assert self.process.poll() is None, (self.folder / "prometheus.log").read_text()[-3000:]
        return self

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as answer:
                return bool(answer.status == 200)
        except OSError:
            return False

    def scraped(self) -> bool:
        """Whether the engine's series are in Prometheus (its `up` for the job is 1)."""
        query = urllib.parse.urlencode({"query": f'up{{job="{self.job}"}}'})
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/query?{query}", timeout=2) as answer:
                result = json.loads(answer.read())["data"]["result"]
        except (OSError, ValueError, KeyError):
            return False
        return bool(result) and result[0]["value"][1] == "1"

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()


def stored_after(tuned: Tuned, catcher: PatchCatcher, since: float) -> float:
    """The patch the API server stored was one admitted at or after `since` (the fault's end), not the one
    caught in flight: that one was given up, never stored late (see assert_applied_once_on_fresh_data)."""
    landed = catcher.landed(tuned.name)
    assert len(landed) >= 2 and landed[-1] >= since, (landed, since)
    return landed[-1]
