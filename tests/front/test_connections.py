"""Both fronts' connections: a slowloris client is cut off at the header deadline with a 408; a connection that
says nothing (new, or between keep-alive requests, or sending only blank lines) is closed at the idle
deadline; a thousand of them are all closed while /health keeps answering; an HTTP/1.0 client gets a
close-delimited stream it can read (the proxy relays the upstream's chunked one).

Each front under test runs with a 1 s header and a 1 s idle deadline (the proxy in front of an engine without
them). The checks wait for what the front does; the times they measure are printed (`pytest -s`), and
bounded only far above the deadline, where only a front without one would reach."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtune.bench.connection_probes import (
    HANG,
    check_http10_stream,
    http10_stream,
    idle_crowd,
    silent,
    slowloris,
)
from tests.front.fronts import FRONTS
from tests.proxy.live_proxy import start_proxy
from tests.server.live_server import LiveServer, start_server

DEADLINE = 1.0
DEADLINES = ("--header-timeout", str(DEADLINE), "--idle-timeout", str(DEADLINE))


@pytest.fixture(scope="module", params=FRONTS)
def guarded(request: pytest.FixtureRequest, tiny_dir: Path) -> Iterator[str]:
    """The URL of a front with the 1 s deadlines."""
    if request.param == "engine":
        live: LiveServer = start_server(
            tiny_dir,
            "--kv-cache-tokens",
            "1024",
            "--max-num-seqs",
            "8",
            "--log-stats-interval",
            "0",
            *DEADLINES,
        )
        yield live.url
        live.stop()
        return
    engine: LiveServer = request.getfixturevalue("engine")
    proxy = start_proxy(engine.url, tiny_dir, *DEADLINES)
    yield proxy.url
    proxy.stop()


def test_a_slowloris_client_is_cut_off_at_the_header_deadline(guarded: str) -> None:
    cut = slowloris(guarded)
    print(f"slowloris cut after {cut.seconds:.2f} s (header deadline {DEADLINE:g} s)")
    assert cut.closed and cut.answer.startswith(b"HTTP/1.1 408 "), cut
    assert DEADLINE * 0.9 <= cut.seconds < HANG / 2


@pytest.mark.parametrize(
    ("after_request", "nudge_every"),
    [(False, None), (True, None), (True, 0.2)],
    ids=["new-and-silent", "after-a-request", "blank-lines-only"],
)
def test_a_connection_without_a_request_is_closed_at_the_idle_deadline(
    guarded: str, after_request: bool, nudge_every: float | None
) -> None:
    cut = silent(guarded, after_request, nudge_every)
    print(f"idle connection closed after {cut.seconds:.2f} s (idle deadline {DEADLINE:g} s)")
    assert cut.closed and DEADLINE * 0.9 <= cut.seconds < HANG / 2, cut
    if after_request:
        assert cut.answer.startswith(b"HTTP/1.1 200 ")
    else:
        assert cut.answer == b""  # closed, not answered


def test_a_thousand_idle_connections_are_closed_and_health_keeps_answering(guarded: str) -> None:
    crowd = idle_crowd(guarded, 1000)
    p99 = crowd.health_p99() * 1000
    print(f"1000 idle connections: closed after {min(crowd.lifetimes):.2f}-{max(crowd.lifetimes):.2f} s; "
          f"/health x{len(crowd.health)}, p99 {p99:.1f} ms")  # fmt: skip
    assert crowd.opened == 1000 and crowd.still_open == 0 and len(crowd.lifetimes) == 1000
    assert max(crowd.lifetimes) < HANG / 2
    assert crowd.health and not crowd.health_failures, crowd.health_failures[:3]
    assert p99 < 1000, "a /health that waits a second behind idle connections: the loop is blocked"


def test_an_http10_client_reads_a_close_delimited_stream(guarded: str) -> None:
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 12, "stream": True, "ignore_eos": True}
    answer = http10_stream(guarded, "/v1/completions", body)
    check_http10_stream(answer)
    assert sum(len(json.loads(e)["choices"]) for e in answer.events[:-1]) == 12
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "stream": True}
    answer = http10_stream(guarded, "/v1/chat/completions", chat)
    assert "transfer-encoding" not in answer.headers and answer.events[-1] == "[DONE]"
