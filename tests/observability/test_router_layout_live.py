"""A router in front of two vLLM engines, all real, scraped by a real Prometheus running the rules as the
chart renders them with its defaults: the router is never counted as an engine.

Two vLLM servers (its CPU build from .venv-vllm, the tiny model, two sequences each) sit behind PyPI's
`vllm-router` (the Rust
router of vllm-project/router; production-stack's Python router is in no registry these machines reach, so
its `server`-labelled copies of vLLM's gauges are checked by promtool in promtool/layouts.yaml instead).
Prometheus scrapes both engines and the router's own endpoint, each as the pod it would be. Eight long
requests through the router keep two running and two waiting on each engine. Then the dashboards' Pod
variable lists exactly the two engines, the operator's per-pod read finds exactly those two pods, and the
recorded running and waiting, and the doctor's, equal what the engines' own /metrics say at that moment.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from kvtune.bench.vllm_cpu import VllmServerConfig, is_installed, start_server
from kvtune.cli import main
from kvtune.contract import metrics as m
from kvtune.dashboards.grafana import ENGINE_VARIABLES
from kvtune.dashboards.report import all_variables
from kvtune.harness.engine_process import write_tiny_model_in_subprocess
from kvtune.harness.server import ServerProcess
from kvtune.operator.decide.sample import Sample
from kvtune.operator.io.sources import MetricsEndpoint, PrometheusSource
from tests.chart.helm import MONITORING_API, one, render
from tests.observability.live_stack import LiveStack, live_stack, wait_until
from tests.observability.router_process import Router, running_router

NAMESPACE = "inference"
ENGINE_PODS = ("engine-0", "engine-1")
ROUTER_POD = "router-0"
MAX_NUM_SEQS = 2
REQUESTS = 8  # four per engine: two running, two waiting
# vLLM's CPU build writes a few hundred tokens a second here: requests this long hold the queue still for
# minutes (its /metrics can take seconds to answer while both cores are busy)
MAX_TOKENS = 30000
MAX_MODEL_LEN = 32768
KV_CACHE_TOKENS = 65536  # room for both running sequences at full length: nothing is preempted
SETTLE_TIMEOUT_S = 240.0  # a hang deadline, not a wait: every check below polls for its event
BOOT_TIMEOUT_S = 600.0  # two vLLM boots side by side on a small machine: a hang deadline too


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ServerProcess]]:
    """Two vLLM servers, one compute thread each; without .venv-vllm (`make vllm-harness`, which `make test`
    runs) the test fails with that command, never skips."""
    if not is_installed():
        pytest.fail("vLLM's CPU build is not installed in .venv-vllm: run `make vllm-harness`", pytrace=False)
    folder = tmp_path_factory.mktemp("engines")
    model = write_tiny_model_in_subprocess(folder / "tiny", "--max-position-embeddings", str(MAX_MODEL_LEN))
    config = VllmServerConfig(model_dir=model, kv_cache_tokens=KV_CACHE_TOKENS, max_num_seqs=MAX_NUM_SEQS,
                              max_model_len=MAX_MODEL_LEN, cpu_threads=1)  # fmt: skip
    cores = os.cpu_count() or 1  # each engine's compute thread on a core of its own, where there are two
    configs = [dataclasses.replace(config, first_core=index % cores) for index in range(len(ENGINE_PODS))]
    with ThreadPoolExecutor(len(ENGINE_PODS)) as pool:
        booting = [pool.submit(start_server, each, log_path=folder / f"{pod}.log", timeout_s=BOOT_TIMEOUT_S)
                   for each, pod in zip(configs, ENGINE_PODS, strict=True)]  # fmt: skip
    started: list[ServerProcess] = [future.result() for future in booting if future.exception() is None]
    try:
        failed = [future.exception() for future in booting if future.exception() is not None]
        assert not failed, f"vLLM did not start: {failed}"
        yield started
    finally:
        for engine in started:
            engine.stop()


@pytest.fixture(scope="module")
def router(engines: list[ServerProcess], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Router]:
    with running_router([engine.url for engine in engines], tmp_path_factory.mktemp("router")) as started:
        yield started


def chart_rules(folder: Path) -> Path:
    """The chart's PrometheusRule at its defaults, as a rules file Prometheus loads."""
    rule = one(render({}, folder, (MONITORING_API,)), "PrometheusRule")
    path = folder / "chart-rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    return path


def pod_monitor_job(name: str, container: str, targets: list[tuple[str, str]]) -> dict[str, Any]:
    """A scrape job shaped like the one the Prometheus Operator makes of a PodMonitor's endpoint: `job` is
    `<namespace>/<monitor>`, and each target carries its pod's namespace, name and container."""
    return {
        "job_name": f"podMonitor/{NAMESPACE}/{name}/0",
        "honor_labels": True,
        "static_configs": [
            {"targets": [address], "labels": {"job": f"{NAMESPACE}/{name}", "namespace": NAMESPACE,
                                              "pod": pod, "container": container}}
            for address, pod in targets
        ],
    }  # fmt: skip


@pytest.fixture(scope="module")
def stack(
    engines: list[ServerProcess], router: Router, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveStack]:
    folder = tmp_path_factory.mktemp("stack")
    engine_targets = [
        (e.url.removeprefix("http://"), pod) for e, pod in zip(engines, ENGINE_PODS, strict=True)
    ]
    jobs = [
        pod_monitor_job("engines", "vllm", engine_targets),
        pod_monitor_job("router", "router-container", [(router.metrics_address, ROUTER_POD)]),
    ]
    with live_stack([], folder, rules=chart_rules(folder), scrape_configs=jobs) as live:
        yield live


def long_requests(router: Router, stop: threading.Event) -> list[threading.Thread]:
    """REQUESTS completions through the router, each generating MAX_TOKENS (or until `stop`)."""

    def one_request(i: int) -> None:
        body = {"model": "tiny", "prompt": f"request {i}: tell a long story", "max_tokens": MAX_TOKENS,
                "ignore_eos": True, "stream": True}  # fmt: skip
        with (
            httpx.Client(timeout=600) as http,
            http.stream("POST", f"{router.url}/v1/completions", json=body) as r,
        ):
            for _ in r.iter_lines():
                if stop.is_set():
                    return

    threads = [threading.Thread(target=one_request, args=(i,), daemon=True) for i in range(REQUESTS)]
    for thread in threads:
        thread.start()
    return threads


def engines_own(engines: list[ServerProcess]) -> dict[str, tuple[float, float]] | None:
    """Each engine's running and waiting, from its own /metrics; None while one does not answer in time
    (a busy vLLM on two cores can be slower than the read's timeout)."""
    out = {}
    for engine, pod in zip(engines, ENGINE_PODS, strict=True):
        sample = MetricsEndpoint(engine.url).read()
        if not isinstance(sample, Sample):
            return None
        out[pod] = (sample.gauges.get(m.RUNNING, -1.0), sample.gauges.get(m.WAITING, -1.0))
    return out


def recorded(stack: LiveStack) -> dict[str, tuple[float, float]]:
    """Each pod's kvtune_engine:requests_running and _waiting, as the recording rules have them now."""
    found: dict[str, list[float]] = {}
    for index, record in enumerate(("kvtune_engine:requests_running", "kvtune_engine:requests_waiting")):
        for item in stack.query(f'{record}{{namespace="{NAMESPACE}"}}'):
            found.setdefault(item["metric"]["pod"], [-1.0, -1.0])[index] = float(item["value"][1])
    return {pod: (values[0], values[1]) for pod, values in found.items()}


def doctor_figures(stack: LiveStack, capsys: pytest.CaptureFixture[str]) -> tuple[float, float]:
    """`kvtune doctor --prometheus` on the namespace, one instant: its running and waiting."""
    capsys.readouterr()
    code = main(["doctor", "--prometheus", stack.prometheus_url, "--selector", f'namespace="{NAMESPACE}"',
                 "--json", "--samples", "1", "--window-seconds", "0", "--no-what-if"])  # fmt: skip
    assert code == 0
    findings = json.loads(capsys.readouterr().out)["findings"]
    return findings["requests_running"], findings["requests_waiting"]


def pod_variable(stack: LiveStack) -> set[str]:
    """The dashboards' Pod variable, its label_values() query run as Grafana runs it (every option: All)."""
    query = dict((name, q) for name, _, q in ENGINE_VARIABLES)["pod"]
    matched = re.fullmatch(r"label_values\((?P<series>.+), (?P<label>\w+)\)", all_variables(query))
    assert matched is not None, query
    return {item["metric"][matched["label"]] for item in stack.query(matched["series"])}


def test_the_router_is_never_counted_as_an_engine(
    engines: list[ServerProcess], router: Router, stack: LiveStack, capsys: pytest.CaptureFixture[str]
) -> None:
    stop = threading.Event()
    threads = long_requests(router, stop)
    try:
        queued = {
            pod: (float(MAX_NUM_SEQS), float(REQUESTS / len(ENGINE_PODS) - MAX_NUM_SEQS))
            for pod in ENGINE_PODS
        }
        wait_until(lambda: engines_own(engines) == queued, SETTLE_TIMEOUT_S, f"each engine at {queued}")
        # the router is scraped, with series of its own about the workers, and is there to be left out
        wait_until(lambda: stack.query(f'{{pod="{ROUTER_POD}", {router.own_series}}}'),
                   SETTLE_TIMEOUT_S, "the router's own series in Prometheus")  # fmt: skip

        def agreed() -> tuple[dict[str, tuple[float, float]], tuple[float, float]] | None:
            """Prometheus' figures and the doctor's, when the engines said the same before and after."""
            before = engines_own(engines)
            in_prometheus, doctor = recorded(stack), doctor_figures(stack, capsys)
            after = engines_own(engines)
            if before is None or after is None:
                return None
            summed = (sum(r for r, _ in before.values()), sum(w for _, w in before.values()))
            same = before == after == in_prometheus and doctor == summed
            return (in_prometheus, doctor) if same and summed[0] > 0 and summed[1] > 0 else None

        in_prometheus, doctor = wait_until(
            agreed, SETTLE_TIMEOUT_S, "Prometheus and the doctor to agree with the engines"
        )
        assert set(in_prometheus) == set(ENGINE_PODS)
        assert doctor == (
            float(MAX_NUM_SEQS * len(ENGINE_PODS)),
            float(REQUESTS - MAX_NUM_SEQS * len(ENGINE_PODS)),
        )
        # a busy vLLM's /metrics can outlast a 1 s scrape under load, leaving a pod's series stale for a
        # scrape: each read below waits for a complete one, and nothing but the two engines is ever accepted
        wait_until(lambda: pod_variable(stack) == set(ENGINE_PODS), SETTLE_TIMEOUT_S, "the Pod variable")
        source = PrometheusSource(stack.prometheus_url, f'namespace="{NAMESPACE}"')

        def per_pod() -> list[str] | None:
            pods = source.read_pods()
            return sorted(pods) if isinstance(pods, dict) and len(pods) == len(ENGINE_PODS) else None

        assert wait_until(per_pod, SETTLE_TIMEOUT_S, "the operator's per-pod read") == sorted(ENGINE_PODS)

        def up_pods() -> list[str] | None:
            up = sorted(
                item["metric"]["pod"] for item in stack.query(f'kvtune_engine:up{{namespace="{NAMESPACE}"}}')
            )
            return up if len(up) == len(ENGINE_PODS) else None

        assert wait_until(up_pods, SETTLE_TIMEOUT_S, "kvtune_engine:up of both engines") == sorted(
            ENGINE_PODS
        )
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=60)
