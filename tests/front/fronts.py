"""The two fronts the front's behaviours are tested on: `kvtune serve`, which answers itself, and
`kvtune proxy` in front of that same engine. A test talks to `Front.url` and looks behind it at `engine`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx

from tests.proxy.live_proxy import LiveProxy
from tests.server.live_server import LiveServer, Samples, scrape

FRONTS = ["engine", "proxy"]
ADMIN_TOKEN = "front-admin-token"
AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@dataclass(frozen=True)
class Front:
    """One front under test."""

    kind: str  # "engine" or "proxy"
    url: str
    # The engine whose model answers: the front itself, or the proxy's upstream.
    engine: LiveServer
    proxy: LiveProxy | None
    # What GET /admin/config shows besides the cap: the engine's other knob and its bounds; nothing on a proxy.
    own_config: dict[str, Any]

    def config(self, cap: int | None, mode: str) -> dict[str, Any]:
        """The whole GET /admin/config answer with the cap at `cap` in `mode`."""
        return {**self.own_config, "max_tokens_cap": cap, "cap_mode": mode}

    def engine_requests(self) -> int:
        """Requests the engine has finished, however they ended (an idle engine's count is settled)."""
        self.engine.wait_idle()
        return sum(self.engine.counters().finished.values())


def proxy_requests(samples: Samples, endpoint: str, outcome: str) -> float:
    """The proxy's own count of `endpoint` requests that ended as `outcome`."""
    labels = {"endpoint": endpoint, "outcome": outcome}
    return next(value for found, value in samples["kvtune:proxy_requests_total"] if found == labels)


def engine_gauges(engine: LiveServer) -> tuple[float, float]:
    """The engine's running and waiting requests, as its /metrics shows them."""
    with httpx.Client(base_url=engine.url, timeout=10) as http:
        samples = scrape(http)
    return (
        sum(v for _, v in samples["vllm:num_requests_running"]),
        sum(v for _, v in samples["vllm:num_requests_waiting"]),
    )
