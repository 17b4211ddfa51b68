"""An upstream that is down, silent, or breaks off a stream: the client gets a clear 502/504 or an error
event and a clean end, nothing hangs, and each request is counted once as failed with its error kind."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvtune.harness.local_http import free_port
from tests.proxy.live_proxy import (
    ONE_CHUNK,
    LiveProxy,
    RawUpstream,
    never_answer,
    one_chunk_then_close,
    start_proxy,
)
from tests.server.live_server import Samples, scrape

BODY = {"model": "tiny", "prompt": "hello", "max_tokens": 4}


def value(samples: Samples, name: str, **labels: str) -> float:
    return next(v for found, v in samples[name] if found == labels)


@pytest.fixture()
def proxy_to(tiny_dir: Path) -> Iterator[list[LiveProxy]]:
    """Proxies started by a test, stopped after it."""
    started: list[LiveProxy] = []
    yield started
    for live in started:
        live.stop()


def test_upstream_down_is_a_502_naming_it(tiny_dir: Path, proxy_to: list[LiveProxy]) -> None:
    upstream = f"http://127.0.0.1:{free_port()}"
    live = start_proxy(upstream, tiny_dir)
    proxy_to.append(live)
    with httpx.Client(base_url=live.url, timeout=30) as http:
        for path in ("/v1/completions", "/v1/chat/completions"):
            response = http.post(path, json={**BODY, "messages": [{"role": "user", "content": "hi"}]})
            assert response.status_code == 502
            error = response.json()["error"]
            assert error["type"] == "bad_gateway"
            assert error["message"].startswith(f"the upstream {upstream} is unreachable")
        health = http.get("/health")
        assert health.status_code == 503
        assert upstream in health.json()["error"]["message"]
        samples = scrape(http)
    assert value(samples, "kvtune:proxy_upstream_errors_total", kind="connect") == 2
    assert value(samples, "kvtune:proxy_requests_total", endpoint="completions", outcome="failed") == 1
    assert value(samples, "kvtune:proxy_requests_total", endpoint="chat_completions", outcome="failed") == 1
    assert value(samples, "kvtune:proxy_in_flight") == 0


def test_silent_upstream_is_a_504_after_the_timeout(tiny_dir: Path, proxy_to: list[LiveProxy]) -> None:
    silent = RawUpstream(never_answer)
    try:
        live = start_proxy(silent.url, tiny_dir, "--upstream-timeout", "0.5")
        proxy_to.append(live)
        with httpx.Client(base_url=live.url, timeout=30) as http:
            started = time.monotonic()
            response = http.post("/v1/completions", json=BODY)
            waited = time.monotonic() - started
            samples = scrape(http)
        assert response.status_code == 504
        assert response.json()["error"] == {
            "message": f"the upstream {silent.url} did not answer within 0.5 s",
            "type": "gateway_timeout",
            "param": None,
            "code": None,
        }
        assert 0.5 <= waited < 5
        assert silent.connections == 1
        assert value(samples, "kvtune:proxy_upstream_errors_total", kind="timeout") == 1
        assert value(samples, "kvtune:proxy_requests_total", endpoint="completions", outcome="failed") == 1
    finally:
        silent.stop()


def test_stream_closed_mid_way_ends_with_an_error_event(tiny_dir: Path, proxy_to: list[LiveProxy]) -> None:
    breaking = RawUpstream(one_chunk_then_close)
    try:
        live = start_proxy(breaking.url, tiny_dir)
        proxy_to.append(live)
        with (
            httpx.Client(base_url=live.url, timeout=30) as http,
            http.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as response,
        ):
            assert response.status_code == 200
            raw = response.read()
        events = [event for event in raw.split(b"\n\n") if event]
        assert events[0] + b"\n\n" == ONE_CHUNK
        error = json.loads(events[1][len(b"data: ") :])["error"]
        assert error["type"] == "bad_gateway"
        assert error["message"].startswith(f"the upstream {breaking.url} closed the stream before it ended")
        assert events[2:] == [b"data: [DONE]"]
        with httpx.Client(base_url=live.url, timeout=30) as http:
            samples = scrape(http)
        assert value(samples, "kvtune:proxy_upstream_errors_total", kind="closed_mid_stream") == 1
        assert value(samples, "kvtune:proxy_requests_total", endpoint="completions", outcome="failed") == 1
        assert value(samples, "kvtune:proxy_requests_total", endpoint="completions", outcome="completed") == 0
    finally:
        breaking.stop()
