"""KEDA on the local control plane (`local_cluster.py up --monitoring --keda`), end to end through the real
parts: a ScaledObject's `prometheus` trigger reads a series the real Prometheus scraped (through a
ServiceMonitor, as it will scrape kvtune's operator), KEDA's operator makes the HPA, its metrics server
serves the value through the API server's aggregation layer, and the controller manager's HPA controller
scales the Deployment out as the value rises and back in as it falls.

The series is served by this test on this machine's non-loopback address (the API server refuses loopback
endpoints), with the `namespace` and `policy` labels kvtune_operator_desired_replicas carries, kept by
honorLabels as the chart's ServiceMonitor keeps them. The build recipe's pure parts are checked first.
"""

from __future__ import annotations

import json
import threading
import urllib.parse
import urllib.request
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.e2e.cluster import Cluster, control_plane, local_cluster, wait_for
from tests.stand_in_http import QuietHandler

NAMESPACE, WORKLOAD, SCALED_OBJECT, POLICY = "keda-e2e", "demand", "demand", "demand"
SERIES = "kvtune_e2e_desired_replicas"
QUERY = f'max({SERIES}{{namespace="{NAMESPACE}",policy="{POLICY}"}})'
WAIT_S = 180.0  # a hang deadline: every wait ends at its event


def local_keda() -> ModuleType:
    module: ModuleType = local_cluster().keda_stack()
    return module


BUILDER = """func buildScaler() {
	// TRIGGERS-START
	switch triggerType {
	case "activemq":
		return scalers.NewActiveMQScaler(config)
	case "cpu":
		return scalers.NewCPUMemoryScaler(corev1.ResourceCPU, config)
	case "external", "external-push":
		return scalers.NewExternalScaler(config)
	default:
		return nil, fmt.Errorf("no scaler found for type: %s", triggerType)
	}
	// TRIGGERS-END
}
"""


def test_only_the_kept_scalers_stay_registered() -> None:
    keda = local_keda()
    trimmed = keda.registered_only(BUILDER, {"cpu", "external-push"})
    assert '"cpu"' in trimmed and '"external", "external-push"' in trimmed and "default:" in trimmed
    assert "activemq" not in trimmed and trimmed.endswith("\t}\n\t// TRIGGERS-END\n}\n")
    with pytest.raises(keda.lc.ClusterError, match="no scaler"):
        keda.registered_only(BUILDER, {"cpu", "kafka"})


def test_keda_s_crd_patches_become_json_patches() -> None:
    keda = local_keda()
    patch = """---
## a comment
- op: add
  path: /spec/a/required/-
  value: protocol

- op: add
  path: /spec/b/maximum
  value: 3600
- op: remove
  path: /spec/c
"""
    assert keda.json_patch(patch) == [
        {"op": "add", "path": "/spec/a/required/-", "value": "protocol"},
        {"op": "add", "path": "/spec/b/maximum", "value": 3600},
        {"op": "remove", "path": "/spec/c"},
    ]
    with pytest.raises(keda.lc.ClusterError, match="cannot read"):
        keda.json_patch("- op: add\n  value:\n    nested: true\n")
    kustomization = "patches:\n- path: patches/x.yaml\n  target:\n    group: g\n    name: xs.keda.sh\n"
    assert keda.crd_patches(kustomization) == {"patches/x.yaml": "xs.keda.sh"}


def test_a_keda_cache_built_from_other_pins_is_rebuilt_whole(tmp_path: Path) -> None:
    keda = local_keda()
    everything = [*keda.COMMANDS, keda.CRD_FOLDER]
    assert keda.missing(tmp_path) == everything
    (tmp_path / keda.STAMP).write_text(json.dumps(keda.pins()))
    for name in keda.COMMANDS:
        (tmp_path / name).write_text("")
        (tmp_path / name).chmod(0o755)
    assert keda.missing(tmp_path) == [keda.CRD_FOLDER]
    (tmp_path / keda.STAMP).write_text(json.dumps({**keda.pins(), "keda": "v2.19.0"}))
    assert keda.missing(tmp_path) == everything


class Series:
    """`SERIES` at a value the test sets, served as Prometheus' text format on `host`."""

    def __init__(self, host: str, value: float) -> None:
        self.value = value
        series = self

        class Handler(QuietHandler):
            def do_GET(self) -> None:
                body = (f"# TYPE {SERIES} gauge\n"
                        f'{SERIES}{{namespace="{NAMESPACE}",policy="{POLICY}"}} {series.value}\n').encode()  # fmt: skip
                self.send_whole(200, body, "text/plain; version=0.0.4")

        self.server = ThreadingHTTPServer((host, 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def autoscaled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A control plane of this module's own, `up --monitoring --keda`, and `down` after."""
    with control_plane(tmp_path_factory.mktemp("keda-control-plane"), monitoring=True, keda=True) as started:
        yield started


@pytest.fixture(scope="module")
def series(autoscaled: Cluster) -> Iterator[Series]:
    """The series, at 1, scraped by the monitoring stack's Prometheus through a ServiceMonitor (honorLabels,
    as the chart's) over a Service whose endpoints are this machine's address."""
    host = local_keda().host_address()
    served = Series(host, 1)
    autoscaled.namespace(NAMESPACE)
    meta = {"name": "demand-metrics", "namespace": NAMESPACE, "labels": {"app": "demand-metrics"}}
    autoscaled.apply({
        "apiVersion": "v1", "kind": "Service", "metadata": meta,
        "spec": {"ports": [{"name": "metrics", "port": served.port}]},
    }, {
        "apiVersion": "v1", "kind": "Endpoints", "metadata": meta,
        "subsets": [{"addresses": [{"ip": host}], "ports": [{"name": "metrics", "port": served.port}]}],
    }, {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": "demand-metrics-e2e", "namespace": NAMESPACE,
                     "labels": {"kubernetes.io/service-name": "demand-metrics",
                                "endpointslice.kubernetes.io/managed-by": "kvtune-e2e"}},
        "addressType": "IPv4", "ports": [{"name": "metrics", "port": served.port, "protocol": "TCP"}],
        "endpoints": [{"addresses": [host], "conditions": {"ready": True}}],
    }, {
        "apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
        "metadata": {"name": "demand", "namespace": NAMESPACE, "labels": {"release": "kube-prometheus-stack"}},
        "spec": {"selector": {"matchLabels": {"app": "demand-metrics"}},
                 "endpoints": [{"port": "metrics", "interval": "1s", "honorLabels": True}]},
    })  # fmt: skip
    try:
        wait_for("Prometheus to scrape the series", lambda: prometheus_value(autoscaled) == 1, timeout=WAIT_S)
        yield served
    finally:
        served.close()


def prometheus_value(cluster: Cluster) -> float | None:
    url = f"{cluster.monitoring['prometheus']}/api/v1/query?{urllib.parse.urlencode({'query': QUERY})}"
    with urllib.request.urlopen(url, timeout=10) as answer:
        result = json.loads(answer.read())["data"]["result"]
    return float(result[0]["value"][1]) if result else None


def deployment(replicas: int) -> dict[str, Any]:
    labels = {"app": WORKLOAD}
    return {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": WORKLOAD, "namespace": NAMESPACE},
        "spec": {"replicas": replicas, "selector": {"matchLabels": labels},
                 "template": {"metadata": {"labels": labels},
                              "spec": {"containers": [{"name": "app", "image": "registry.example.com/demand:1"}]}}},
    }  # fmt: skip


def scaled_object(prometheus: str) -> dict[str, Any]:
    """What the integration points at kvtune's operator: a `prometheus` trigger, one replica per unit of
    the value (AverageValue 1), between 1 and 4, scaling within seconds either way."""
    quick = {
        "stabilizationWindowSeconds": 0,
        "policies": [{"type": "Percent", "value": 100, "periodSeconds": 1}],
    }
    return {
        "apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject",
        "metadata": {"name": SCALED_OBJECT, "namespace": NAMESPACE},
        "spec": {
            "scaleTargetRef": {"name": WORKLOAD},
            "minReplicaCount": 1, "maxReplicaCount": 4, "pollingInterval": 5,
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": {"scaleUp": quick, "scaleDown": quick}}},
            "triggers": [{"type": "prometheus", "metricType": "AverageValue",
                          "metadata": {"serverAddress": prometheus, "query": QUERY, "threshold": "1"}}],
        },
    }  # fmt: skip


def quantity(text: str) -> float:
    """A Kubernetes quantity as KEDA's metrics server writes one (plain, or milli-units)."""
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def external_metric(cluster: Cluster, metric: str) -> float | None:
    """The value KEDA's metrics server serves the HPA for the ScaledObject, read as the HPA controller reads
    it: through the API server's aggregation layer."""
    selector = urllib.parse.quote(f"scaledobject.keda.sh/name={SCALED_OBJECT}", safe="")
    path = f"/apis/external.metrics.k8s.io/v1beta1/namespaces/{NAMESPACE}/{metric}?labelSelector={selector}"
    done = cluster.kubectl("get", "--raw", path, check=False)
    if done.returncode != 0:
        return None
    items = json.loads(done.stdout)["items"]
    return quantity(items[0]["value"]) if items else None


def replicas(cluster: Cluster) -> int:
    found: int = cluster.get("deployment", WORKLOAD, NAMESPACE)["spec"]["replicas"]
    return found


def test_keda_scales_a_deployment_out_and_in_on_a_prometheus_series(
    autoscaled: Cluster, series: Series
) -> None:
    autoscaled.apply(deployment(replicas=1))
    autoscaled.kubectl("rollout", "status", f"deployment/{WORKLOAD}", "-n", NAMESPACE, "--timeout", "90s")
    autoscaled.apply(scaled_object(autoscaled.monitoring["prometheus"]))

    hpa_name = f"keda-hpa-{SCALED_OBJECT}"
    hpa = wait_for(f"KEDA to create HPA {hpa_name}", lambda: json.loads(autoscaled.kubectl(
        "get", "hpa", "-n", NAMESPACE, "-o", "json").stdout)["items"], timeout=WAIT_S)  # fmt: skip
    assert [item["metadata"]["name"] for item in hpa] == [hpa_name]
    spec = hpa[0]["spec"]
    assert spec["scaleTargetRef"]["name"] == WORKLOAD and (spec["minReplicas"], spec["maxReplicas"]) == (1, 4)
    (external,) = [metric["external"] for metric in spec["metrics"]]
    assert external["metric"]["selector"]["matchLabels"] == {"scaledobject.keda.sh/name": SCALED_OBJECT}
    assert external["target"] == {"type": "AverageValue", "averageValue": "1"}
    metric = external["metric"]["name"]
    wait_for("the ScaledObject Ready", lambda: any(
        c["type"] == "Ready" and c["status"] == "True"
        for c in autoscaled.get("scaledobject", SCALED_OBJECT, NAMESPACE).get("status", {}).get("conditions", [])
    ), timeout=WAIT_S)  # fmt: skip
    wait_for("the external metric at 1", lambda: external_metric(autoscaled, metric) == 1, timeout=WAIT_S)
    assert replicas(autoscaled) == 1

    series.value = 3
    wait_for("the external metric at 3", lambda: external_metric(autoscaled, metric) == 3, timeout=WAIT_S)
    wait_for("the HPA to scale the Deployment out to 3", lambda: replicas(autoscaled) == 3, timeout=WAIT_S)
    autoscaled.kubectl("rollout", "status", f"deployment/{WORKLOAD}", "-n", NAMESPACE, "--timeout", "90s")

    series.value = 1
    wait_for(
        "the external metric back at 1", lambda: external_metric(autoscaled, metric) == 1, timeout=WAIT_S
    )
    wait_for(
        "the HPA to scale the Deployment back in to 1", lambda: replicas(autoscaled) == 1, timeout=WAIT_S
    )
    status = autoscaled.get("hpa", hpa_name, NAMESPACE)["status"]
    assert status["desiredReplicas"] == 1, status


def test_down_stops_keda(autoscaled: Cluster) -> None:
    """Everything `up --keda` started is in the state `down` stops (checked again by the fixture)."""
    state = json.loads((autoscaled.folder / "cluster.json").read_text())
    assert {"keda-operator", "keda-adapter"} <= set(state["pids"])
    assert set(autoscaled.keda) >= {"metrics-apiserver", "operator-grpc"}
