"""Client-side rate limiting of the operator's own API requests, as client-go and controller-runtime do it:
a token bucket of `qps` tokens a second holding at most `burst`, one token a request. A fleet of policies
then meets the API server at a steady pace the chart states (`operator.kubeApi.qps` / `.burst`) instead of
in bursts of every policy's tick at once."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

DEFAULT_QPS = 20.0  # controller-runtime's defaults (client-go's own are 5 and 10)
DEFAULT_BURST = 30
DEFAULT_WORKERS = 16  # evaluations at once (`--workers`): mostly waiting on scrapes and the API server


class TokenBucket:
    """Thread-safe: each caller takes one token, waiting (outside the lock) for its turn when none is left.
    A qps of 0 or less means no limit."""

    def __init__(self, qps: float = DEFAULT_QPS, burst: int = DEFAULT_BURST,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:  # fmt: skip
        if qps > 0 and burst < 1:
            raise ValueError(f"burst must be at least 1 with a qps limit, got {burst}")
        self.qps = qps
        self.burst = burst
        self.clock = clock
        self.sleep = sleep
        self._lock = threading.Lock()
        self._tokens = float(burst)
        self._at = clock()

    def reserve(self) -> float:
        """Take the next token; the seconds until it is due (0 when one was there)."""
        if self.qps <= 0:
            return 0.0
        with self._lock:
            now = self.clock()
            self._tokens = min(float(self.burst), self._tokens + (now - self._at) * self.qps)
            self._at = now
            self._tokens -= 1.0  # may go below zero: the debt is the queue of callers waiting
            return 0.0 if self._tokens >= 0 else -self._tokens / self.qps

    def take(self) -> float:
        """Wait for a token; the seconds waited."""
        delay = self.reserve()
        if delay > 0:
            self.sleep(delay)
        return delay
