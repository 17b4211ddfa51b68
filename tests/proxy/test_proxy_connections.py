"""The proxy's connections, as the engine's (tests/server/test_connections.py): the header and idle
deadlines, a thousand idle connections closed while /health keeps answering, a close-delimited stream for
an HTTP/1.0 client (the upstream's chunked answer relayed), and two Authorization headers refused on
every admin route. The proxy under test runs with 1 s deadlines in front of the real engine."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvtune.bench.connection_probes import (
    HANG,
    check_http10_stream,
    http10_stream,
    idle_crowd,
    silent,
    slowloris,
)
from tests.proxy.live_proxy import ADMIN_TOKEN, LiveProxy, start_proxy
from tests.server.live_server import LiveServer

DEADLINE = 1.0
AUTH = f"Bearer {ADMIN_TOKEN}"


@pytest.fixture(scope="module")
def guarded(
    upstream: LiveServer, tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveProxy]:
    token = tmp_path_factory.mktemp("proxy-connections") / "token"
    token.write_text(ADMIN_TOKEN + "\n")
    token.chmod(0o600)
    live = start_proxy(
        upstream.url, tiny_dir, "--admin-token-file", str(token),
        "--header-timeout", str(DEADLINE), "--idle-timeout", str(DEADLINE),
    )  # fmt: skip
    yield live
    live.stop()


def test_a_slowloris_client_is_cut_off_at_the_header_deadline(guarded: LiveProxy) -> None:
    cut = slowloris(guarded.url)
    print(f"proxy: slowloris cut after {cut.seconds:.2f} s (header deadline {DEADLINE:g} s)")
    assert cut.closed and cut.answer.startswith(b"HTTP/1.1 408 "), cut
    assert DEADLINE * 0.9 <= cut.seconds < HANG / 2


def test_a_silent_connection_is_closed_at_the_idle_deadline(guarded: LiveProxy) -> None:
    for after_request in (False, True):
        cut = silent(guarded.url, after_request)
        assert cut.closed and DEADLINE * 0.9 <= cut.seconds < HANG / 2, cut


def test_a_thousand_idle_connections_are_closed_and_health_keeps_answering(guarded: LiveProxy) -> None:
    crowd = idle_crowd(guarded.url, 1000)
    p99 = crowd.health_p99() * 1000
    print(f"proxy: 1000 idle connections closed after {min(crowd.lifetimes):.2f}-{max(crowd.lifetimes):.2f} s; "
          f"/health x{len(crowd.health)}, p99 {p99:.1f} ms")  # fmt: skip
    assert crowd.opened == 1000 and crowd.still_open == 0 and max(crowd.lifetimes) < HANG / 2
    assert crowd.health and not crowd.health_failures, crowd.health_failures[:3]
    assert p99 < 1000, "a /health that waits a second behind idle connections: the loop is blocked"


def test_an_http10_client_reads_the_relayed_stream(guarded: LiveProxy) -> None:
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 12, "stream": True, "ignore_eos": True}
    check_http10_stream(http10_stream(guarded.url, "/v1/completions", body))


@pytest.mark.parametrize("second", [AUTH, "Bearer wrong"], ids=["same-twice", "right-then-wrong"])
def test_two_authorization_headers_are_refused_on_every_admin_route(guarded: LiveProxy, second: str) -> None:
    doubled = [("Authorization", AUTH), ("Authorization", second)]
    with httpx.Client(base_url=guarded.url) as http:
        for response in (
            http.get("/admin/config", headers=doubled),
            http.patch("/admin/config", json={"max_tokens_cap": 5}, headers=doubled),
        ):
            assert response.status_code == 400, response.text
            assert "2 Authorization headers" in response.json()["error"]["message"]
    assert guarded.core.current_cap_setting().cap is None
