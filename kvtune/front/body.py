"""The server's door: request bodies are size-limited while they stream in, then read as strict UTF-8 JSON
with a bounded nesting depth and no unpaired surrogates. Whatever fails is a 4xx, never a 500.

A 500 from the error middleware also drops the keep-alive connection, so every check here raises
`RequestBodyError`, which the app turns into an OpenAI-style JSON answer on a connection that stays usable.
Parsing a large body runs in a worker thread so that it never stalls /health or other streams.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from fastapi import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvtune.front.errors import ApiError

# 4 MiB holds a 128k-token context three times over: as text (~4 characters a token, ~0.5 MB), as token
# ids (~0.9 MB) or as text a client escaped to \uXXXX for every non-ASCII character (~3 MB); a body larger
# than that is an accident or an attack, and each request's body is held in memory while it is parsed.
DEFAULT_MAX_REQUEST_BODY_BYTES = 4 * 1024 * 1024
# Real OpenAI requests nest a handful of levels (messages -> content parts -> text); 64 leaves room for
# tool schemas while staying far below the recursion limit of Python's json decoder.
MAX_JSON_DEPTH = 64
# Parsing a small body takes microseconds, less than a hop to a worker thread.
PARSE_IN_THREAD_ABOVE_BYTES = 64 * 1024

_SURROGATE = re.compile("[\ud800-\udfff]")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


class RequestBodyError(ApiError):
    """A body refused at the door, answered with `status` and an OpenAI-style error body."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(status, message, param)


def body_too_large(max_bytes: int) -> RequestBodyError:
    return RequestBodyError(413, f"the request body is larger than the server's limit of {max_bytes} bytes")


def _declared_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            return int(value)  # the HTTP parser has already refused a malformed Content-Length
    return None


class BodySizeLimit:
    """ASGI middleware: a 413 for a body over `max_bytes`, before any of it is buffered.

    A declared Content-Length over the limit is answered at once, without reading the body; a chunked body
    is counted as it arrives and refused the moment the count passes the limit. uvicorn discards the rest
    of the upload after the answer, so the keep-alive connection serves the client's next request.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _declared_length(scope)
        if declared is not None and declared > self.max_bytes:
            await body_too_large(self.max_bytes).response()(scope, receive, send)
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise body_too_large(self.max_bytes)
            return message

        await self.app(scope, counting_receive, send)


def _nested_deeper_than(data: Any, limit: int) -> bool:
    """Whether a parsed JSON value nests arrays/objects more than `limit` levels (walked level by level,
    without recursion)."""
    level = [data] if isinstance(data, dict | list) else []
    depth = 0
    while level:
        depth += 1
        if depth > limit:
            return True
        children: list[Any] = []
        for container in level:
            items = container.values() if isinstance(container, dict) else container
            children.extend(item for item in items if isinstance(item, dict | list))
        level = children
    return False


def _lone_surrogate_at(data: Any) -> str | None:
    """The dotted path of the first string (value or key) that holds an unpaired UTF-16 surrogate; a
    surrogate in the path itself is written as its escape, since an error body must be valid UTF-8."""
    pending: list[tuple[str, Any]] = [("", data)]
    while pending:
        path, value = pending.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                return path.encode("utf-8", "backslashreplace").decode() or "body"
        elif isinstance(value, dict):
            for key, item in value.items():
                item_path = f"{path}.{key}" if path else str(key)
                if _SURROGATE.search(key):
                    return item_path.encode("utf-8", "backslashreplace").decode()
                pending.append((item_path, item))
        elif isinstance(value, list):
            pending.extend(
                (f"{path}.{index}" if path else str(index), item)
                for index, item in enumerate(value)
                if isinstance(item, str | dict | list)
            )
    return None


def parse_json(raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """`raw` as a JSON value, or a RequestBodyError (400) naming what is wrong with it.

    Refused: bytes that are not UTF-8 (UTF-8-encoded surrogates included), malformed JSON, nesting deeper
    than `max_depth`, and `\\uD800`-style escapes that decode to an unpaired surrogate, which no UTF-8
    encoder (the tokenizer's included) accepts.
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise RequestBodyError(400, f"the request body is not valid UTF-8 (at byte {err.start})") from None
    too_deep = RequestBodyError(400, f"the request body nests JSON deeper than {max_depth} levels")
    try:
        data = json.loads(text)
    except RecursionError:  # the decoder's own guard, met long before a stack could overflow
        raise too_deep from None
    except ValueError as err:
        raise RequestBodyError(400, f"the request body is not valid JSON: {err}") from None
    could_nest = text.count("[") + text.count("{") > max_depth
    if could_nest and _nested_deeper_than(data, max_depth):
        raise too_deep
    # Strict decoding above leaves escapes as the only way a surrogate gets in.
    if _SURROGATE_ESCAPE.search(text):
        where = _lone_surrogate_at(data)
        if where is not None:
            raise RequestBodyError(
                400, f"{where}: the string holds an unpaired UTF-16 surrogate; send valid Unicode", where
            )
    return data


async def read_json(request: Request, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """The request's body as a JSON value (see `parse_json`); a large body is parsed off the event loop."""
    raw = await request.body()
    if len(raw) > PARSE_IN_THREAD_ABOVE_BYTES:
        return await asyncio.to_thread(parse_json, raw, max_depth)
    return parse_json(raw, max_depth)
