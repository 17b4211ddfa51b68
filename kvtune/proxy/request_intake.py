"""The proxy's request intake: a body read under the size limit and parsed once, with the engine's checks.

The engine checks the size in an ASGI middleware, which answers before any route runs; the proxy reads the
body inside its routes instead, so every refused request is still counted once in
`kvtune:proxy_requests_total` (as `rejected`). The parsing rules (strict UTF-8, depth, surrogates) are the
engine's own `parse_json`, so a body refused by one is refused by the other with the same message.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Request
from starlette.requests import ClientDisconnect
from starlette.types import Receive

from kvtune.front.body import (
    PARSE_IN_THREAD_ABOVE_BYTES,
    RequestBodyError,
    body_too_large,
    parse_json,
)


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The raw body of a routed request, or a 413 (see `read_asgi_body`)."""
    return await read_asgi_body(request.receive, request.headers.get("content-length"), max_bytes)


async def read_asgi_body(receive: Receive, declared: str | bytes | None, max_bytes: int) -> bytes:
    """The raw body, or a 413 as soon as it is known to pass `max_bytes` (a declared length is trusted
    first, so an oversized upload is refused before any of it is read); ClientDisconnect when the client
    leaves while uploading."""
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise body_too_large(max_bytes)
    chunks: list[bytes] = []
    received = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunk = message.get("body", b"")
        received += len(chunk)
        if received > max_bytes:
            raise body_too_large(max_bytes)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def parse_object(raw: bytes) -> dict[str, Any]:
    """`raw` as a JSON object (a large one parsed off the event loop), or a RequestBodyError (400)."""
    if len(raw) > PARSE_IN_THREAD_ABOVE_BYTES:
        data = await asyncio.to_thread(parse_json, raw)
    else:
        data = parse_json(raw)
    if not isinstance(data, dict):
        raise RequestBodyError(400, "the request body must be a JSON object")
    return data
