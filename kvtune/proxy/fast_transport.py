"""An httpx transport for the proxy's hot path: HTTP/1.1 over asyncio streams, parsed by httptools (C).

httpx's default transport (httpcore + h11) spends most of the proxy's CPU per request and per streamed
event in pure Python; this one keeps httpx's API (the client, its Request and Response, its exception
types) and replaces only the wire work:
- one keep-alive pool, bounded in connections, TCP_NODELAY, the request head and body in one `write`;
- the answer's status and headers parsed by httptools; its body yielded once per socket read, holding
  everything that read decoded (chunked framing removed), never waiting for more;
- a connection goes back to the pool only when its answer was read to the end and keep-alive holds, so a
  cancelled or broken exchange never leaves a half-read connection for the next request;
- failures as httpx's own exceptions (ConnectError, ConnectTimeout, ReadTimeout, RemoteProtocolError, ...),
  so whoever uses the client handles them as before.

`request.extensions[ON_WRITTEN]`, when set (not None), is called once the request has been handed to the
socket: work started there overlaps the upstream's and never delays the request.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections import deque
from collections.abc import AsyncIterator, Callable

import httptools
import httpx

ON_WRITTEN = "kvtune.on_written"
READ_SIZE = 65536
Origin = tuple[str, str, int]


class _Message:
    """httptools' callbacks for one response: what the parser has decoded so far."""

    __slots__ = (
        "chunks", "complete", "framed", "headers", "headers_done", "keep_alive", "messages", "parser", "reason",
        "status",
    )  # fmt: skip

    def __init__(self) -> None:
        self.headers: list[tuple[bytes, bytes]] = []
        self.reason = b""
        self.headers_done = False
        self.chunks: list[bytes] = []
        self.complete = False
        self.framed = False  # Content-Length or chunked: otherwise the body ends when the peer closes
        self.messages = 0  # more than one: the peer sent bytes nobody asked for, it is out of step
        self.status = 0
        self.keep_alive = False
        # Asked for the status and keep-alive when the headers are in (the parser forgets them once the body
        # ends), then dropped, so parser and message do not keep each other alive.
        self.parser: httptools.HttpResponseParser | None = httptools.HttpResponseParser(self)

    def on_message_begin(self) -> None:
        self.messages += 1

    def on_status(self, status: bytes) -> None:
        self.reason += status

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))
        lowered = name.lower()
        if lowered == b"content-length" or (lowered == b"transfer-encoding" and b"chunked" in value.lower()):
            self.framed = True

    def on_headers_complete(self) -> None:
        self.headers_done = True
        if self.parser is not None:
            self.status = self.parser.get_status_code()
            self.keep_alive = self.parser.should_keep_alive()
            self.parser = None

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)

    def on_message_complete(self) -> None:
        self.complete = True

    def take_body(self) -> bytes:
        body = self.chunks[0] if len(self.chunks) == 1 else b"".join(self.chunks)
        self.chunks.clear()
        return body


class _Connection:
    __slots__ = ("origin", "reader", "writer")

    def __init__(self, origin: Origin, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.origin = origin
        self.reader = reader
        self.writer = writer

    def is_idle_and_open(self) -> bool:
        """Still usable: the peer has not closed it (nor broken it) while it sat idle."""
        return not self.writer.is_closing() and not self.reader.at_eof() and self.reader.exception() is None

    def close(self) -> None:
        self.writer.close()


class _Exchange:
    """One request on one connection: reads the answer with the read timeout and feeds the parser."""

    __slots__ = ("connection", "message", "parser", "read_timeout", "received", "request")

    def __init__(self, connection: _Connection, request: httpx.Request, read_timeout: float | None) -> None:
        self.connection = connection
        self.request = request
        self.message = _Message()
        assert self.message.parser is not None
        self.parser = self.message.parser
        self.read_timeout = read_timeout
        self.received = False

    async def read_head(self) -> None:
        """Read until the status line and headers are in (some of the body may have come with them)."""
        while not self.message.headers_done:
            if not await self.read_once():
                self.ended_by_close()

    async def read_once(self) -> bool:
        """Read what the socket has and parse it; False when the peer closed the connection."""
        try:
            async with asyncio.timeout(self.read_timeout):
                data = await self.connection.reader.read(READ_SIZE)
        except TimeoutError:
            raise httpx.ReadTimeout(
                f"no data from the upstream within {self.read_timeout:g} s", request=self.request
            ) from None
        except OSError as err:
            raise httpx.ReadError(str(err) or type(err).__name__, request=self.request) from err
        if not data:
            return False
        self.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as err:
            raise httpx.RemoteProtocolError(
                f"the upstream sent a malformed HTTP response: {err}", request=self.request
            ) from err
        return True

    def ended_by_close(self) -> None:
        """The peer closed: the end of a body that runs to the close, else an error."""
        message = self.message
        if not message.headers_done:
            raise httpx.RemoteProtocolError(
                "the server disconnected without sending a response", request=self.request
            )
        if message.framed:
            raise httpx.RemoteProtocolError(
                "the peer closed the connection without sending the complete message body",
                request=self.request,
            )
        message.complete = True

    def reusable(self) -> bool:
        message = self.message
        return message.complete and message.keep_alive and message.messages == 1


class _ResponseBody(httpx.AsyncByteStream):
    """The answer's body as it arrives; hands the connection back to the pool, or closes it, when done."""

    def __init__(self, pool: FastTransport, exchange: _Exchange) -> None:
        self.pool = pool
        self.exchange = exchange
        self.released = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        exchange = self.exchange
        message = exchange.message
        if message.chunks:
            yield message.take_body()
        while not message.complete:
            if not await exchange.read_once():
                exchange.ended_by_close()
            if message.chunks:
                yield message.take_body()
        self._release()

    async def aclose(self) -> None:
        self._release()

    def _release(self) -> None:
        if not self.released:
            self.released = True
            self.pool.release(self.exchange.connection, self.exchange.reusable())


def _timeouts(request: httpx.Request) -> dict[str, float | None]:
    timeouts: dict[str, float | None] = request.extensions.get("timeout", {})
    return timeouts


async def _encode(request: httpx.Request) -> bytes:
    """The request head and body as one buffer (a streamed body is read first: the proxy's are small)."""
    body = await request.aread()
    lines = [request.method.encode("ascii"), b" ", request.url.raw_path, b" HTTP/1.1\r\n"]
    chunked = False
    for name, value in request.headers.raw:
        lines += (name, b": ", value, b"\r\n")
        chunked = chunked or (name.lower() == b"transfer-encoding" and value.lower() == b"chunked")
    lines.append(b"\r\n")
    if chunked:
        lines += (b"%x\r\n" % len(body), body, b"\r\n0\r\n\r\n") if body else (b"0\r\n\r\n",)
    else:
        lines.append(body)
    return b"".join(lines)


class FastTransport(httpx.AsyncBaseTransport):
    """Keep-alive HTTP/1.1 to any number of origins, at most `max_connections` open at once."""

    def __init__(self, max_connections: int = 1024, ssl_context: ssl.SSLContext | None = None) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {max_connections}")
        self.max_connections = max_connections
        self.ssl_context = ssl_context
        self.open_connections = 0
        self._idle: dict[Origin, list[_Connection]] = {}
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._closed = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        timeouts = _timeouts(request)
        wire = await _encode(request)
        on_written: Callable[[], object] | None = request.extensions.get(ON_WRITTEN)
        fresh = False
        while True:
            connection, reused = await self._acquire(request, timeouts, fresh)
            exchange = _Exchange(connection, request, timeouts.get("read"))
            try:
                if connection.writer.is_closing():
                    raise ConnectionResetError("the connection was closed")
                connection.writer.write(wire)
                if on_written is not None:
                    on_written()
                    on_written = None
                await exchange.read_head()
            except (ConnectionError, httpx.RemoteProtocolError, httpx.ReadError) as err:
                self.release(connection, reusable=False)
                if reused and not exchange.received:
                    fresh = True  # a kept-alive connection the peer had closed: once more on a new one
                    continue
                if isinstance(err, ConnectionError):
                    raise httpx.WriteError(str(err) or type(err).__name__, request=request) from err
                raise
            except BaseException:
                self.release(connection, reusable=False)
                raise
            break
        message = exchange.message
        if request.method == "HEAD":
            message.complete = True
        return httpx.Response(
            message.status,
            headers=message.headers,
            stream=_ResponseBody(self, exchange),
            extensions={"http_version": b"HTTP/1.1", "reason_phrase": message.reason},
        )

    async def _acquire(
        self, request: httpx.Request, timeouts: dict[str, float | None], fresh: bool = False
    ) -> tuple[_Connection, bool]:
        """(connection, reused): an idle one to the request's origin, else a new one within the bound."""
        url = request.url
        scheme = url.scheme
        origin = (scheme, url.host, url.port or (443 if scheme == "https" else 80))
        pool_timeout = timeouts.get("pool")
        deadline = None if pool_timeout is None else asyncio.get_running_loop().time() + pool_timeout
        while True:
            if self._closed:
                raise httpx.ConnectError("the transport is closed", request=request)
            idle = self._idle.get(origin)
            while idle and not fresh:
                connection = idle.pop()
                if connection.is_idle_and_open():
                    return connection, True
                self._forget(connection)
            if self.open_connections < self.max_connections:
                break
            if not self._close_one_idle():
                await self._wait_for_room(deadline, request)
        self.open_connections += 1
        try:
            return await self._connect(origin, request, timeouts.get("connect")), False
        except BaseException:
            self.open_connections -= 1
            self._wake_one()
            raise

    async def _wait_for_room(self, deadline: float | None, request: httpx.Request) -> None:
        """Wait until a connection is released or closed (PoolTimeout at `deadline`)."""
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout_at(deadline):
                await waiter
        except BaseException as err:
            if not waiter.done():
                waiter.cancel()
            elif not waiter.cancelled():
                self._wake_one()  # woken, but leaving without the room: pass it on to the next waiter
            if isinstance(err, TimeoutError):
                raise httpx.PoolTimeout(
                    f"all {self.max_connections} upstream connections stayed busy", request=request
                ) from None
            raise

    async def _connect(self, origin: Origin, request: httpx.Request, timeout: float | None) -> _Connection:
        scheme, host, port = origin
        tls: ssl.SSLContext | None = None
        if scheme == "https":
            tls = self.ssl_context or ssl.create_default_context()
        try:
            async with asyncio.timeout(timeout):
                reader, writer = await asyncio.open_connection(
                    host, port, ssl=tls, limit=READ_SIZE, server_hostname=host if tls else None
                )
        except TimeoutError:
            raise httpx.ConnectTimeout(
                f"no connection to {host}:{port} within {timeout:g} s", request=request
            ) from None
        except OSError as err:
            raise httpx.ConnectError(str(err) or type(err).__name__, request=request) from err
        sock = writer.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return _Connection(origin, reader, writer)

    def release(self, connection: _Connection, reusable: bool) -> None:
        """Back to the pool when its last answer was read whole and keep-alive holds; closed otherwise."""
        if reusable and not self._closed:
            self._idle.setdefault(connection.origin, []).append(connection)
        else:
            self._forget(connection)
        self._wake_one()

    def _forget(self, connection: _Connection) -> None:
        connection.close()
        self.open_connections -= 1

    def _close_one_idle(self) -> bool:
        """Make room under the bound by closing an idle connection to another origin."""
        for idle in self._idle.values():
            if idle:
                self._forget(idle.pop(0))
                return True
        return False

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def aclose(self) -> None:
        self._closed = True
        for idle in self._idle.values():
            for connection in idle:
                self._forget(connection)
            idle.clear()
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._waiters.clear()
