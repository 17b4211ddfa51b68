"""A real Prometheus and Alertmanager on loopback, with a webhook sink, for tests that need the whole path:
scrape -> recording rules -> alert -> Alertmanager -> receiver.

Prometheus scrapes the given targets every second with the labels a pod would carry (`namespace`, `pod`,
`model_name`), evaluates the rendered rules file every second and alerts to the Alertmanager, whose only
receiver is a webhook into `WebhookSink`, an http.server in a thread that records every notification. Each
part runs in a temporary directory on free ports and is stopped by its own process handle. `query()` is the
reusable piece: any PromQL against the live Prometheus (the dashboards' panel queries are checked with it).
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import yaml

from kvtune.harness.local_http import free_port
from tests.observability.tools import require

RULES_FILE = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "kvtune-rules.yaml"
START_TIMEOUT_S = 30.0

Alert = dict[str, Any]


@dataclass(frozen=True)
class ScrapeTarget:
    """One engine (or proxy) to scrape, with the labels its pod would carry in a cluster."""

    address: str  # host:port
    pod: str
    namespace: str = "kvtune-test"
    model_name: str = "tiny"
    metrics_path: str = "/metrics"


def wait_until(check: Callable[[], Any], timeout: float, what: str, interval: float = 0.25) -> Any:
    """Polls `check` until it returns something truthy; fails with `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


# --- the webhook receiver ----------------------------------------------------------------------------------
class WebhookSink:
    """Records every Alertmanager webhook notification (its JSON body), in arrival order."""

    def __init__(self) -> None:
        self.notifications: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                with sink._lock:
                    sink.notifications.append(json.loads(body))
                self.send_response(200)
                self.end_headers()

            def log_message(self, format: str, *args: object) -> None:
                return

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/alerts"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def start(self) -> WebhookSink:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def alerts(self) -> list[Alert]:
        """Every alert of every notification so far."""
        with self._lock:
            return [alert for note in self.notifications for alert in note["alerts"]]

    def wait_for_alert(self, alertname: str, timeout: float, **labels: str) -> Alert:
        """The first firing `alertname` whose labels include `labels`, within `timeout` seconds."""

        def found() -> Alert | None:
            for alert in self.alerts():
                wanted = {"alertname": alertname, **labels}
                if alert["status"] == "firing" and wanted.items() <= alert["labels"].items():
                    return alert
            return None

        result: Alert = wait_until(found, timeout, f"{alertname} {labels} at the webhook")
        return result


# --- Prometheus' HTTP API ----------------------------------------------------------------------------------
def query(prometheus_url: str, expr: str, timeout: float = 10.0) -> list[dict[str, Any]]:
    """An instant PromQL query against a live Prometheus: its result list (`metric`, `value`). A query
    Prometheus refuses raises with Prometheus' own error text."""
    response = httpx.get(f"{prometheus_url}/api/v1/query", params={"query": expr}, timeout=timeout)
    body = response.json()
    if response.status_code != 200 or body.get("status") != "success":
        raise AssertionError(f"Prometheus refused {expr!r}: {body.get('errorType')}: {body.get('error')}")
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def active_alerts(prometheus_url: str) -> list[Alert]:
    """Prometheus' own view: every pending or firing alert (`/api/v1/alerts`)."""
    body = httpx.get(f"{prometheus_url}/api/v1/alerts", timeout=10).json()
    alerts: list[Alert] = body["data"]["alerts"]
    return alerts


# --- the processes -----------------------------------------------------------------------------------------
class Process:
    """A child process with its log in a file; fails with the log's tail when it exits or never gets ready."""

    def __init__(self, name: str, argv: Sequence[str], log: Path) -> None:
        self.name = name
        self.log = log
        self._log_file = log.open("wb")
        self.popen = subprocess.Popen(argv, stdout=self._log_file, stderr=subprocess.STDOUT)

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def wait_ready(self, url: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.popen.poll() is not None:
                raise AssertionError(
                    f"{self.name} exited with {self.popen.returncode} before it was ready:\n{self.log_tail()}"
                )
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{self.name} not ready after {START_TIMEOUT_S:.0f}s:\n{self.log_tail()}"
                )
            time.sleep(0.2)

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(15)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        self._log_file.close()


def alertmanager_config(webhook_url: str) -> dict[str, Any]:
    return {
        "route": {
            "receiver": "sink",
            "group_by": ["alertname", "namespace", "pod"],
            "group_wait": "1s",
            "group_interval": "1s",
            "repeat_interval": "1h",
        },
        "receivers": [{"name": "sink", "webhook_configs": [{"url": webhook_url, "send_resolved": True}]}],
    }


def prometheus_config(
    targets: Sequence[ScrapeTarget],
    alertmanager: str,
    rules: Path,
    scrape_configs: Sequence[dict[str, Any]] = (),
) -> dict[str, Any]:
    """Scrape and evaluate every second. honor_labels keeps an engine's own `model_name`; the static one
    fills in for a target without it (the proxy). `scrape_configs` are added as they are (a job shaped
    like the one the Prometheus Operator makes of a ServiceMonitor)."""
    return {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(rules)],
        "alerting": {"alertmanagers": [{"static_configs": [{"targets": [alertmanager]}]}]},
        "scrape_configs": [
            {
                "job_name": "kvtune",
                "honor_labels": True,
                "metrics_path": path,
                "static_configs": [
                    {
                        "targets": [t.address],
                        "labels": {"namespace": t.namespace, "pod": t.pod, "model_name": t.model_name},
                    }
                    for t in targets
                    if t.metrics_path == path
                ],
            }
            for path in sorted({t.metrics_path for t in targets})
        ]
        + list(scrape_configs),
    }


@dataclass
class LiveStack:
    prometheus_url: str
    alertmanager_url: str
    sink: WebhookSink

    def query(self, expr: str) -> list[dict[str, Any]]:
        return query(self.prometheus_url, expr)

    def value(self, expr: str) -> float | None:
        """The single value `expr` returns now, or None when it returns nothing."""
        result = self.query(expr)
        assert len(result) <= 1, f"{expr} returned {len(result)} series"
        return float(result[0]["value"][1]) if result else None

    def active_alerts(self) -> list[Alert]:
        return active_alerts(self.prometheus_url)

    def rule_evaluations(self) -> float:
        """How many times every rule group has been evaluated so far (the least of the groups' counts, from
        Prometheus' own /metrics): a span counted in evaluations holds the same checks on any machine."""
        text = httpx.get(f"{self.prometheus_url}/metrics", timeout=10).text
        counts = [
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("prometheus_rule_group_iterations_total{")
        ]
        assert counts, "Prometheus reports no rule group"
        return min(counts)


@contextmanager
def live_stack(
    targets: Sequence[ScrapeTarget],
    workdir: Path,
    rules: Path = RULES_FILE,
    scrape_configs: Sequence[dict[str, Any]] = (),
) -> Iterator[LiveStack]:
    """Prometheus + Alertmanager + webhook sink, up and ready; all stopped on exit."""
    prometheus_bin, alertmanager_bin = require("prometheus"), require("alertmanager")
    with ExitStack() as cleanup:
        sink = WebhookSink().start()
        cleanup.callback(sink.stop)

        am_dir = workdir / "alertmanager"
        am_dir.mkdir(parents=True)
        (am_dir / "alertmanager.yml").write_text(yaml.safe_dump(alertmanager_config(sink.url)))
        am_address = f"127.0.0.1:{free_port()}"
        alertmanager = Process(
            "alertmanager",
            [
                alertmanager_bin,
                f"--config.file={am_dir / 'alertmanager.yml'}",
                f"--storage.path={am_dir / 'data'}",
                f"--web.listen-address={am_address}",
                "--cluster.listen-address=",  # no HA gossip port
            ],
            am_dir / "alertmanager.log",
        )
        cleanup.callback(alertmanager.stop)

        prom_dir = workdir / "prometheus"
        prom_dir.mkdir(parents=True)
        (prom_dir / "prometheus.yml").write_text(
            yaml.safe_dump(prometheus_config(targets, am_address, rules, scrape_configs))
        )
        prom_address = f"127.0.0.1:{free_port()}"
        prometheus = Process(
            "prometheus",
            [
                prometheus_bin,
                f"--config.file={prom_dir / 'prometheus.yml'}",
                f"--storage.tsdb.path={prom_dir / 'data'}",
                f"--web.listen-address={prom_address}",
                "--rules.alert.resend-delay=1s",
            ],
            prom_dir / "prometheus.log",
        )
        cleanup.callback(prometheus.stop)

        alertmanager.wait_ready(f"http://{am_address}/-/ready")
        prometheus.wait_ready(f"http://{prom_address}/-/ready")
        yield LiveStack(f"http://{prom_address}", f"http://{am_address}", sink)
