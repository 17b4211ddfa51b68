"""The operator's series keep the policy's namespace through the chart's ServiceMonitor, on a real
Prometheus: the operator dashboard's namespace variable offers it, its panels filtered on it have data,
and KVTuneOperatorCannotAct names it.

The operator's `/metrics` (the real OperatorMetrics server, a policy `inference/llama` whose evaluations
keep failing) is scraped by a job shaped like the one the Prometheus Operator makes of the rendered
ServiceMonitor: its honor_labels, path and port, and the target labels its Kubernetes discovery sets
(`namespace` = the operator Service's namespace, `service`, `pod`, `container`, `endpoint`, `job`). A second
job scrapes the same target without honor_labels, as the chart's monitor did before: there the operator's
`namespace` becomes `exported_namespace` and the series land in the operator's namespace, which is what
the first job must not do.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvtune.dashboards.report import all_variables
from kvtune.harness.local_http import free_port
from kvtune.operator.io.own_metrics import ERROR_APPLY, Evaluation, OperatorMetrics
from tests.chart.helm import MONITORING_API, NAMESPACE, one, render
from tests.observability.live_stack import LiveStack, live_stack, wait_until

ROOT = Path(__file__).resolve().parents[2]
POLICY_NAMESPACE, POLICY = "inference", "llama"
OPERATOR_POD = "kvtune-6d5f8b7c9-x2x9q"
TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def operator_metrics() -> Iterator[str]:
    """The operator's own /metrics for one policy whose every evaluation meets an error (host:port)."""
    metrics = OperatorMetrics("Recommend")
    port = free_port()
    server = metrics.serve(port, "127.0.0.1")
    stop = threading.Event()

    def evaluate() -> None:
        while not stop.is_set():
            metrics.record(POLICY_NAMESPACE, POLICY, Evaluation(
                at=time.time(), current={"max_num_seqs": 64, "max_tokens_cap": 0},
                recommended={"max_num_seqs": 40, "max_tokens_cap": 0}, rung=2,
                conditions={"Preempting": True, "Stable": False, "ModeCapped": False},
                errors=(ERROR_APPLY,), interval_s=15.0,
                # prediction is on by default (issue 28): the forecast panels read these
                predicted_preemptions_per_min=0.0, observed_preemptions_per_min=12.0, prediction_misses=1,
                objective="NoPreemption",
            ))  # fmt: skip
            stop.wait(0.5)

    thread = threading.Thread(target=evaluate, daemon=True)
    thread.start()
    yield f"127.0.0.1:{port}"
    stop.set()
    thread.join(5)
    server.shutdown()


def service_monitor_job(monitor: dict[str, Any], service: dict[str, Any], address: str) -> dict[str, Any]:
    """The scrape job the Prometheus Operator generates for the monitor's one endpoint, with the labels
    its endpoints discovery puts on the operator's pod (static here: there is no Kubernetes)."""
    (endpoint,) = monitor["spec"]["endpoints"]
    job = {
        "job_name": f"serviceMonitor/{monitor['metadata'].get('namespace', NAMESPACE)}/{monitor['metadata']['name']}/0",
        "metrics_path": endpoint["path"],
        "scrape_interval": "1s",
        "static_configs": [{"targets": [address], "labels": {
            "namespace": monitor["spec"]["namespaceSelector"]["matchNames"][0],
            "service": service["metadata"]["name"], "pod": OPERATOR_POD, "container": "operator",
            "endpoint": endpoint["port"], "job": service["metadata"]["name"],
        }}],
    }  # fmt: skip
    if endpoint.get("honorLabels"):
        job["honor_labels"] = True
    return job


@pytest.fixture(scope="module")
def stack(operator_metrics: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveStack]:
    objects = render({}, tmp_path_factory.mktemp("chart"), (MONITORING_API,))
    monitor, service = one(objects, "ServiceMonitor"), one(objects, "Service")
    chart_job = service_monitor_job(monitor, service, operator_metrics)
    assert chart_job.get("honor_labels") is True, "the chart's ServiceMonitor lost honorLabels"
    control = {**service_monitor_job(monitor, service, operator_metrics), "job_name": "without-honor-labels"}
    control.pop("honor_labels", None)
    control["static_configs"][0]["labels"]["service"] = "control"
    with live_stack([], tmp_path_factory.mktemp("stack"), scrape_configs=[chart_job, control]) as live:
        # each job's own first scrape (an unlabelled query is answered by whichever job came first)
        chart_service = service["metadata"]["name"]
        wait_until(
            lambda: (
                live.query('kvtune_operator_info{service="control"}')
                and live.query(f'kvtune_operator_info{{service="{chart_service}"}}')
            ),
            TIMEOUT_S,
            "both jobs scraping the operator",
        )
        yield live


def label_values(stack: LiveStack, variable_query: str, substitutions: dict[str, str]) -> set[str]:
    """What Grafana's `label_values(selector, label)` offers, through Prometheus' series API."""
    inner = variable_query.strip().removeprefix("label_values(").removesuffix(")")
    selector, _, label = inner.rpartition(",")
    for name, value in substitutions.items():
        selector = selector.replace(f"${name}", value)
    answer = httpx.get(
        f"{stack.prometheus_url}/api/v1/series", params={"match[]": selector}, timeout=10
    ).json()
    return {series[label.strip()] for series in answer["data"] if label.strip() in series}


def operator_dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((ROOT / "dashboards" / "kvtune-operator.json").read_text())
    return loaded


def test_the_namespace_variable_offers_the_policys_namespace(stack: LiveStack) -> None:
    variables = {v["name"]: v for v in operator_dashboard()["templating"]["list"]}
    query = variables["namespace"]["query"]
    query = query["query"] if isinstance(query, dict) else query
    values = label_values(stack, query, {})
    assert POLICY_NAMESPACE in values
    # the job without honor_labels puts the operator's series in its own namespace: that is the bug fixed
    assert NAMESPACE in values
    control = stack.query('kvtune_operator_last_evaluation_timestamp_seconds{service="control"}')
    assert [s["metric"]["namespace"] for s in control] == [NAMESPACE]
    assert [s["metric"]["exported_namespace"] for s in control] == [POLICY_NAMESPACE]
    chart = stack.query('kvtune_operator_last_evaluation_timestamp_seconds{service="kvtune-metrics"}')
    assert [(s["metric"]["namespace"], s["metric"]["policy"]) for s in chart] == [(POLICY_NAMESPACE, POLICY)]
    assert "exported_namespace" not in chart[0]["metric"]
    policies = label_values(stack, variables["policy"]["query"], {"namespace": POLICY_NAMESPACE})
    assert policies == {POLICY}


def test_every_operator_panel_has_data_for_the_policys_namespace(stack: LiveStack) -> None:
    queries = [
        (panel["title"], all_variables(target["expr"].replace("$namespace", POLICY_NAMESPACE)))
        for panel in operator_dashboard()["panels"]
        for target in panel.get("targets", [])
    ]
    assert queries

    def empty() -> list[str]:
        return [f"{title}: {expr}" for title, expr in queries if not stack.query(expr)]

    wait_until(lambda: not empty(), TIMEOUT_S, "every operator panel with data")


def test_kvtune_operator_cannot_act_names_the_policys_namespace(stack: LiveStack) -> None:
    def alerts() -> list[dict[str, Any]]:
        return [a for a in stack.active_alerts() if a["labels"]["alertname"] == "KVTuneOperatorCannotAct"]

    wait_until(lambda: len(alerts()) == 2, TIMEOUT_S, "KVTuneOperatorCannotAct pending for both jobs")
    named = {(a["labels"]["namespace"], a["labels"]["policy"], a["labels"]["cause"]) for a in alerts()}
    # the chart's job: the policy's namespace; the job without honor_labels: the operator's own
    assert named == {(POLICY_NAMESPACE, POLICY, "errors"), (NAMESPACE, POLICY, "errors")}
    others = {a["labels"]["alertname"] for a in stack.active_alerts()} - {"KVTuneOperatorCannotAct"}
    assert not others & {"KVTuneOperatorDown", "KVTuneOperatorStalled"}, others
