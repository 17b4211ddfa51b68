"""A client that goes away stops costing KV cache, through either front: the engine aborts its request, frees
its blocks, and its running and waiting gauges return to 0; the proxy counts the request once, as failed.

The client leaves while the engine is paused between steps (`LiveServer.paused`), so the request is still
mid-way when the hang-up reaches the engine on any machine, fast or slow.
"""

from __future__ import annotations

import contextlib

import httpx
import pytest

from tests.front.fronts import Front, engine_gauges, proxy_requests
from tests.server.live_server import LiveServer, hang_up_mid_way, scrape, wait_for

LONG = {"model": "tiny", "prompt": "q" * 100, "max_tokens": 400, "ignore_eos": True, "temperature": 0}
LONG_CHAT = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "q" * 100}],
    "max_tokens": 400,
    "ignore_eos": True,
}


def aborted(engine: LiveServer) -> int:
    return engine.counters().finished.get("abort", 0)


def assert_freed(engine: LiveServer, aborted_before: int) -> None:
    """The engine has aborted one more request, and holds nothing for it any longer."""
    wait_for(lambda: aborted(engine) == aborted_before + 1, "the engine's abort")
    wait_for(lambda: engine_gauges(engine) == (0, 0), "the engine's gauges at 0")
    engine.wait_idle()
    assert engine.blocks_held() == 0
    assert engine.on_engine(lambda e: e.allocator.free_slots == e.allocator.num_slots)


def test_a_stream_closed_mid_way_frees_its_blocks(front: Front, client: httpx.Client) -> None:
    engine = front.engine
    engine.wait_idle()
    before, samples_before = aborted(engine), scrape(client)
    with contextlib.ExitStack() as paused:
        with (
            httpx.Client(base_url=front.url, timeout=60) as http,
            http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as response,
        ):
            assert response.status_code == 200
            lines = response.iter_lines()
            seen = 0
            while seen < 3:
                seen += next(lines).startswith("data:")
            assert engine.blocks_held() > 0 and engine_gauges(engine)[0] == 1
            paused.enter_context(engine.paused())
            # leaving the block closes the connection with most of the 400 tokens still to come
        wait_for(lambda: engine.commands_queued() > 0, "the engine to queue the abort")
    assert_freed(engine, before)
    if front.proxy is not None:  # counted once, as failed, and no longer in flight
        failed_before = proxy_requests(samples_before, "completions", "failed")
        wait_for(
            lambda: proxy_requests(scrape(client), "completions", "failed") == failed_before + 1,
            "the proxy's count",
        )
        assert scrape(client)["kvtune:proxy_in_flight"][0][1] == 0


@pytest.mark.parametrize(
    ("path", "body"),
    [("/v1/completions", LONG), ("/v1/chat/completions", LONG_CHAT)],
    ids=["completions", "chat"],
)
def test_a_client_giving_up_on_a_plain_request_aborts_it(front: Front, path: str, body: dict) -> None:
    """The front sends nothing until the answer is done; it notices the hang-up while it waits."""
    engine = front.engine
    engine.wait_idle()
    before = aborted(engine)
    hang_up_mid_way(front.url, path, body, engine)
    assert_freed(engine, before)
