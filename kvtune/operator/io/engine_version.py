"""vLLM's own `GET /version`, which decides the admission flag the operator patches. A version changes only
when the pods roll, so the operator asks each engine once and keeps the answer for `VERSION_TTL_S`
(one read per policy per tick was one request more per tick, on a fresh connection)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import httpx

from kvtune.operator.decide.admission_flag import parse_version
from kvtune.operator.io.http import shared_client

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
