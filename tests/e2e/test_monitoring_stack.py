"""The chart in the monitoring stack people run: `local_cluster.py up --monitoring` (prometheus-operator
v0.85, Prometheus 3, Alertmanager), the chart installed with its PodMonitor on, and real engines as pods.

What must hold, each through the real parts: prometheus-operator turns the chart's ServiceMonitor, PodMonitor
and PrometheusRule into Prometheus' configuration; Prometheus 3 scrapes every engine pod through the
PodMonitor and the operator through its ServiceMonitor; the rules load; `KVCachePreemptions` fires within
two evaluation intervals of the first preemption Prometheus saw and reaches Alertmanager with its
`runbook_url` and `doctor`; `kvtune doctor --prometheus` and a policy reading that Prometheus decide as they
do from the engine's own /metrics; every query of the three dashboards returns data. KServe's and llm-d's
layouts (deploy/layouts/), each a release of its own, scrape pods shaped as theirs: over HTTPS by port
number, and by port name past a routing proxy.

The engine pods are Pod objects kwok runs (no containers), whose `status.podIP` is set, as a kubelet and a
CNI would, to the address where a real engine listens in the run's pod network (pod_network.py). The
operator runs as a process with the release's ServiceAccount; its metrics Service's EndpointSlice names the
host's end of the pod network, where it listens.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from kvtune.dashboards.panels import all_panel_queries
from kvtune.dashboards.report import all_variables
from kvtune.harness.engine_process import start_engine, write_tiny_model_in_subprocess
from kvtune.harness.local_http import free_port
from kvtune.harness.server import ServerProcess
from tests.e2e.cluster import (
    CHART,
    REGISTRY,
    REPO,
    Cluster,
    Operator,
    chart_operator,
    control_plane,
    kwok_node,
    wait_for,
)
from tests.e2e.pod_network import PodNetwork
from tests.e2e.workloads import MAX_NUM_SEQS, container, engine_port, preempting_load, vllm_deployment
from tests.observability.tools import local_monitoring

RELEASE, SYSTEM, WATCHED = "kvtune", "kvtune-system", "llm"
APP = "tiny-engine"  # the engine pods' label, the PodMonitor's selector
SCRAPE = "1s"  # the monitors' own intervals: a test sees a scrape a second
WAIT_S = 180.0  # a hang deadline: every wait ends at its event
POLICY = "tiny"


def prometheus_get(cluster: Cluster, path: str, **params: str) -> Any:
    answer = httpx.get(f"{cluster.monitoring['prometheus']}{path}", params=params, timeout=10)
    body = answer.json()
    assert answer.status_code == 200 and body.get("status") == "success", body
    return body["data"]


def query(cluster: Cluster, expr: str) -> list[dict[str, Any]]:
    result: list[dict[str, Any]] = prometheus_get(cluster, "/api/v1/query", query=expr)["result"]
    return result


@pytest.fixture(scope="module")
def monitored(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A control plane of this module's own, `up --monitoring`, and `down` after."""
    with control_plane(tmp_path_factory.mktemp("monitored-control-plane"), monitoring=True) as started:
        yield started


@pytest.fixture(scope="module")
def release(monitored: Cluster) -> dict[str, Any]:
    """The chart with monitoring on, as a kube-prometheus-stack user installs it: the default
    `release: kube-prometheus-stack` label, the PodMonitor over the engines' pods, the alerts' doctor
    pointed at this Prometheus."""
    monitored.namespace(WATCHED)
    monitored.helm("install", RELEASE, str(CHART), "--namespace", SYSTEM, "--create-namespace",
                   "--set", f"image.repository={REGISTRY}/kvtune-operator",
                   "--set-json", f"watchNamespaces={json.dumps([WATCHED])}",
                   "--set", "monitoring.podMonitor.enabled=true",
                   "--set-json", f'monitoring.podMonitor.selector={{"matchLabels":{{"app":"{APP}"}}}}',
                   "--set", f"monitoring.podMonitor.interval={SCRAPE}",
                   "--set", f"monitoring.serviceMonitor.interval={SCRAPE}",
                   "--set", f"monitoring.prometheusRule.prometheusUrl={monitored.monitoring['prometheus']}")  # fmt: skip
    rendered = monitored.kubectl(
        "get", "prometheusrules.monitoring.coreos.com", RELEASE, "-n", SYSTEM, "-o", "json"
    )
    return {"rule": json.loads(rendered.stdout)}


@pytest.fixture(scope="module")
def engine_pods(monitored: Cluster, release: dict[str, Any], engines: list[ServerProcess]) -> dict[str, str]:
    """The engines as the pods of a vLLM-style Deployment (pod name -> the engine's address): kwok runs
    them, each with its engine's address as its IP and its port as the container's `http` port, as the
    chart's PodMonitor selects by default."""
    port = engine_port(engines)
    workload = vllm_deployment(APP, WATCHED, APP, replicas=len(engines),
                               args=["--model", "/models/tiny", "--port", str(port), "--max-num-seqs", str(MAX_NUM_SEQS)])  # fmt: skip
    container(workload, "vllm")["ports"] = [{"name": "http", "containerPort": port}]
    kwok_node(monitored, "engines-0", APP)
    monitored.apply(workload)
    monitored.kubectl("rollout", "status", f"deployment/{APP}", "-n", WATCHED, "--timeout", "90s")
    found = json.loads(
        monitored.kubectl("get", "pods", "-n", WATCHED, "-l", f"app={APP}", "-o", "json").stdout
    )
    names = sorted(item["metadata"]["name"] for item in found["items"])
    assert len(names) == len(engines), names
    pods = {}
    for name, engine in zip(names, engines, strict=True):
        host = engine.url.removeprefix("http://").rsplit(":", 1)[0]
        status = {"status": {"podIP": host, "podIPs": [{"ip": host}]}}
        monitored.kubectl("patch", "pod", name, "-n", WATCHED, "--subresource=status", "--type=merge",
                          "-p", json.dumps(status))  # fmt: skip
        assert monitored.get("pod", name, WATCHED)["status"]["podIP"] == host
        pods[name] = engine.url
    return pods


@pytest.fixture(scope="module")
def operator(
    monitored: Cluster, release: dict[str, Any], pods: PodNetwork, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Operator]:
    """The release's operator as a process (its ServiceAccount), its /metrics on the host's end of the pod
    network, where the metrics Service's EndpointSlice points."""
    port = free_port()
    running = chart_operator(monitored, RELEASE, SYSTEM, tmp_path_factory.mktemp("operator") / "operator.log",
                             metrics_port=port).start()  # fmt: skip
    # both of what a cluster's endpoint controllers keep (neither runs here): prometheus-operator discovers
    # a ServiceMonitor's targets through Endpoints by default, the operator's peers through EndpointSlices
    monitored.apply({
        "apiVersion": "v1", "kind": "Endpoints",
        "metadata": {"name": f"{RELEASE}-metrics", "namespace": SYSTEM},
        "subsets": [{"addresses": [{"ip": pods.host_address}],
                     "ports": [{"name": "metrics", "port": port, "protocol": "TCP"}]}],
    }, {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": f"{RELEASE}-metrics-e2e", "namespace": SYSTEM,
                     "labels": {"kubernetes.io/service-name": f"{RELEASE}-metrics",
                                "endpointslice.kubernetes.io/managed-by": "kvtune-e2e"}},
        "addressType": "IPv4",
        "ports": [{"name": "metrics", "port": port, "protocol": "TCP"}],
        "endpoints": [{"addresses": [pods.host_address], "conditions": {"ready": True}}],
    })  # fmt: skip
    yield running
    running.stop()


def active_targets(cluster: Cluster, job_prefix: str) -> list[dict[str, Any]]:
    targets = prometheus_get(cluster, "/api/v1/targets", state="active")["activeTargets"]
    return [t for t in targets if t["labels"].get("job", "").startswith(job_prefix) or
            t.get("scrapePool", "").startswith(job_prefix)]  # fmt: skip


def test_prometheus_3_runs_what_prometheus_operator_made_of_the_charts_monitors(
    monitored: Cluster, release: dict[str, Any]
) -> None:
    buildinfo = prometheus_get(monitored, "/api/v1/status/buildinfo")
    assert buildinfo["version"] == local_monitoring().PROMETHEUS_VERSION and buildinfo["version"].startswith(
        "3."
    )
    wanted = (f"serviceMonitor/{SYSTEM}/{RELEASE}/0", f"podMonitor/{SYSTEM}/{RELEASE}-engines/0")

    def jobs() -> list[str] | None:
        config = yaml.safe_load(prometheus_get(monitored, "/api/v1/status/config")["yaml"])
        names = [job["job_name"] for job in config.get("scrape_configs") or []]
        return names if all(job in names for job in wanted) else None

    wait_for("prometheus-operator's scrape jobs for the chart's monitors in Prometheus", jobs, timeout=WAIT_S)
    groups = [group["name"] for group in release["rule"]["spec"]["groups"]]

    def loaded() -> list[dict[str, Any]] | None:
        found = prometheus_get(monitored, "/api/v1/rules")["groups"]
        return found if sorted(g["name"] for g in found) == sorted(groups) else None

    found = wait_for("the PrometheusRule's groups loaded", loaded, timeout=WAIT_S)
    rules = [rule for group in found for rule in group["rules"]]
    assert rules and all(rule["health"] != "err" for rule in rules), [
        r for r in rules if r["health"] == "err"
    ]
    alerts = {rule["name"] for rule in rules if rule["type"] == "alerting"}
    assert "KVCachePreemptions" in alerts


def test_every_engine_pod_and_the_operator_are_scraped(
    monitored: Cluster, engine_pods: dict[str, str], operator: Operator
) -> None:
    def up() -> dict[str, str] | None:
        engines = {t["labels"].get("pod", ""): t["health"]
                   for t in active_targets(monitored, f"podMonitor/{SYSTEM}/{RELEASE}-engines")}  # fmt: skip
        own = [t["health"] for t in active_targets(monitored, f"serviceMonitor/{SYSTEM}/{RELEASE}")]
        ready = set(engines) == set(engine_pods) and set(engines.values()) == {"up"} and own == ["up"]
        return {**engines, "operator": ",".join(own)} if ready else None

    try:
        healths = wait_for("every engine pod's target and the operator's up", up, timeout=WAIT_S)
    except AssertionError as missed:
        found = prometheus_get(monitored, "/api/v1/targets")
        seen = [(t.get("scrapePool"), t["labels"].get("pod"), t["health"], t.get("lastError"))
                for t in found["activeTargets"]]  # fmt: skip
        raise AssertionError(f"{missed}\nactive: {seen}\ndropped: {found['droppedTargets'][:2]}") from None
    assert set(healths) == {*engine_pods, "operator"}
    # an engine's series carry its pod's namespace and name, as every rule and panel reads them
    wait_for("kvtune_engine:up recorded for every engine pod", lambda: sorted(
        series["metric"]["pod"] for series in query(monitored, f'kvtune_engine:up{{namespace="{WATCHED}"}}')
    ) == sorted(engine_pods), timeout=WAIT_S)  # fmt: skip


def first_increase(cluster: Cluster, series: str) -> float:
    """The timestamp of the first scraped sample where the counter `series` rose: the first preemption
    Prometheus saw (the engines may have preempted for other tests before their pods were scraped)."""
    (found,) = query(cluster, f"{series}[30m]")
    values = [(float(ts), float(value)) for ts, value in found["values"]]
    return next(ts for (ts, value), (_, before) in zip(values[1:], values, strict=False) if value > before)


def alertmanager_alerts(cluster: Cluster, name: str) -> list[dict[str, Any]]:
    answer = httpx.get(f"{cluster.monitoring['alertmanager']}/api/v2/alerts", timeout=10,
                       params={"filter": f'alertname="{name}"', "active": "true"})  # fmt: skip
    assert answer.status_code == 200, answer.text
    alerts: list[dict[str, Any]] = answer.json()
    return alerts


def test_the_preemption_alert_fires_within_two_evaluations_and_reaches_alertmanager(
    monitored: Cluster, engine_pods: dict[str, str], engines: list[ServerProcess], operator: Operator
) -> None:
    pod = sorted(engine_pods)[0]
    with preempting_load(engines[:1]):
        reached = wait_for("KVCachePreemptions at Alertmanager",
                           lambda: [a for a in alertmanager_alerts(monitored, "KVCachePreemptions")
                                    if a["labels"].get("pod") == pod], timeout=WAIT_S)  # fmt: skip
    annotations = reached[0]["annotations"]
    assert annotations["runbook_url"].endswith("/KVCachePreemptions.md"), annotations
    assert f"--prometheus {monitored.monitoring['prometheus']}" in annotations["doctor"], annotations
    assert f'pod="{pod}"' in annotations["doctor"] and f'namespace="{WATCHED}"' in annotations["doctor"]

    seen = first_increase(monitored, f'vllm:num_preemptions_total{{namespace="{WATCHED}",pod="{pod}"}}')
    (firing,) = [a for a in prometheus_get(monitored, "/api/v1/alerts")["alerts"]
                 if a["labels"]["alertname"] == "KVCachePreemptions" and a["labels"].get("pod") == pod]  # fmt: skip
    active_at = datetime.fromisoformat(firing["activeAt"].replace("Z", "+00:00")).timestamp()
    interval = parse_seconds(local_monitoring().EVALUATION_INTERVAL)
    print(f"KVCachePreemptions active {active_at - seen:.2f} s after the first preempted sample")
    assert active_at - seen <= 2 * interval, (
        f"KVCachePreemptions became active {active_at - seen:.2f} s after the first preempted sample "
        f"(evaluation interval {interval:.0f} s)"
    )


def parse_seconds(text: str) -> float:
    assert text.endswith("s"), text
    return float(text[:-1])


def doctor(*args: str) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-m", "kvtune.cli", "doctor", "--json", "--no-what-if", *args],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    report: dict[str, Any] = json.loads(done.stdout)
    return report


def test_the_doctor_decides_from_prometheus_3_as_from_the_engine(
    monitored: Cluster, engine_pods: dict[str, str], engines: list[ServerProcess]
) -> None:
    """Under the same preempting load, the doctor through Prometheus 3 (the selector the alert's `doctor`
    names) and the doctor on the engine's /metrics see the same engine and prescribe the same first remedy."""
    selector = f'namespace="{WATCHED}",pod="{sorted(engine_pods)[1]}"'
    with preempting_load(engines[1:2]):
        wait_for("the second engine's preemptions in Prometheus", lambda: any(
            float(s["value"][1]) > 0 for s in query(monitored, f"kvtune_engine:preemptions:increase5m{{{selector}}}")
        ), timeout=WAIT_S)  # fmt: skip
        direct = doctor("--metrics-url", engines[1].url, "--window-seconds", "6")
        through = doctor(
            "--prometheus", monitored.monitoring["prometheus"], "--selector", selector, "--since", "2m"
        )
    assert direct["status"] == through["status"] == "active", (direct["status"], through["status"])
    assert direct["findings"]["preemptions"] > 0 and through["findings"]["preemptions"] > 0
    for key in ("kv_pool_tokens", "max_num_seqs"):
        assert direct["findings"][key] == through["findings"][key], key
    first = [[r["remedy"] for r in report["remedies"] if r["applicable"]][:1] for report in (direct, through)]
    assert first[0] and first[0] == first[1], first


def test_a_policy_reading_prometheus_3_recommends(
    monitored: Cluster, engine_pods: dict[str, str], engines: list[ServerProcess], operator: Operator
) -> None:
    """The README's shape of policy (Prometheus, pod by pod) on the engines' pods, through this Prometheus."""
    monitored.apply({
        "apiVersion": "kvtune.dev/v1alpha1", "kind": "KVTuningPolicy",
        "metadata": {"name": POLICY, "namespace": WATCHED},
        "spec": {"target": {"name": APP, "container": "vllm", "engine": "vllm"},
                 "metrics": {"prometheus": {"url": monitored.monitoring["prometheus"],
                                            "selector": f'namespace="{WATCHED}",pod=~"{APP}-.*"', "byPod": True}},
                 "mode": "Recommend", "intervalSeconds": 1, "evaluationWindowSeconds": 600, "cooldownSeconds": 0},
    })  # fmt: skip
    with preempting_load(engines):
        condition = wait_for("the policy's Preempting condition from Prometheus 3", lambda: (
            (c := monitored.condition(WATCHED, POLICY, "Preempting")) and c["status"] == "True" and c
        ), timeout=WAIT_S)  # fmt: skip
    assert condition["status"] == "True"
    pods = {pod["name"] for pod in monitored.policy(WATCHED, POLICY)["status"].get("pods") or []}
    assert pods and pods <= set(engine_pods), pods


def test_every_dashboard_query_returns_data_on_prometheus_3(
    monitored: Cluster, engine_pods: dict[str, str], engines: list[ServerProcess], operator: Operator
) -> None:
    def empty() -> list[str]:
        return [f"{q.dashboard_uid} / {q.panel_title}: {q.expr}" for q in all_panel_queries()
                if not query(monitored, all_variables(q.expr))]  # fmt: skip

    with preempting_load(engines):
        deadline = time.monotonic() + WAIT_S
        missing = empty()
        while missing and time.monotonic() < deadline:
            time.sleep(1)
            missing = empty()
    assert not missing, "panel queries without data on Prometheus 3:\n" + "\n".join(missing)


@dataclass(frozen=True)
class Layout:
    """A layout's values file installed as a release of its own (its PodMonitor only: no second operator
    monitor, no second set of rules), watching a namespace with one pod shaped as that layout's engine pod."""

    name: str  # deploy/layouts/<name>.yaml; the release is kvtune-<name>, watching <name>-llm
    pod: dict[str, Any]  # the pod's metadata.labels and spec.containers
    port: int  # where the engine listens
    index: int  # its address in the pods' /24
    https: bool = False

    @property
    def release(self) -> str:
        return f"kvtune-{self.name}"

    @property
    def watched(self) -> str:
        return f"{self.name}-llm"


KSERVE = Layout(  # an LLMInferenceService's workload: vLLM in `main`, HTTPS on 8000, a port with no name
    "kserve",
    {"labels": {"app.kubernetes.io/part-of": "llminferenceservice",
                "app.kubernetes.io/component": "llminferenceservice-workload"},
     "containers": [{"name": "main", "image": "vllm/vllm-openai:v0.32.0", "ports": [{"containerPort": 8000}]}]},
    port=8000, index=9, https=True,
)  # fmt: skip
LLM_D = Layout(  # llm-d's decode pod: the routing proxy on 8000, vLLM on 8200 with its port named `metrics`
    "llm-d",
    {"labels": {"llm-d.ai/inference-serving": "true", "llm-d.ai/role": "decode"},
     "containers": [{"name": "routing-proxy", "image": "ghcr.io/llm-d/llm-d-routing-sidecar:v0.2.0",
                     "ports": [{"containerPort": 8000}]},
                    {"name": "vllm", "image": "ghcr.io/llm-d/llm-d:v0.2.0",
                     "ports": [{"name": "metrics", "containerPort": 8200}]}]},
    port=8200, index=10,
)  # fmt: skip


@contextmanager
def layout_engine(
    monitored: Cluster, pods: PodNetwork, layout: Layout, folder: Path
) -> Iterator[dict[str, str]]:
    """The layout's release, its pod (Running under kwok, its IP where a real engine listens), and that
    engine, over HTTPS with a self-signed certificate where the layout scrapes so."""
    tls = None
    if layout.https:
        tls = folder / "tls.crt", folder / "tls.key"
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                        f"/CN={layout.name}-engine", "-keyout", str(tls[1]), "-out", str(tls[0])], check=True,
                       capture_output=True)  # fmt: skip
    token = folder / "token"
    token.write_text(f"{layout.name}-layout-token\n")
    address = pods.address(layout.index)
    engine = pods.run(start_engine, write_tiny_model_in_subprocess(folder / "tiny"), token, folder / "engine.log",
                      port=layout.port, host=address, boot_timeout=240, tls=tls)  # fmt: skip
    try:
        monitored.namespace(layout.watched)
        monitored.helm("install", layout.release, str(CHART), "--namespace", f"{layout.release}-system",
                       "--create-namespace", "-f", str(REPO / "deploy" / "layouts" / f"{layout.name}.yaml"),
                       "--set", f"image.repository={REGISTRY}/kvtune-operator",
                       "--set-json", f"watchNamespaces={json.dumps([layout.watched])}",
                       "--set", f"monitoring.podMonitor.interval={SCRAPE}",
                       "--set", "monitoring.serviceMonitor.enabled=false",
                       "--set", "monitoring.prometheusRule.enabled=false")  # fmt: skip
        name = f"{layout.name}-engine-0"
        monitored.apply({"apiVersion": "v1", "kind": "Pod",
                         "metadata": {"name": name, "namespace": layout.watched, "labels": layout.pod["labels"]},
                         "spec": {"nodeName": "kwok-node-0", "containers": layout.pod["containers"]}})  # fmt: skip
        wait_for(f"kwok to run {name}",
                 lambda: monitored.get("pod", name, layout.watched).get("status", {}).get("phase") == "Running")  # fmt: skip
        status = {"status": {"podIP": address, "podIPs": [{"ip": address}]}}
        monitored.kubectl("patch", "pod", name, "-n", layout.watched, "--subresource=status", "--type=merge",
                          "-p", json.dumps(status))  # fmt: skip
        yield {"pod": name, "url": engine.url}
    finally:
        engine.stop()


def scraped_as_an_engine(monitored: Cluster, layout: Layout, pod: str) -> dict[str, Any]:
    """The layout's PodMonitor target for `pod`, once up; then the rules count the pod as an engine."""
    job = f"podMonitor/{layout.release}-system/{layout.release}-engines/0"

    def scraped() -> dict[str, Any] | None:
        found = [t for t in active_targets(monitored, job) if t["labels"].get("pod") == pod]
        return found[0] if found and found[0]["health"] == "up" else None

    target: dict[str, Any] = wait_for(f"{layout.name}'s engine target up", scraped, timeout=WAIT_S)
    wait_for(f"kvtune_engine:up for {layout.name}'s engine pod", lambda: query(
        monitored, f'kvtune_engine:up{{namespace="{layout.watched}",pod="{pod}"}}'
    ), timeout=WAIT_S)  # fmt: skip
    return target


def test_kserve_s_layout_is_scraped_over_https_by_port_number(
    monitored: Cluster, release: dict[str, Any], pods: PodNetwork, tmp_path: Path
) -> None:
    with layout_engine(monitored, pods, KSERVE, tmp_path) as engine:
        assert engine["url"].startswith("https://")
        target = scraped_as_an_engine(monitored, KSERVE, engine["pod"])
    assert target["scrapeUrl"].startswith("https://") and f":{KSERVE.port}/metrics" in target["scrapeUrl"]


def test_llm_d_s_layout_scrapes_vllm_by_its_port_name_not_the_routing_proxy(
    monitored: Cluster, release: dict[str, Any], pods: PodNetwork, tmp_path: Path
) -> None:
    with layout_engine(monitored, pods, LLM_D, tmp_path) as engine:
        target = scraped_as_an_engine(monitored, LLM_D, engine["pod"])
        job = f"podMonitor/{LLM_D.release}-system/{LLM_D.release}-engines/0"
        targets = [t for t in active_targets(monitored, job) if t["labels"].get("pod") == engine["pod"]]
    assert target["scrapeUrl"].endswith(f":{LLM_D.port}/metrics"), target["scrapeUrl"]
    assert len(targets) == 1 and targets[0]["labels"]["container"] == "vllm", targets  # not the proxy's 8000


def test_down_stops_the_monitoring_stack(monitored: Cluster) -> None:
    """Everything `up --monitoring` started is in the state `down` stops (checked again by the fixture)."""
    state = json.loads((monitored.folder / "cluster.json").read_text())
    assert {"prometheus-operator", "prometheus", "alertmanager", "local_monitoring.py"} <= set(state["pids"])
    assert set(monitored.monitoring) == {"prometheus", "alertmanager"}
    assert Path(monitored.folder / "prometheus" / "prometheus.yaml").is_file()
