"""Builders for recorded and synthetic metric windows."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from kvtune.operator import metric_names as m
from kvtune.operator.engine_view import KNOB_MAX_NUM_SEQS, KNOB_MAX_TOKENS_CAP, EngineView
from kvtune.operator.sample import Histogram, Sample, SampleResult
from kvtune.operator.sources import parse_exposition

FIXTURES = Path(__file__).parent / "fixtures"


def fixture_text(name: str) -> str:
    return (FIXTURES / name).read_text()


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


def serve_bodies(bodies: list[str]) -> Iterator[str]:
    """A /metrics endpoint answering `bodies` in order (the last one from then on); yields its base URL."""
    remaining = list(bodies)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = remaining.pop(0) if len(remaining) > 1 else remaining[0]
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


def reply(handler: BaseHTTPRequestHandler, status: int, content_type: str, body: bytes) -> None:
    """Answer a stub server's request with one whole body."""
    handler.send_response(status)
    handler.send_header("Content-Type", content_type)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)
