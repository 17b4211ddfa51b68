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

import asyncio
import json
from collections.abc import Callable

import httpx
from fastapi.responses import JSONResponse
from starlette.types import Receive, Scope, Send

from kvtune.front.errors import error_body
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
        observe: Callable[[], object] | None = None,
    ) -> None:
        self.upstream = upstream
        self.method = method
        self.path = path
        self.headers = headers
        self.record = record
        self.content = content
        self.extra_headers = extra_headers or []
        self.observe = observe
        self.written = False  # the request reached the upstream's socket
        self.upstream_error: str | None = None  # the kind, when the upstream is why the request failed
        self.completed = False
        self.response_started = False  # once True, an error can no longer be answered with a status

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        answer: UpstreamAnswer | None = None
        # A watcher task cancels this one when the client hangs up (plain asyncio: an anyio task group and
        # cancel scope cost more CPU per request than the rest of the exchange's bookkeeping).
        task = asyncio.current_task()
        assert task is not None
        watcher = asyncio.get_running_loop().create_task(_wait_for_disconnect(receive))
        gone = False

        def on_disconnect(done: asyncio.Task[None]) -> None:
            nonlocal gone
            if not done.cancelled() and done.exception() is None:
                gone = True
                task.cancel()

        watcher.add_done_callback(on_disconnect)
        try:
            try:
                answer = await self.upstream.open(
                    self.method, self.path, self.headers, self.content, self._on_written
                )
            except UpstreamError as err:
                self.upstream_error = err.kind
                self.response_started = True
                await _send_quietly(
                    JSONResponse(error_body(err.status, err.message), err.status), scope, receive, send
                )
            else:
                await self._relay(answer, send)
        except asyncio.CancelledError:
            # The cancel was ours: the client is gone and the exchange ends here; any other cancel goes on.
            if not gone or task.uncancel() > 0:
                raise
        finally:
            watcher.remove_done_callback(on_disconnect)
            watcher.cancel()
            # Counted before the upstream connection closes, so whoever sees the upstream's abort sees
            # the proxy's count too. Closing never waits (the transport closes or pools at once), so no
            # cancellation can cut it short.
            self.record.finish("completed" if self.completed else "failed", self.upstream_error)
            if answer is not None:
                await answer.response.aclose()
            if self.written:
                self._observe_once()

    def _on_written(self) -> None:
        self.written = True

    def _observe_once(self) -> None:
        """Hand the request to `observe`, once: after the answer's first byte was relayed, or when an
        exchange without one ends, so its work never competes with the upstream before the first token."""
        observe, self.observe = self.observe, None
        if observe is not None:
            observe()

    async def _relay(self, answer: UpstreamAnswer, send: Send) -> None:
        status = answer.status
        if status >= 400:
            self.upstream_error = "http_status"
        watch_stream_end = answer.is_event_stream and status < 400
        headers = answer.headers()
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
                    if self.observe is not None:
                        self._observe_once()
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


async def _wait_for_disconnect(receive: Receive) -> None:
    """Return when the client disconnects (the request body has already been read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _send_quietly(response: JSONResponse, scope: Scope, receive: Receive, send: Send) -> None:
    try:
        await response(scope, receive, send)
    except OSError:
        return
