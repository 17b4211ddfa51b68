"""The operator's one HTTP client: every pod scrape, Prometheus query, admin call and `/version` read goes
through it. A client per request built a TLS context each time (`ssl.create_default_context`, about 20 ms of
CPU, 59% of the operator's samples at 100 policies); one client builds it once and keeps connections to the
pods alive from one tick to the next. httpx's client is safe to share between the evaluation threads.

The one thing it keeps between ticks: vLLM's own `GET /version` (`VERSIONS`), which decides the admission
flag the operator patches. A version changes only when the pods roll, so the operator asks each engine once
and keeps the answer for `VERSION_TTL_S` (one read per policy per tick was one request more per tick, on a
fresh connection)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import httpx

from kvtune.operator.decide.admission_flag import parse_version

# Enough for every evaluation thread's parallel pod reads at once; an idle connection lives past one
# policy interval so the next tick reuses it.
LIMITS = httpx.Limits(max_connections=512, max_keepalive_connections=512, keepalive_expiry=120.0)

_lock = threading.Lock()
_client: httpx.Client | None = None


def shared_client() -> httpx.Client:
    """The process's client, made on first use (and again if something closed it)."""
    global _client
    with _lock:
        if _client is None or _client.is_closed:
            _client = httpx.Client(limits=LIMITS)
        return _client


def close_shared_client() -> None:
    """Close the process's client (the operator's cleanup); the next use makes a new one."""
    global _client
    with _lock:
        if _client is not None:
            _client.close()
        _client = None


VERSION_TIMEOUT_S = 3.0
VERSION_TTL_S = 600.0  # a rollout to another vLLM is seen within this, and at once by the image tag

Clock = Callable[[], float]


def read_vllm_version(base_url: str, timeout: float = VERSION_TIMEOUT_S) -> str | None:
    """vLLM's version from `GET /version` (`{"version": "0.32.1"}`); None when it does not answer one."""
    try:
        answer = shared_client().get(base_url.rstrip("/") + "/version", timeout=timeout)
        version = answer.json().get("version") if answer.status_code == 200 else None
    except (httpx.HTTPError, httpx.InvalidURL, ValueError, AttributeError):
        return None
    return str(version) if isinstance(version, str) and parse_version(version) is not None else None


class VersionCache:
    """Each engine's answered version, kept `ttl` seconds; an engine that does not answer is asked again at
    the next read (nothing is remembered of a failure)."""

    def __init__(self, ttl: float = VERSION_TTL_S, clock: Clock = time.monotonic,
                 read: Callable[[str], str | None] = read_vllm_version) -> None:  # fmt: skip
        self.ttl = ttl
        self.clock = clock
        self.read = read
        self._lock = threading.Lock()
        self._answers: dict[str, tuple[str, float]] = {}

    def version(self, base_url: str) -> str | None:
        now = self.clock()
        with self._lock:
            kept = self._answers.get(base_url)
        if kept is not None and now - kept[1] < self.ttl:
            return kept[0]
        answered = self.read(base_url)
        with self._lock:
            if answered is not None:
                self._answers[base_url] = (answered, now)
            else:
                self._answers.pop(base_url, None)
        return answered


VERSIONS = VersionCache()  # the process's: shared by every policy's evaluations
