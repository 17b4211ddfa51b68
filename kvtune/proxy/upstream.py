"""The connection to the upstream engine (vLLM, SGLang, or a kvtune serve): one keep-alive httpx client,
bounded connect and read timeouts, and every transport failure turned into a clear 502 or 504.

Nothing here buffers an answer: `open` returns as soon as the upstream's status line and headers arrive,
and the body is read by whoever relays it. Headers pass through both ways except the hop-by-hop ones,
which describe one connection and not the message.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import httpx

from kvtune.proxy.fast_transport import ON_WRITTEN, FastTransport

# RFC 9110 section 7.6.1, plus host, which names the proxy and not the upstream.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
    }
)
HOP_BY_HOP_RAW = frozenset(name.encode("latin-1") for name in HOP_BY_HOP)
# Connect fast or not at all: a down upstream must not hold a client for the whole read timeout.
MAX_CONNECT_TIMEOUT_S = 10.0
HEALTH_TIMEOUT_S = 5.0


class UpstreamError(Exception):
    """The upstream could not be reached or did not answer in time: `status` 502 or 504, `kind` the label
    of kvtune:proxy_upstream_errors_total."""

    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.message = message


def describe_transport_error(
    upstream: str, err: httpx.TransportError, timeout_s: float, mid_stream: bool = False
) -> UpstreamError:
    """The 502/504 a client gets for `err`, naming the upstream; `mid_stream`: the answer had begun."""
    reason = str(err) or type(err).__name__
    if isinstance(err, httpx.ConnectTimeout):
        return UpstreamError(504, "timeout", f"the upstream {upstream} did not accept a connection in time")
    if isinstance(err, httpx.TimeoutException):
        return UpstreamError(504, "timeout", f"the upstream {upstream} did not answer within {timeout_s:g} s")
    if mid_stream:
        return UpstreamError(
            502, "closed_mid_stream", f"the upstream {upstream} closed the stream before it ended: {reason}"
        )
    if isinstance(err, httpx.ConnectError):
        return UpstreamError(502, "connect", f"the upstream {upstream} is unreachable: {reason}")
    return UpstreamError(
        502, "connect", f"the upstream {upstream} closed the connection without answering: {reason}"
    )


def forwardable(headers: Iterable[tuple[str, str]], keep_length: bool = True) -> list[tuple[str, str]]:
    """The end-to-end headers of a message (hop-by-hop ones dropped), in order, duplicates kept; without
    `keep_length` also Content-Length, for a body the proxy may have rewritten (the transport sets it)."""
    dropped = HOP_BY_HOP if keep_length else HOP_BY_HOP | {"content-length"}
    return [(name, value) for name, value in headers if name.lower() not in dropped]


@dataclass
class UpstreamAnswer:
    """An upstream response whose body has not been read yet."""

    response: httpx.Response

    @property
    def status(self) -> int:
        return self.response.status_code

    @functools.cached_property
    def is_event_stream(self) -> bool:
        return str(self.response.headers.get("content-type", "")).startswith("text/event-stream")

    def headers(self) -> list[tuple[bytes, bytes]]:
        """The answer's end-to-end headers as they came (bytes, for the ASGI response start)."""
        return [
            (name, value) for name, value in self.response.headers.raw if name.lower() not in HOP_BY_HOP_RAW
        ]


class Upstream:
    """One upstream base URL and the keep-alive connection pool that talks to it.

    Forwarded requests go straight to the transport as httpx Requests: the client's own layers (URL
    merging, auth, redirects, a cookie jar) cost CPU on every request, and a cookie jar is wrong in a
    proxy, where one client's cookies must never ride on another's request. The client serves /health.
    """

    def __init__(self, base_url: str, timeout_s: float, max_connections: int = 1024) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        timeout = httpx.Timeout(timeout_s, connect=min(timeout_s, MAX_CONNECT_TIMEOUT_S))
        self.transport = FastTransport(max_connections)
        # Not httpx's default Accept-Encoding, which would ask for a compression the client never asked
        # for: the client's headers go through as they are.
        self.client = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=timeout,
            transport=self.transport,
            headers={"accept-encoding": "identity"},
        )
        self._default_headers = list(self.client.headers.multi_items())
        self._timeouts = timeout.as_dict()
        self._urls: dict[str, httpx.URL] = {}

    def _url(self, path: str) -> httpx.URL:
        url = self._urls.get(path)
        if url is None:
            url = self._urls[path] = httpx.URL(self.base_url + path)
        return url

    async def open(
        self,
        method: str,
        path: str,
        headers: list[tuple[str, str]],
        content: bytes | None = None,
        on_sent: Callable[[], object] | None = None,
    ) -> UpstreamAnswer:
        """Send one request and return once the upstream's headers arrive; UpstreamError when it cannot.
        `on_sent` runs the moment the request's body has been written, before the upstream answers: work
        started there overlaps the upstream's and never delays the request."""
        sent = {name.lower() for name, _ in headers}
        defaults = [(name, value) for name, value in self._default_headers if name not in sent]
        request = httpx.Request(
            method,
            self._url(path),
            headers=defaults + headers,
            content=content,
            extensions={"timeout": self._timeouts, ON_WRITTEN: on_sent},
        )
        try:
            response = await self.transport.handle_async_request(request)
        except httpx.TransportError as err:
            raise describe_transport_error(self.base_url, err, self.timeout_s) from None
        response.request = request
        return UpstreamAnswer(response)

    async def health(self) -> int | UpstreamError:
        """The upstream's /health status code, or why it could not be asked (a short timeout: a probe
        must answer well within a kubelet's)."""
        timeout_s = min(self.timeout_s, HEALTH_TIMEOUT_S)
        try:
            response = await self.client.get("/health", timeout=timeout_s)
        except httpx.TransportError as err:
            return describe_transport_error(self.base_url, err, timeout_s)
        return response.status_code

    async def aclose(self) -> None:
        await self.client.aclose()
