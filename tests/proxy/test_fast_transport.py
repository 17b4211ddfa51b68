"""The proxy's httpx transport against raw upstreams that answer exactly the bytes each test wants: keep-alive
reuse, both body framings, answers split across reads or packed into one, every failure as httpx's own
exception, a cancelled read that closes its connection, and the bound on open connections."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import httpx
import pytest

from kvtune.proxy.fast_transport import ON_WRITTEN, FastTransport

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
EVENT = b'data: {"choices":[{"text":"x"}]}\n\n'


class Upstream:
    """An asyncio server on loopback whose connections run `handler`; counts connections and requests."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.open_now = 0
        self.most_open = 0
        self.heads: list[bytes] = []
        self.closed_by_peer = asyncio.Event()
        self.url = ""

    async def on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.open_now += 1
        self.most_open = max(self.most_open, self.open_now)
        try:
            await self.handler(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.open_now -= 1
            writer.close()

    async def read_request(self, reader: asyncio.StreamReader) -> bytes:
        """One request (head and Content-Length body); IncompleteReadError once the client has closed."""
        head = await reader.readuntil(b"\r\n\r\n")
        self.heads.append(head)
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        return await reader.readexactly(length)


@asynccontextmanager
async def serving(handler_of: Callable[[Upstream], Handler]) -> AsyncIterator[Upstream]:
    upstream = Upstream(lambda r, w: handler_of(upstream)(r, w))
    server = await asyncio.start_server(upstream.on_connect, "127.0.0.1", 0)
    upstream.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        yield upstream
    finally:
        server.close()


def chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for piece in pieces) + b"0\r\n\r\n"


SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def answer_every_request(body: bytes) -> Callable[[Upstream], Handler]:
    """Keep-alive: answer each request on the connection with `body` (Content-Length framed)."""

    def of(upstream: Upstream) -> Handler:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while True:
                await upstream.read_request(reader)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
                await writer.drain()

        return handler

    return of


async def until(condition: Callable[[], bool]) -> None:
    """Yield to the event loop until `condition` holds; the deadline only catches a hang."""
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.001)


async def collect(response: httpx.Response) -> list[bytes]:
    return [chunk async for chunk in response.aiter_raw()]


async def stream(client: httpx.AsyncClient, url: str) -> tuple[httpx.Response, list[bytes]]:
    async with client.stream("POST", url, content=b'{"prompt": "hi"}') as response:
        return response, await collect(response)


def test_keep_alive_reuses_one_connection_for_sequential_requests() -> None:
    async def scenario() -> None:
        async with (
            serving(answer_every_request(b'{"ok":true}')) as upstream,
            httpx.AsyncClient(transport=FastTransport()) as client,
        ):
            for _ in range(5):
                response = await client.post(upstream.url + "/v1/completions", content=b"{}")
                assert response.status_code == 200
                assert response.json() == {"ok": True}
            assert upstream.connections == 1
            assert len(upstream.heads) == 5

    asyncio.run(scenario())


def test_request_goes_out_as_head_and_body_with_its_length() -> None:
    async def scenario() -> None:
        written: list[int] = []
        async with (
            serving(answer_every_request(b"{}")) as upstream,
            httpx.AsyncClient(transport=FastTransport()) as client,
        ):
            request = client.build_request(
                "POST",
                upstream.url + "/v1/chat/completions?x=1",
                content=b'{"a": 1}',
                headers={"x-trace": "t1"},
                extensions={ON_WRITTEN: lambda: written.append(len(upstream.heads))},
            )
            response = await client.send(request)
        assert response.status_code == 200
        head = upstream.heads[0].lower()
        assert head.startswith(b"post /v1/chat/completions?x=1 http/1.1\r\n")
        assert b"content-length: 8\r\n" in head
        assert b"x-trace: t1\r\n" in head
        assert b"transfer-encoding" not in head
        assert written == [0]  # called once, after the write and before the upstream had read it

    asyncio.run(scenario())


def test_chunked_and_content_length_bodies_decode_alike() -> None:
    events = [EVENT, EVENT, b"data: [DONE]\n\n"]

    def of(upstream: Upstream) -> Handler:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await upstream.read_request(reader)
            writer.write(SSE_HEAD + chunked(*events))
            await upstream.read_request(reader)
            body = b"".join(events)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()
            await reader.read()

        return handler

    async def scenario() -> None:
        async with serving(of) as upstream, httpx.AsyncClient(transport=FastTransport()) as client:
            first, first_chunks = await stream(client, upstream.url)
            second, second_chunks = await stream(client, upstream.url)
        assert b"".join(first_chunks) == b"".join(second_chunks) == b"".join(events)
        assert first.headers["content-type"] == "text/event-stream"
        assert second.headers["content-length"] == str(len(b"".join(events)))
        assert upstream.connections == 1

    asyncio.run(scenario())


def test_an_answer_split_across_many_reads_arrives_whole_as_it_comes() -> None:
    raw = SSE_HEAD + chunked(*[EVENT] * 20, b"data: [DONE]\n\n")

    def of(upstream: Upstream) -> Handler:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await upstream.read_request(reader)
            for start in range(0, len(raw), 7):  # 7-byte pieces: heads, sizes and events all cut apart
                writer.write(raw[start : start + 7])
                await writer.drain()
                await asyncio.sleep(0.001)
            await reader.read()

        return handler

    async def scenario() -> None:
        async with serving(of) as upstream, httpx.AsyncClient(transport=FastTransport()) as client:
            response, chunks = await stream(client, upstream.url)
        assert response.status_code == 200
        assert b"".join(chunks) == EVENT * 20 + b"data: [DONE]\n\n"
        assert len(chunks) > 20  # yielded per read, never held back for more
        assert all(chunks)

    asyncio.run(scenario())


def test_everything_that_arrives_in_one_read_is_yielded_at_once() -> None:
    """A whole answer (head, many events, the end) in one write comes out as one chunk, and the
    connection is reused for the next answer packed the same way."""

    def of(upstream: Upstream) -> Handler:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while True:
                await upstream.read_request(reader)
                writer.write(SSE_HEAD + chunked(*[EVENT] * 10, b"data: [DONE]\n\n"))
                await writer.drain()

        return handler

    async def scenario() -> None:
        async with serving(of) as upstream, httpx.AsyncClient(transport=FastTransport()) as client:
            for _ in range(3):
                _, chunks = await stream(client, upstream.url)
                assert chunks == [EVENT * 10 + b"data: [DONE]\n\n"]
            assert upstream.connections == 1

    asyncio.run(scenario())


def test_a_connection_the_upstream_closed_while_idle_is_replaced() -> None:
    def of(upstream: Upstream) -> Handler:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await upstream.read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await writer.drain()
            # then close: a keep-alive timeout on the upstream's side

        return handler

    async def scenario() -> None:
        async with serving(of) as upstream, httpx.AsyncClient(transport=FastTransport()) as client:
            for _ in range(3):
                assert (await client.post(upstream.url, content=b"{}")).text == "ok"
                await asyncio.sleep(0.05)
            assert upstream.connections == 3

    asyncio.run(scenario())


def test_connection_close_is_not_reused() -> None:
    def of(upstream: Upstream) -> Handler:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await upstream.read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok")
            await writer.drain()
            await reader.read()

        return handler

    async def scenario() -> None:
        transport = FastTransport()
        async with serving(of) as upstream, httpx.AsyncClient(transport=transport) as client:
            for _ in range(2):
                assert (await client.post(upstream.url, content=b"{}")).text == "ok"
                assert transport.open_connections == 0
            assert upstream.connections == 2

    asyncio.run(scenario())


# --- failures ---------------------------------------------------------------------------------------------
def test_refused_connection_is_a_connect_error() -> None:
    async def scenario() -> None:
        async with serving(answer_every_request(b"")) as upstream:
            url = upstream.url
        await asyncio.sleep(0.05)  # the server is closed: nothing listens on its port now
        transport = FastTransport()
        async with httpx.AsyncClient(transport=transport) as client:
            with pytest.raises(httpx.ConnectError):
                await client.post(url, content=b"{}")
        assert transport.open_connections == 0

    asyncio.run(scenario())


def test_connect_timeout_is_a_connect_timeout() -> None:
    async def scenario() -> None:
        transport = FastTransport()
        async with (
            serving(answer_every_request(b"")) as upstream,
            httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(5, connect=1e-9)) as client,
        ):
            with pytest.raises(httpx.ConnectTimeout):
                await client.post(upstream.url, content=b"{}")
        assert transport.open_connections == 0

    asyncio.run(scenario())


def silent(upstream: Upstream) -> Handler:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await upstream.read_request(reader)
        await reader.read()

    return handler


def test_no_answer_within_the_read_timeout_is_a_read_timeout() -> None:
    async def scenario() -> None:
        transport = FastTransport()
        # only the read is short: a connect on a busy machine can take over 0.2 s (a ConnectTimeout, not this)
        async with (
            serving(silent) as upstream,
            httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(0.2, connect=10.0)) as client,
        ):
            with pytest.raises(httpx.ReadTimeout):
                await client.post(upstream.url, content=b"{}")
            assert transport.open_connections == 0

    asyncio.run(scenario())


def test_silence_between_reads_is_a_read_timeout() -> None:
    def of(upstream: Upstream) -> Handler:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await upstream.read_request(reader)
            writer.write(SSE_HEAD + b"%x\r\n%s\r\n" % (len(EVENT), EVENT))
            await writer.drain()
            await reader.read()

        return handler

    async def scenario() -> None:
        transport = FastTransport()
        # only the read is short: a connect on a busy machine once took over 0.2 s (a ConnectTimeout, not this)
        timeout = httpx.Timeout(0.2, connect=10.0)
        async with serving(of) as upstream, httpx.AsyncClient(transport=transport, timeout=timeout) as client:
            async with client.stream("POST", upstream.url, content=b"{}") as response:
                chunks = []
                with pytest.raises(httpx.ReadTimeout):
                    async for chunk in response.aiter_raw():
                        chunks.append(chunk)
                assert chunks == [EVENT]
            assert transport.open_connections == 0

    asyncio.run(scenario())


def closes_after(raw: bytes) -> Callable[[Upstream], Handler]:
    def of(upstream: Upstream) -> Handler:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await upstream.read_request(reader)
            writer.write(raw)
            await writer.drain()

        return handler

    return of


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(SSE_HEAD + b"%x\r\n%s\r\n" % (len(EVENT), EVENT), id="chunked"),
        pytest.param(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly a part", id="content-length"),
    ],
)
def test_peer_closing_mid_body_is_a_remote_protocol_error(raw: bytes) -> None:
    async def scenario() -> None:
        transport = FastTransport()
        async with serving(closes_after(raw)) as upstream, httpx.AsyncClient(transport=transport) as client:
            async with client.stream("POST", upstream.url, content=b"{}") as response:
                with pytest.raises(httpx.RemoteProtocolError, match="complete message body"):
                    await collect(response)
            assert transport.open_connections == 0

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        pytest.param(b"", "without sending a response", id="closed-before-answering"),
        pytest.param(b"HTTP/1.1 200 OK\r\ncontent-le", "without sending a response", id="closed-in-the-head"),
        pytest.param(b"SMTP ready\r\n\r\n", "malformed", id="garbage"),
        pytest.param(b"HTTP/1.1 200 OK\r\ncontent-length: x\r\n\r\n", "malformed", id="bad-length"),
    ],
)
def test_no_valid_answer_is_a_remote_protocol_error(raw: bytes, message: str) -> None:
    async def scenario() -> None:
        transport = FastTransport()
        async with serving(closes_after(raw)) as upstream, httpx.AsyncClient(transport=transport) as client:
            with pytest.raises(httpx.RemoteProtocolError, match=message):
                await client.post(upstream.url, content=b"{}")
            assert transport.open_connections == 0

    asyncio.run(scenario())


def test_a_body_that_runs_to_the_close_ends_cleanly() -> None:
    raw = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nall of it"

    async def scenario() -> None:
        transport = FastTransport()
        async with serving(closes_after(raw)) as upstream, httpx.AsyncClient(transport=transport) as client:
            response = await client.post(upstream.url, content=b"{}")
            assert response.text == "all of it"
            assert transport.open_connections == 0

    asyncio.run(scenario())


# --- cancellation and the pool bound ----------------------------------------------------------------------
def test_a_cancelled_read_closes_its_connection() -> None:
    def of(upstream: Upstream) -> Handler:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await upstream.read_request(reader)
            writer.write(SSE_HEAD + b"%x\r\n%s\r\n" % (len(EVENT), EVENT))
            await writer.drain()
            await reader.read()  # the rest never comes; returns when the client closes
            upstream.closed_by_peer.set()

        return handler

    async def scenario() -> None:
        transport = FastTransport()
        async with serving(of) as upstream, httpx.AsyncClient(transport=transport) as client:
            first_chunk = asyncio.Event()

            async def relay() -> None:
                async with client.stream("POST", upstream.url, content=b"{}") as response:
                    async for _ in response.aiter_raw():
                        first_chunk.set()

            task = asyncio.create_task(relay())
            await asyncio.wait_for(first_chunk.wait(), 5)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.wait_for(upstream.closed_by_peer.wait(), 5)
            assert transport.open_connections == 0

    asyncio.run(scenario())


def test_open_connections_stay_within_the_bound() -> None:
    release = asyncio.Event()

    def of(upstream: Upstream) -> Handler:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while True:
                await upstream.read_request(reader)
                await release.wait()
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                await writer.drain()

        return handler

    async def scenario() -> None:
        transport = FastTransport(max_connections=2)
        async with serving(of) as upstream, httpx.AsyncClient(transport=transport) as client:
            requests = [asyncio.create_task(client.post(upstream.url, content=b"{}")) for _ in range(5)]
            # until two requests are in and the other three wait for room in the pool (or, were the bound
            # broken, a third connection opened)
            await until(
                lambda: (
                    (len(upstream.heads) == 2 and len(transport._waiters) == 3) or upstream.connections > 2
                )
            )
            assert upstream.open_now == 2  # the other three wait for a connection
            release.set()
            answers = await asyncio.gather(*requests)
        assert [answer.text for answer in answers] == ["ok"] * 5
        assert upstream.most_open == 2
        assert upstream.connections == 2

    asyncio.run(scenario())


def test_waiting_longer_than_the_pool_timeout_is_a_pool_timeout() -> None:
    async def scenario() -> None:
        transport = FastTransport(max_connections=1)
        async with (
            serving(silent) as upstream,
            httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(5, pool=0.1)) as client,
        ):
            holder = asyncio.create_task(client.post(upstream.url, content=b"{}"))
            await until(lambda: len(upstream.heads) == 1)  # the holder has the one connection
            with pytest.raises(httpx.PoolTimeout):
                await client.post(upstream.url, content=b"{}")
            holder.cancel()
            with pytest.raises(asyncio.CancelledError):
                await holder
            assert transport.open_connections == 0

    asyncio.run(scenario())


def test_a_bound_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        FastTransport(max_connections=0)
