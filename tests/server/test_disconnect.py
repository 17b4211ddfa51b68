"""A client that goes away stops costing KV cache: its request is aborted and its blocks freed.

The client leaves while the engine is paused between steps (`LiveServer.paused`), so the request is still
mid-way when the server learns of it on any machine, fast or slow.
"""

from __future__ import annotations

import contextlib

import httpx
import pytest

from tests.server.live_server import LiveServer, hang_up_mid_way, wait_for

LONG = {"prompt": "q" * 100, "max_tokens": 400, "ignore_eos": True, "temperature": 0}


def aborted(server: LiveServer) -> int:
    return server.counters().finished.get("abort", 0)


def test_stream_closed_mid_way_frees_its_blocks(server: LiveServer) -> None:
    server.wait_idle()
    before = aborted(server)
    with contextlib.ExitStack() as paused:
        with (
            httpx.Client(base_url=server.url, timeout=60) as http,
            http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as response,
        ):
            assert response.status_code == 200
            lines = response.iter_lines()
            seen = 0
            while seen < 3:
                seen += next(lines).startswith("data:")
            assert server.blocks_held() > 0
            paused.enter_context(server.paused())
            # leaving the block closes the connection with most of the 400 tokens still to come
        wait_for(lambda: server.commands_queued() > 0, "the front to queue the abort")
    wait_for(lambda: aborted(server) == before + 1, "the abort")
    server.wait_idle()
    assert server.blocks_held() == 0
    assert server.on_engine(lambda e: e.allocator.free_slots == e.allocator.num_slots)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_plain_request_whose_client_times_out_is_aborted(server: LiveServer, path: str) -> None:
    server.wait_idle()
    before = aborted(server)
    body = dict(LONG) if path == "/v1/completions" else {
        "messages": [{"role": "user", "content": "q" * 100}], "max_tokens": 400, "ignore_eos": True,
    }  # fmt: skip
    hang_up_mid_way(server.url, path, body, server)
    wait_for(lambda: aborted(server) == before + 1, "the abort")
    server.wait_idle()
    assert server.blocks_held() == 0
