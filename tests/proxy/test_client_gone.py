"""A client that hangs up on the proxy cancels the upstream request: the upstream engine sees the disconnect,
aborts, and its running and waiting gauges return to 0; the proxy counts the request once, as failed.

The client leaves while the upstream engine is paused between steps (`LiveServer.paused`), so the request
is still mid-way when the hang-up reaches it on any machine, fast or slow.
"""

from __future__ import annotations

import contextlib

import httpx
import pytest

from tests.proxy.live_proxy import LiveProxy
from tests.server.live_server import LiveServer, Samples, hang_up_mid_way, scrape, wait_for

LONG = {"model": "tiny", "prompt": "q" * 100, "max_tokens": 400, "ignore_eos": True, "temperature": 0}


def aborted(upstream: LiveServer) -> int:
    return upstream.counters().finished.get("abort", 0)


def gauges(upstream: LiveServer) -> tuple[float, float]:
    with httpx.Client(base_url=upstream.url, timeout=10) as http:
        samples = scrape(http)
    return (
        sum(v for _, v in samples["vllm:num_requests_running"]),
        sum(v for _, v in samples["vllm:num_requests_waiting"]),
    )


def failed(samples: Samples, endpoint: str) -> float:
    return next(
        v
        for labels, v in samples["kvtune:proxy_requests_total"]
        if labels == {"endpoint": endpoint, "outcome": "failed"}
    )


def test_client_closing_a_stream_aborts_the_upstream_request(
    proxy: LiveProxy, upstream: LiveServer, client: httpx.Client
) -> None:
    upstream.wait_idle()
    before, failed_before = aborted(upstream), failed(scrape(client), "completions")
    with contextlib.ExitStack() as paused:
        with (
            httpx.Client(base_url=proxy.url, timeout=60) as http,
            http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as response,
        ):
            assert response.status_code == 200
            lines = response.iter_lines()
            seen = 0
            while seen < 3:
                seen += next(lines).startswith("data:")
            assert gauges(upstream)[0] == 1
            paused.enter_context(upstream.paused())
            # leaving the block closes the connection with most of the 400 tokens still to come
        wait_for(lambda: upstream.commands_queued() > 0, "the upstream to queue the abort")
    wait_for(lambda: aborted(upstream) == before + 1, "the upstream's abort")
    wait_for(lambda: gauges(upstream) == (0, 0), "the upstream's gauges at 0")
    upstream.wait_idle()
    assert upstream.blocks_held() == 0
    wait_for(lambda: failed(scrape(client), "completions") == failed_before + 1, "the proxy's count")
    assert scrape(client)["kvtune:proxy_in_flight"][0][1] == 0


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_client_giving_up_on_a_plain_request_aborts_the_upstream_request(
    proxy: LiveProxy, upstream: LiveServer, path: str
) -> None:
    """The upstream sends nothing until it is done; the proxy notices the hang-up while it waits."""
    upstream.wait_idle()
    before = aborted(upstream)
    body = dict(LONG) if path == "/v1/completions" else {
        "model": "tiny", "messages": [{"role": "user", "content": "q" * 100}], "max_tokens": 400, "ignore_eos": True,
    }  # fmt: skip
    hang_up_mid_way(proxy.url, path, body, upstream)
    wait_for(lambda: aborted(upstream) == before + 1, "the upstream's abort")
    wait_for(lambda: gauges(upstream) == (0, 0), "the upstream's gauges at 0")
    upstream.wait_idle()
    assert upstream.blocks_held() == 0
