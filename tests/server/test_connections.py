"""The engine's connections: a slowloris client is cut off at the header deadline with a 408; a connection
that says nothing (new, or between keep-alive requests, or sending only blank lines) is closed at the idle
deadline; a thousand of them are all closed while /health keeps answering; an HTTP/1.0 client gets a
close-delimited stream it can read; two Authorization headers are refused on every admin route; an error
repeats a client's value only up to a bound.

The server under test runs with a 1 s header and a 1 s idle deadline. The checks wait for what the server
does; the times they measure are printed (`pytest -s`), and bounded only far above the deadline, where only a
server without one would reach."""

from __future__ import annotations

import json
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
from kvtune.cli import main
from tests.server.live_server import ADMIN_TOKEN, LiveServer, start_server

DEADLINE = 1.0
AUTH = f"Bearer {ADMIN_TOKEN}"


@pytest.fixture(scope="module")
def guarded(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    token = tmp_path_factory.mktemp("connections") / "token"
    token.write_text(ADMIN_TOKEN + "\n")
    token.chmod(0o600)
    live = start_server(
        tiny_dir, "--kv-cache-tokens", "1024", "--max-num-seqs", "8", "--log-stats-interval", "0",
        "--header-timeout", str(DEADLINE), "--idle-timeout", str(DEADLINE), "--admin-token-file", str(token),
    )  # fmt: skip
    yield live
    live.stop()


def test_a_slowloris_client_is_cut_off_at_the_header_deadline(guarded: LiveServer) -> None:
    cut = slowloris(guarded.url)
    print(f"slowloris cut after {cut.seconds:.2f} s (header deadline {DEADLINE:g} s)")
    assert cut.closed and cut.answer.startswith(b"HTTP/1.1 408 "), cut
    assert DEADLINE * 0.9 <= cut.seconds < HANG / 2


@pytest.mark.parametrize(
    ("after_request", "nudge_every"),
    [(False, None), (True, None), (True, 0.2)],
    ids=["new-and-silent", "after-a-request", "blank-lines-only"],
)
def test_a_connection_without_a_request_is_closed_at_the_idle_deadline(
    guarded: LiveServer, after_request: bool, nudge_every: float | None
) -> None:
    cut = silent(guarded.url, after_request, nudge_every)
    print(f"idle connection closed after {cut.seconds:.2f} s (idle deadline {DEADLINE:g} s)")
    assert cut.closed and DEADLINE * 0.9 <= cut.seconds < HANG / 2, cut
    if after_request:
        assert cut.answer.startswith(b"HTTP/1.1 200 ")
    else:
        assert cut.answer == b""  # closed, not answered


def test_a_thousand_idle_connections_are_closed_and_health_keeps_answering(guarded: LiveServer) -> None:
    crowd = idle_crowd(guarded.url, 1000)
    p99 = crowd.health_p99() * 1000
    print(f"1000 idle connections: closed after {min(crowd.lifetimes):.2f}-{max(crowd.lifetimes):.2f} s; "
          f"/health x{len(crowd.health)}, p99 {p99:.1f} ms")  # fmt: skip
    assert crowd.opened == 1000 and crowd.still_open == 0 and len(crowd.lifetimes) == 1000
    assert max(crowd.lifetimes) < HANG / 2
    assert crowd.health and not crowd.health_failures, crowd.health_failures[:3]
    assert p99 < 1000, "a /health that waits a second behind idle connections: the loop is blocked"


def test_an_http10_client_reads_a_close_delimited_stream(guarded: LiveServer) -> None:
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 12, "stream": True, "ignore_eos": True}
    answer = http10_stream(guarded.url, "/v1/completions", body)
    check_http10_stream(answer)
    assert sum(len(json.loads(e)["choices"]) for e in answer.events[:-1]) == 12
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "stream": True}
    answer = http10_stream(guarded.url, "/v1/chat/completions", chat)
    assert "transfer-encoding" not in answer.headers and answer.events[-1] == "[DONE]"


def test_an_http10_client_still_gets_a_length_and_http11_still_chunks(guarded: LiveServer) -> None:
    plain = http10_stream(guarded.url, "/v1/completions", {"model": "tiny", "prompt": "Hi", "max_tokens": 3})
    assert plain.headers.get("content-length") == str(len(plain.body.encode()))
    with httpx.Client(base_url=guarded.url) as http:
        body = {"model": "tiny", "prompt": "Hi", "max_tokens": 3, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.headers.get("transfer-encoding") == "chunked"
            assert response.read().decode().endswith("data: [DONE]\n\n")


@pytest.mark.parametrize("second", [AUTH, "Bearer wrong"], ids=["same-twice", "right-then-wrong"])
def test_two_authorization_headers_are_refused_on_every_admin_route(guarded: LiveServer, second: str) -> None:
    doubled = [("Authorization", AUTH), ("Authorization", second)]
    with httpx.Client(base_url=guarded.url) as http:
        before = http.get("/admin/config", headers={"Authorization": AUTH}).json()
        for response in (
            http.get("/admin/config", headers=doubled),
            http.patch("/admin/config", json={"max_num_seqs": 2}, headers=doubled),
        ):
            assert response.status_code == 400, response.text
            assert "2 Authorization headers" in response.json()["error"]["message"]
        assert http.get("/admin/config", headers={"Authorization": AUTH}).json() == before


def test_an_unknown_model_is_echoed_only_up_to_a_bound(guarded: LiveServer) -> None:
    name = "m" * 1_000_000
    with httpx.Client(base_url=guarded.url, timeout=HANG) as http:
        response = http.post("/v1/completions", json={"model": name, "prompt": "x", "max_tokens": 1})
    assert response.status_code == 404
    assert len(response.content) < 2048 and "more characters" in response.json()["error"]["message"]


@pytest.mark.parametrize("flag", ["--header-timeout", "--idle-timeout"])
@pytest.mark.parametrize("value", ["0", "-1", "inf"])
def test_a_bad_deadline_is_one_clear_line(flag: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--tiny", flag, value]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"kvtune: error: {flag} must be a positive number"), err
