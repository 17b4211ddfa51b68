"""The proxy's own /metrics: its requests and upstream errors (`kvtune:proxy_*`), the live cap, and the
prefix-defeat detector's findings, under the same names the engine exports so the operator reads both alike.

A private registry served in the text format 0.0.4, as the engine's (colon names survive only there). Every
label value is present from the start at 0, so a rate over a window never starts from a missing series.
The detector's counts are read at scrape time from the detector itself: they are its state, not a copy.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from kvtune.contract.metrics import CAPPED_LABELS
from kvtune.core.prefix_defeats import PrefixDefeatDetector
from kvtune.front.prefix_report import PrefixDefeatCollector

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
ENDPOINTS = ("completions", "chat_completions", "models")
OUTCOMES = ("completed", "failed", "rejected")
UPSTREAM_ERROR_KINDS = ("connect", "timeout", "closed_mid_stream", "http_status")
# The proxy's own cost is sub-millisecond; upstream latencies run to minutes.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                   30.0, 60.0, 120.0, 300.0, 600.0)  # fmt: skip


@dataclass(frozen=True)
class EndpointSeries:
    """One endpoint's labelled series, looked up once: a label lookup per request costs more than the
    update itself."""

    outcomes: dict[str, Counter]
    duration: Histogram
    time_to_first_byte: Histogram


class ProxyMetrics:
    """Every series the proxy exposes."""

    def __init__(self, detector: PrefixDefeatDetector) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        # process_start_time_seconds: the operator tells the proxy's restart (its counters from zero) from
        # a metrics URL that answers from another process
        ProcessCollector(registry=reg)
        self.requests = Counter(
            "kvtune:proxy_requests",
            "Requests the proxy answered, each counted once: completed, failed (upstream error, upstream "
            "gone, client gone) or rejected (by the proxy itself: bad body, the cap).",
            ("endpoint", "outcome"),
            registry=reg,
        )
        self.upstream_errors = Counter(
            "kvtune:proxy_upstream_errors",
            "Upstream failures: connect (down), timeout, closed_mid_stream, http_status (a 4xx/5xx answer).",
            ("kind",),
            registry=reg,
        )
        self.in_flight = Gauge(
            "kvtune:proxy_in_flight", "Requests the proxy is forwarding now.", registry=reg
        )
        self.duration = Histogram(
            "kvtune:proxy_request_duration_seconds",
            "From the request's arrival to the last byte of its answer.",
            ("endpoint",),
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self.time_to_first_byte = Histogram(
            "kvtune:proxy_time_to_first_byte_seconds",
            "From the request's arrival to the first byte of the upstream's answer body.",
            ("endpoint",),
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self.max_tokens_cap = Gauge(
            "kvtune:max_tokens_cap", "Live server-side cap on max_tokens; 0 means no cap.", registry=reg
        )
        self.capped = Counter(
            "kvtune:capped_requests",
            "Requests whose max_tokens the cap changed, by mode (clamp, reject, default: the cap filled in "
            "an absent max_tokens).",
            ("mode",),
            registry=reg,
        )
        self.by_endpoint = {
            endpoint: EndpointSeries(
                outcomes={outcome: self.requests.labels(endpoint, outcome) for outcome in OUTCOMES},
                duration=self.duration.labels(endpoint),
                time_to_first_byte=self.time_to_first_byte.labels(endpoint),
            )
            for endpoint in ENDPOINTS
        }
        for kind in UPSTREAM_ERROR_KINDS:
            self.upstream_errors.labels(kind)
        for mode in CAPPED_LABELS:
            self.capped.labels(mode)
        reg.register(PrefixDefeatCollector(detector, {}))

    def set_cap(self, cap: int | None) -> None:
        self.max_tokens_cap.set(cap or 0)

    def render(self) -> bytes:
        """The scrape body, text format 0.0.4 (serve it with CONTENT_TYPE)."""
        return generate_latest(self.registry)
