"""Builders for recorded and synthetic metric windows, and the stub HTTP servers that answer them."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TypeVar

from prometheus_client.parser import text_string_to_metric_families

from kvtune.contract import metrics as m
from kvtune.contract.knobs import KNOB_MAX_NUM_SEQS, KNOB_MAX_TOKENS_CAP
from kvtune.operator.decide.sample import (
    EngineView,
    Histogram,
    NoData,
    Sample,
    SampleResult,
    sample_from_series,
)
from kvtune.operator.io.sources import exposition_series

FIXTURES = Path(__file__).parent / "fixtures"


def fixture_text(name: str) -> str:
    return (FIXTURES / name).read_text()


def parse_exposition(text: str, timestamp: float, source: str) -> SampleResult:
    """A Prometheus text exposition -> Sample, or NoData when it does not parse: what
    `MetricsEndpoint.read` makes of a scraped body, without the HTTP."""
    try:
        series = exposition_series(text)
    except ValueError as err:
        return NoData(source, f"unparsable metrics: {err}", timestamp)
    return sample_from_series(series, timestamp, source)


def recorded(name: str, timestamp: float, transform: dict[str, str] | None = None) -> SampleResult:
    text = fixture_text(name)
    for old, new in (transform or {}).items():
        text = text.replace(old, new)
    return parse_exposition(text, timestamp, name)


def cumulative(bounds_counts: list[tuple[float, float]]) -> Histogram:
    """Per-bucket counts -> a cumulative Histogram (the last bound should be inf)."""
    running, buckets = 0.0, []
    for bound, count in bounds_counts:
        running += count
        buckets.append((bound, running))
    return Histogram(tuple(buckets), running, 0.0)


# 100 requests: prompts 50-100 tokens, generations 100-200 (p95 ~ 195): footprint p95 ~ 293 tokens
PROMPTS = [(50.0, 0.0), (100.0, 1.0), (200.0, 0.0), (float("inf"), 0.0)]
GENERATIONS = [(100.0, 0.0), (200.0, 1.0), (500.0, 0.0), (float("inf"), 0.0)]


def synthetic(
    t: float,
    *,
    preemptions: float = 0.0,
    generated: float = 0.0,
    kv: float = 0.5,
    running: float = 4.0,
    waiting: float = 0.0,
    finished: float = 100.0,
    declared_max: float = 180.0,
) -> Sample:
    """A kvtune-like sample with the given cumulative counters and gauges."""

    def scaled(shape: list[tuple[float, float]]) -> Histogram:
        return cumulative([(bound, share * finished) for bound, share in shape])

    declared = cumulative([(100.0, 0.0), (float(declared_max), finished), (float("inf"), 0.0)])
    return Sample(
        timestamp=t,
        gauges={m.KV_USAGE: kv, m.RUNNING: running, m.WAITING: waiting},
        counters={
            m.PREEMPTIONS: preemptions,
            m.GENERATION_TOKENS: generated,
            m.PROMPT_TOKENS: generated / 2,
            m.PREFIX_QUERIES: generated / 2,
            m.PREFIX_HITS: 0.0,
        },
        histograms={
            m.REQUEST_PROMPT_TOKENS: scaled(PROMPTS),
            m.REQUEST_GENERATION_TOKENS: scaled(GENERATIONS),
            m.REQUEST_MAX_TOKENS: declared,
        },
        cache_config={"block_size": "16", "kv_cache_size_tokens": "1024", "cache_dtype": "auto"},
    )


def kvtune_engine(max_num_seqs: int = 64, cap: int | None = None) -> EngineView:
    return EngineView(
        max_num_seqs=max_num_seqs,
        max_tokens_cap=cap,
        pool_tokens=1024,
        block_size=16,
        cache_dtype="auto",
        max_model_len=1024,
        knobs=frozenset({KNOB_MAX_NUM_SEQS, KNOB_MAX_TOKENS_CAP}),
    )


class QuietHandler(BaseHTTPRequestHandler):
    """A stub server's handler that logs nothing: a test's output stays the test's."""

    def log_message(self, *args: Any) -> None:
        pass


ServerT = TypeVar("ServerT", bound=ThreadingHTTPServer)


@contextmanager
def running(server: ServerT) -> Iterator[ServerT]:
    """Serve `server` from a daemon thread; shut down and closed on the way out."""
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def serving(handler: type[BaseHTTPRequestHandler], **state: Any) -> Iterator[ThreadingHTTPServer]:
    """A stub server on a free loopback port, with `state` set on it for its handler to read and record."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    for name, value in state.items():
        setattr(server, name, value)
    with running(server):
        yield server


def local_url(server: ThreadingHTTPServer) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}"


def serve_bodies(bodies: list[str]) -> Iterator[str]:
    """A /metrics endpoint answering `bodies` in order (the last one from then on); yields its base URL."""
    yield from serve_routes({}, [metrics_answer(body) for body in bodies])


def reply(handler: BaseHTTPRequestHandler, status: int, content_type: str, body: bytes) -> None:
    """Answer a stub server's request with one whole body."""
    handler.send_response(status)
    handler.send_header("Content-Type", content_type)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


Answer = tuple[int, str, str]  # status, content type, body


def serve_routes(routes: dict[str, list[Answer]], others: list[Answer] | None = None) -> Iterator[str]:
    """A stub server answering each path with its answers in order (the last one from then on), any other
    path with `others` likewise, or 404; yields its base URL. For a server that has several endpoints (a
    kvtune engine's /metrics beside its /kvtune/prefix-report, a Prometheus API)."""
    remaining = {path: list(answers) for path, answers in routes.items()}
    fallback = list(others or [])

    class Handler(QuietHandler):
        def do_GET(self) -> None:
            answers = remaining.get(self.path.split("?", 1)[0], fallback)
            if not answers:
                reply(self, 404, "application/json", b'{"detail": "Not Found"}')
                return
            status, content_type, body = answers.pop(0) if len(answers) > 1 else answers[0]
            reply(self, status, content_type, body.encode())

    with serving(Handler) as server:
        yield local_url(server)


class ProxyServer(ThreadingHTTPServer):
    """A kvtune proxy stand-in: its /metrics answers the recorded prefix defeats (t0, then t1 from then on),
    its admin API `GET/PATCH /admin/config` ({max_tokens_cap, cap_mode}) wants the bearer `token` and
    records every PATCH it accepts. Shared by the one-proxy and the proxy-per-pod tests."""

    def __init__(self, token: str, cap: int | None, address: str = "127.0.0.1", port: int = 0) -> None:
        super().__init__((address, port), ProxyHandler)
        self.token = token
        self.scrapes = 0
        self.config: dict[str, Any] = {"max_tokens_cap": cap, "cap_mode": "clamp"}
        self.patches: list[dict[str, Any]] = []


class ProxyHandler(QuietHandler):
    server: ProxyServer

    def _authorized(self) -> bool:
        if self.headers.get("Authorization") == f"Bearer {self.server.token}":
            return True
        reply(self, 401, "application/json", b'{"error": {"message": "bad token"}}')
        return False

    def do_GET(self) -> None:
        if self.path == "/metrics":
            moment = "t0" if self.server.scrapes == 0 else "t1"
            self.server.scrapes += 1
            reply(
                self, 200, "text/plain; version=0.0.4", fixture_text(f"proxy_defeats_{moment}.prom").encode()
            )
        elif self.path == "/admin/config" and self._authorized():
            reply(self, 200, "application/json", json.dumps(self.server.config).encode())
        elif self.path != "/admin/config":
            reply(self, 404, "application/json", b"{}")

    def do_PATCH(self) -> None:
        if self.path != "/admin/config" or not self._authorized():
            return
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if not set(body) <= {"max_tokens_cap", "cap_mode"}:
            reply(self, 400, "application/json", b'{"error": {"message": "unknown field"}}')
            return
        self.server.patches.append(body)
        self.server.config.update(body)
        reply(self, 200, "application/json", json.dumps(self.server.config).encode())


def metrics_answer(text: str) -> Answer:
    return (200, "text/plain; version=0.0.4", text)


def defeat_families(text: str) -> str:
    """Only the prefix-defeat families of an exposition (HELP, TYPE and samples), to add to another."""
    return "".join(line + "\n" for line in text.splitlines() if "prefix_defeat" in line)


def kvtune_with_detector(moment: str) -> str:
    """A kvtune serve scrape with its detector's series: the recorded engine scrape at `moment` (t0, t1)
    plus the recorded detector families of the same moment."""
    return fixture_text(f"kvtune_preempting_{moment}.prom") + defeat_families(
        fixture_text(f"proxy_defeats_{moment}.prom")
    )


# The cap the ladder sets on vllm_asking_long's traffic: generation p99 ~199 x 1.25, rounded up to 250,
# then the policy's floor of 256.
ASKING_LONG_CAP = 256


def vllm_asking_long(moment: str) -> str:
    """The recorded scrape at `moment` as vLLM exposes it (no kvtune: series), from clients that ask for up
    to 1,000 tokens while generating ~200: a server-side cap binds."""
    lines = [
        line
        for line in fixture_text(f"kvtune_preempting_{moment}.prom").splitlines()
        if "kvtune:" not in line
    ]
    asked = re.compile(r'^(vllm:request_params_max_tokens_bucket\{.*le="(?:100|200|500)\.0".*\}) \S+$')
    return "".join(asked.sub(r"\1 0.0", line) + "\n" for line in lines)


def prometheus_vector(text: str, stamp: float) -> str:
    """A /metrics body as a Prometheus instant-query answer (what a scrape of it would store)."""
    sample = [
        {"metric": {"__name__": s.name, **s.labels}, "value": [stamp, repr(float(s.value))]}
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]
    return json.dumps({"status": "success", "data": {"resultType": "vector", "result": sample}})


Series = dict[tuple[str, frozenset[tuple[str, str]]], float]

# the operator's own series, as the issue-14 contract names them (counters with their _total)
OPERATOR_SERIES = (
    "kvtune_operator_actions_total",
    "kvtune_operator_last_action_timestamp_seconds",
    "kvtune_operator_knob",
    "kvtune_operator_ladder_rung",
    "kvtune_operator_condition",
    "kvtune_operator_concurrency_ceiling",
    "kvtune_operator_last_evaluation_timestamp_seconds",
    "kvtune_operator_errors_total",
    "kvtune_operator_no_data_total",
    "kvtune_operator_rollbacks_total",
    "kvtune_operator_source_alternations_total",
)


def parse_series(text: str) -> Series:
    """An exposition as {(sample name, labels): value}."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def series_value(series: Series, name: str, **labels: str) -> float | None:
    """The value of the one sample of `name` whose labels include `labels` (None if none matches)."""
    found = [v for (n, have), v in series.items() if n == name and set(labels.items()) <= have]
    assert len(found) <= 1, (name, labels, found)
    return found[0] if found else None


def series_names(series: Series) -> set[str]:
    return {name for name, _ in series}
