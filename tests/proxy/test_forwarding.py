"""What the upstream receives: the client's very bytes when the cap changes nothing, a rewritten body (with
its own length) only when it does, the client's end-to-end headers, and never a chunked upload."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvtune.contract.admin import CapSetting
from tests.proxy.live_proxy import LiveProxy, RawUpstream, read_request_head, start_proxy

ANSWER = b'{"id":"cmpl-1","choices":[]}'


class Recorder:
    """A raw upstream that keeps each request's head and body and answers a fixed JSON body."""

    def __init__(self) -> None:
        self.requests: list[tuple[bytes, bytes]] = []
        self.upstream = RawUpstream(self.answer)

    async def answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await read_request_head(reader)
                length = next(
                    (
                        int(line.split(b":")[1])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length:")
                    ),
                    0,
                )
                self.requests.append((head.lower(), await reader.readexactly(length)))
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
                    % len(ANSWER)
                    + ANSWER
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()


@pytest.fixture()
def recorded(tiny_dir: Path) -> Iterator[tuple[Recorder, LiveProxy]]:
    recorder = Recorder()
    live = start_proxy(recorder.upstream.url, tiny_dir)
    yield recorder, live
    live.stop()
    recorder.upstream.stop()


def test_unchanged_bodies_go_through_byte_for_byte(recorded: tuple[Recorder, LiveProxy]) -> None:
    recorder, live = recorded
    raw = b'{ "model" : "tiny",\n  "prompt": "caf\xc3\xa9 \\u00e9",   "max_tokens": 5 }'
    with httpx.Client(base_url=live.url, timeout=30) as http:
        response = http.post(
            "/v1/completions",
            content=raw,
            headers={
                "content-type": "application/json",
                "authorization": "Bearer sk-upstream",
                "x-trace": "t1",
            },
        )
    assert response.status_code == 200
    assert response.content == ANSWER
    head, body = recorder.requests[-1]
    assert body == raw
    assert b"content-length: %d\r\n" % len(raw) in head
    assert b"transfer-encoding" not in head
    assert b"authorization: bearer sk-upstream\r\n" in head
    assert b"x-trace: t1\r\n" in head
    assert head.startswith(b"post /v1/completions http/1.1\r\n")


def test_only_a_capped_body_is_rewritten(recorded: tuple[Recorder, LiveProxy]) -> None:
    recorder, live = recorded
    live.core.set_cap_setting(CapSetting(3, "clamp"))
    with httpx.Client(base_url=live.url, timeout=30) as http:
        capped = http.post(
            "/v1/chat/completions", json={"model": "tiny", "messages": [], "max_completion_tokens": 9}
        )
        assert capped.headers["x-kvtune-max-tokens"] == "capped from 9 to 3"
        head, body = recorder.requests[-1]
        assert json.loads(body) == {"model": "tiny", "messages": [], "max_completion_tokens": 3}
        assert b"content-length: %d\r\n" % len(body) in head
        raw = b'{"model": "tiny", "messages": [], "max_tokens": 2}'
        http.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
        assert recorder.requests[-1][1] == raw
