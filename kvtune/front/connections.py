"""The connection layer both HTTP fronts (the engine and the proxy) run on: uvicorn's httptools protocol,
with two deadlines and HTTP/1.0 framing it lacks.

- Idle deadline: a connection with no request in progress (a fresh one that says nothing, or a keep-alive
  one between requests) is closed after `idle_timeout_s`. uvicorn arms its keep-alive timeout only after a
  response, and any byte cancels it, so a silent fresh connection was held for ever: a thousand of them
  would take a container's whole file-descriptor budget.
- Header deadline: once a request's first byte arrives, its headers must be complete within
  `header_timeout_s`, or the client gets a 408 and the connection is closed (a slowloris client trickling
  a byte at a time was still answered 22 s later).
- HTTP/1.0: an HTTP/1.0 client cannot read chunked framing (RFC 9112 §6.1 forbids sending it
  Transfer-Encoding), so an answer of unknown length (a stream) is close-delimited instead: no
  Transfer-Encoding, `Connection: close`, the body ends when the connection does.

A request in progress (a body being uploaded, a stream being answered) has no deadline here: the engine's
and the proxy's own timeouts and the client's hang-up govern it.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_IDLE_TIMEOUT_S = 5.0  # uvicorn's own keep-alive default, now also for a fresh connection
TIMEOUT_BODY = b"the request's headers did not arrive in time"
REQUEST_TIMEOUT = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"content-length: " + str(len(TIMEOUT_BODY)).encode() + b"\r\nconnection: close\r\n\r\n" + TIMEOUT_BODY
)
UNFRAMED_STATUSES = (204, 304)  # answers that have no body, so no framing either


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with an idle and a header deadline, and close-delimited streams for
    HTTP/1.0 clients. `guarded_protocol` makes one with the deadlines set."""

    header_timeout_s = DEFAULT_HEADER_TIMEOUT_S
    idle_timeout_s = DEFAULT_IDLE_TIMEOUT_S

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None

    def _arm(self, seconds: float, expired: Any) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _between_requests(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(self.idle_timeout_s, self._idle_expired)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._between_requests():  # a pipelined request waits its turn under the idle deadline
            self._arm(self.header_timeout_s, self._headers_expired)

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle.scope is self.scope and self.scope.get("http_version") == "1.0":
            close_delimited_for_http10(cycle)

    def on_response_complete(self) -> None:
        pipelined = bool(self.pipeline)
        super().on_response_complete()
        if not pipelined and not self.transport.is_closing():
            self._arm(self.idle_timeout_s, self._idle_expired)

    def _idle_expired(self) -> None:
        self._deadline = None
        if self._between_requests() and not self.transport.is_closing():
            self.transport.close()

    def _headers_expired(self) -> None:
        self._deadline = None
        if self._between_requests() and not self.transport.is_closing():
            self.transport.write(REQUEST_TIMEOUT)
            self.transport.close()


def guarded_protocol(header_timeout_s: float, idle_timeout_s: float) -> type[GuardedHttpProtocol]:
    """The protocol class to give uvicorn (`uvicorn.Config(http=...)`) with these deadlines."""
    return type(
        "GuardedHttpProtocol",
        (GuardedHttpProtocol,),
        {"header_timeout_s": header_timeout_s, "idle_timeout_s": idle_timeout_s},
    )


def _has_length(headers: list[tuple[bytes, bytes]]) -> bool:
    return any(name.lower() == b"content-length" for name, _ in headers)


def close_delimited_for_http10(cycle: RequestResponseCycle) -> None:
    """Answer an HTTP/1.0 request whose response has no Content-Length with a body that ends when the
    connection closes, instead of uvicorn's chunked framing."""
    send = cycle.send
    delimited = False

    async def framed(message: Any) -> None:
        nonlocal delimited
        if message["type"] == "http.response.start" and not cycle.response_started:
            headers = list(message.get("headers", []))
            status = message["status"]
            if (
                not _has_length(headers)
                and cycle.scope["method"] != "HEAD"
                and status not in UNFRAMED_STATUSES
            ):
                delimited = True
                cycle.keep_alive = False  # uvicorn then says `connection: close`
                cycle.chunked_encoding = False  # and adds no Transfer-Encoding
                headers = [(n, v) for n, v in headers if n.lower() != b"transfer-encoding"]
                message = {**message, "headers": headers}
            await send(message)
            return
        if not delimited or message["type"] != "http.response.body" or cycle.response_complete:
            await send(message)
            return
        if cycle.flow.write_paused and not cycle.disconnected:
            await cycle.flow.drain()
        if cycle.disconnected:
            return  # as uvicorn's own send: the client is gone, there is nobody to write to
        body = message.get("body", b"")
        if body:
            cycle.transport.write(body)
        if not message.get("more_body", False):
            cycle.response_complete = True
            cycle.message_event.set()
            cycle.transport.close()  # the end of the body
            cycle.on_response()

    cycle.send = framed  # type: ignore[method-assign]
