"""Metric sources and the one name map: kvtune, vLLM (current, legacy, `vllm_`), SGLang, Prometheus API."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from kvtune.contract import metrics as m
from kvtune.operator.decide.sample import NoData, Sample
from kvtune.operator.io.sources import MetricsEndpoint, PrometheusSource
from tests.operator.helpers import fixture_text, parse_exposition, prometheus_vector, recorded
from tests.operator.sources_world import SGLANG


def test_kvtune_recorded_scrape_maps_every_figure() -> None:
    sample = recorded("kvtune_preempting_t1.prom", 1.0)
    assert isinstance(sample, Sample)
    assert sample.counters[m.PREEMPTIONS] == 95
    assert sample.gauges[m.MAX_NUM_SEQS] == 64
    assert sample.counters[f"{m.REQUEST_SUCCESS}:length"] == 80
    assert sample.cache_config["kv_cache_size_tokens"] == "1024"
    assert sample.histograms[m.REQUEST_GENERATION_TOKENS].count == 80


def test_underscore_spelling_reads_the_same() -> None:
    colon = recorded("kvtune_preempting_t1.prom", 1.0)
    underscore = recorded("kvtune_preempting_t1.prom", 1.0, {"vllm:": "vllm_", "kvtune:": "kvtune_"})
    assert isinstance(colon, Sample) and isinstance(underscore, Sample)
    assert underscore.counters == colon.counters
    assert underscore.gauges == colon.gauges
    assert underscore.histograms == colon.histograms


def test_kserve_prefixed_spellings_read_the_same() -> None:
    """KServe's PodMonitor stores every name under `kserve_` (colon or underscore spelling behind it),
    the process start time too (how a restart is told apart)."""
    colon = recorded("kvtune_preempting_t1.prom", 1.0)
    for engine in ("vllm:", "vllm_"):
        prefixed = recorded(
            "kvtune_preempting_t1.prom",
            1.0,
            {
                "vllm:": f"kserve_{engine}",
                "kvtune:": "kserve_kvtune:",
                "process_start": "kserve_process_start",
            },
        )
        assert isinstance(colon, Sample) and isinstance(prefixed, Sample)
        assert (prefixed.counters, prefixed.gauges, prefixed.histograms) == (
            colon.counters,
            colon.gauges,
            colon.histograms,
        )
    started = m.lookup("kserve_process_start_time_seconds")
    assert started is not None and started[0].name == m.PROCESS_START
    assert m.colon_spelling("kserve_vllm_num_requests_running") == "vllm:num_requests_running"
    assert "kserve_vllm:num_requests_running" in m.spellings("vllm:num_requests_running")


def test_the_prometheus_query_takes_every_spelling_and_leaves_a_routers_copies_out() -> None:
    query = PrometheusSource("http://prometheus:9090", 'namespace="inference"').query()
    assert query.startswith('{__name__=~"') and query.endswith(',server="",namespace="inference"}')
    names = re.fullmatch(r'\{__name__=~"([^"]+)",.*', query)
    assert names is not None
    asked = re.compile(names.group(1))
    for spelled in ("vllm:num_preemptions_total", "vllm_num_preemptions_total", "kserve_vllm:num_preemptions_total",
                    "vllm:num_preemptions", "vllm:request_prompt_tokens_bucket", "sglang:num_running_reqs",
                    "process_start_time_seconds"):  # fmt: skip
        assert asked.fullmatch(spelled), spelled
    for unread in (
        "vllm:request_decode_time_seconds_bucket",
        "python_gc_objects_collected_total",
        "vllm_router_x",
    ):
        assert not asked.fullmatch(unread), unread  # what the sample never reads is never asked for
    # a selector that names the label itself is taken as it is
    assert ',server=""' not in PrometheusSource("http://p", '{server=~".+"}').query()


def test_legacy_vllm_names() -> None:
    legacy = recorded(
        "kvtune_preempting_t1.prom",
        1.0,
        {
            "vllm:kv_cache_usage_perc": "vllm:gpu_cache_usage_perc",
            "vllm:prefix_cache_": "vllm:gpu_prefix_cache_",
        },
    )
    assert isinstance(legacy, Sample)
    assert m.KV_USAGE in legacy.gauges
    assert legacy.counters[m.PREFIX_QUERIES] == 4758


def test_sglang_names() -> None:
    sample = parse_exposition(SGLANG, 1.0, "sglang")
    assert isinstance(sample, Sample)
    assert sample.gauges[m.KV_USAGE] == pytest.approx(0.93)
    assert sample.gauges[m.RUNNING] == 48 and sample.gauges[m.WAITING] == 12
    assert sample.counters[m.PREEMPTIONS] == 7
    assert sample.counters[m.PROMPT_TOKENS_CACHED] == 400
    assert sample.gauges[m.CACHE_HIT_RATE_GAUGE] == pytest.approx(0.41)
    assert sample.cache_config == {"block_size": "1", "num_blocks": "200000"}


def test_unknown_or_garbage_text_is_no_data() -> None:
    assert isinstance(parse_exposition("other_metric 1\n", 1.0, "x"), NoData)
    assert isinstance(parse_exposition("this is { not metrics", 1.0, "x"), NoData)


def test_unreachable_endpoint_is_no_data() -> None:
    result = MetricsEndpoint("http://127.0.0.1:9", timeout=1).read()
    assert isinstance(result, NoData) and "unreachable" in result.reason


class _Handler(BaseHTTPRequestHandler):
    routes: ClassVar[dict[str, tuple[int, str, str]]] = {}
    queries: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        path, _, query = self.path.partition("?")
        type(self).queries.append(query)
        status, content_type, body = self.routes.get(path, (404, "text/plain", "not found"))
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture()
def http_stub() -> Iterator[tuple[str, type[_Handler]]]:
    handler = type("Handler", (_Handler,), {"routes": {}, "queries": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}", handler
    server.shutdown()


def test_prometheus_instant_query_with_selector(http_stub: tuple[str, type[_Handler]]) -> None:
    url, handler = http_stub
    body = prometheus_vector(fixture_text("kvtune_preempting_t1.prom").replace("vllm:", "vllm_"), 1234.5)
    handler.routes["/api/v1/query"] = (200, "application/json", body)
    source = PrometheusSource(url, '{job="vllm",namespace="llm"}')
    sample = source.read()
    assert isinstance(sample, Sample)
    assert sample.timestamp == 1234.5
    assert sample.counters[m.PREEMPTIONS] == 95
    assert sample.histograms[m.REQUEST_GENERATION_TOKENS].count == 80
    assert "job%3D%22vllm%22" in handler.queries[-1] or 'job="vllm"' in handler.queries[-1]


def test_prometheus_errors_and_empty_answers_are_no_data(http_stub: tuple[str, type[_Handler]]) -> None:
    url, handler = http_stub
    empty = json.dumps({"status": "success", "data": {"resultType": "vector", "result": []}})
    handler.routes["/api/v1/query"] = (200, "application/json", empty)
    assert isinstance(PrometheusSource(url, 'job="x"').read(), NoData)
    handler.routes["/api/v1/query"] = (
        400,
        "application/json",
        json.dumps({"status": "error", "error": "bad"}),
    )
    assert isinstance(PrometheusSource(url, 'job="x"').read(), NoData)
    handler.routes["/api/v1/query"] = (200, "text/html", "<html>")
    assert isinstance(PrometheusSource(url, 'job="x"').read(), NoData)
    assert isinstance(PrometheusSource("http://127.0.0.1:9", 'job="x"', timeout=1).read(), NoData)
