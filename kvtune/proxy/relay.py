"""One forwarded exchange as an ASGI response: send the request upstream, relay the answer as it arrives.

The upstream's bytes pass through untouched, chunk by chunk as they arrive (`aiter_raw`: no decoding, no
re-framing, nothing buffered), so a streamed answer reaches the client with the same events at the same
pace. Around that:
- the client hanging up at any point (while the upstream thinks, or mid-stream) cancels the exchange and
  closes the upstream connection, which is how vLLM, SGLang and kvtune serve learn to abort the request;
- an upstream that cannot be reached or does not answer in time gets a 502/504 JSON error naming it;
- an event stream the upstream breaks off (closed, timed out, or ended without `data: [DONE]`) is ended
  by the proxy with an error event and `[DONE]`, so a client never waits on a stream that will not end;
- the request is counted once, as completed or failed, when the exchange ends.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import anyio
import httpx
from fastapi.responses import JSONResponse
from starlette.types import Receive, Scope, Send

from kvtune.engine_sidecar.api_errors import error_body
from kvtune.proxy.accounting import RequestRecord
from kvtune.proxy.upstream import Upstream, UpstreamAnswer, UpstreamError, describe_transport_error

STREAM_END = b"data: [DONE]\n\n"
EVENT_END = b"\n\n"


def error_event(err: UpstreamError) -> bytes:
    """The SSE event that tells a streaming client what went wrong (the body OpenAI's errors have)."""
    return f"data: {json.dumps(error_body(err.status, err.message))}\n\n".encode()


class Forward:
    """The ASGI response for one request the proxy forwards (see the module docstring)."""

    def __init__(
        self,
        upstream: Upstream,
        method: str,
        path: str,
        headers: list[tuple[str, str]],
        record: RequestRecord,
        content: bytes | None = None,
        extra_headers: list[tuple[str, str]] | None = None,
        on_sent: Callable[[], object] | None = None,
    ) -> None:
        self.upstream = upstream
        self.method = method
        self.path = path
        self.headers = headers
        self.record = record
        self.content = content
        self.extra_headers = extra_headers or []
        self.on_sent = on_sent
        self.upstream_error: str | None = None  # the kind, when the upstream is why the request failed
        self.completed = False
        self.response_started = False  # once True, an error can no longer be answered with a status

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        answer: UpstreamAnswer | None = None
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(_cancel_on_disconnect, receive, group.cancel_scope)
                try:
                    answer = await self.upstream.open(
                        self.method, self.path, self.headers, self.content, self.on_sent
                    )
                except UpstreamError as err:
                    self.upstream_error = err.kind
                    self.response_started = True
                    await _send_quietly(
                        JSONResponse(error_body(err.status, err.message), err.status), scope, receive, send
                    )
                else:
                    await self._relay(answer, send)
                group.cancel_scope.cancel()
        finally:
            # Counted before the upstream connection closes, so whoever sees the upstream's abort sees
            # the proxy's count too.
            self.record.finish("completed" if self.completed else "failed", self.upstream_error)
            if answer is not None:
                with anyio.CancelScope(shield=True):
                    await answer.response.aclose()

    async def _relay(self, answer: UpstreamAnswer, send: Send) -> None:
        status = answer.status
        if status >= 400:
            self.upstream_error = "http_status"
        watch_stream_end = answer.is_event_stream and status < 400
        headers = [(name.encode("latin-1"), value.encode("latin-1")) for name, value in answer.headers()]
        headers += [(name.encode("latin-1"), value.encode("latin-1")) for name, value in self.extra_headers]
        tail = b""
        self.response_started = True
        try:
            await send({"type": "http.response.start", "status": status, "headers": headers})
            broken: UpstreamError | None = None
            try:
                async for chunk in answer.response.aiter_raw():
                    self.record.first_byte()
                    if watch_stream_end:
                        tail = (tail + chunk[-len(STREAM_END) :])[-len(STREAM_END) :]
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except httpx.TransportError as err:
                broken = describe_transport_error(
                    self.upstream.base_url, err, self.upstream.timeout_s, mid_stream=True
                )
            if broken is None and watch_stream_end and tail != STREAM_END:
                broken = UpstreamError(
                    502,
                    "closed_mid_stream",
                    f"the upstream {self.upstream.base_url} ended the stream without `data: [DONE]`",
                )
            if broken is not None:
                self.upstream_error = broken.kind
                if not answer.is_event_stream:
                    return  # a plain body cannot carry the error: leaving it unfinished drops the connection
                separator = b"" if tail.endswith(EVENT_END) or not tail else EVENT_END
                closing = separator + error_event(broken) + STREAM_END
                await send({"type": "http.response.body", "body": closing, "more_body": False})
                return
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            self.completed = status < 400
        except OSError:
            return  # the client went away while we wrote to it (ASGI 2.4 servers raise on send)


async def _cancel_on_disconnect(receive: Receive, scope: anyio.CancelScope) -> None:
    """Cancel the exchange when the client disconnects (the request body has already been read)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


async def _send_quietly(response: JSONResponse, scope: Scope, receive: Receive, send: Send) -> None:
    try:
        await response(scope, receive, send)
    except OSError:
        return
