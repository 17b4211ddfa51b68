"""One request's bookkeeping: counted exactly once, whichever way it ends.

A request enters `kvtune:proxy_in_flight` when it arrives and leaves it with one outcome (completed, failed,
rejected) in `kvtune:proxy_requests_total`; a second `finish` is ignored, so an error path that runs after
another cannot count a request twice.
"""

from __future__ import annotations

import time

from kvtune.proxy.metrics import ProxyMetrics


class RequestRecord:
    def __init__(self, metrics: ProxyMetrics, endpoint: str) -> None:
        self.metrics = metrics
        self.endpoint = endpoint
        self.series = metrics.by_endpoint[endpoint]
        self.started = time.perf_counter()
        self.first_byte_at: float | None = None
        self.outcome: str | None = None
        metrics.in_flight.inc()

    def first_byte(self) -> None:
        """The first byte of the upstream's answer body arrived (observed once)."""
        if self.first_byte_at is None:
            self.first_byte_at = time.perf_counter()
            self.series.time_to_first_byte.observe(self.first_byte_at - self.started)

    def finish(self, outcome: str, upstream_error: str | None = None) -> None:
        """Count the request under `outcome`, and `upstream_error` (a kind) when the upstream caused it."""
        if self.outcome is not None:
            return
        self.outcome = outcome
        self.metrics.in_flight.dec()
        self.series.outcomes[outcome].inc()
        self.series.duration.observe(time.perf_counter() - self.started)
        if upstream_error is not None:
            self.metrics.upstream_errors.labels(upstream_error).inc()
