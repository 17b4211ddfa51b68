"""What both generate endpoints share on the way out: the server-sent events (one line each, whatever the
text holds), the per-choice texts gathered for a JSON answer, and the watch that aborts a request whose
client hung up before its answer was ready.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from kvtune.engine.http.protocol import Usage
from kvtune.engine.loop.output import RequestOutput
from kvtune.engine.model.logprobs import TokenLogprobs

T = TypeVar("T")
DONE = "data: [DONE]\n\n"


class ClientGoneError(Exception):
    """The client disconnected before its (non-streamed) answer was ready."""


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (and so aborting its engine request) if the client hangs up first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    raise ClientGoneError


# Every character str.splitlines() breaks on. Compact JSON has them only inside strings, where a \uXXXX
# escape means the same character, so escaping them keeps an event on one line for any client.
_LINE_BREAKS_ESCAPED = str.maketrans(
    {char: f"\\u{ord(char):04x}" for char in "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"}
)


def sse(payload: BaseModel | dict[str, Any]) -> str:
    """One server-sent event whose data cannot be cut in two by a client that splits on Unicode line
    breaks (U+0085, U+2028... are legal unescaped in JSON, and generated text holds them)."""
    body = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {body.translate(_LINE_BREAKS_ESCAPED)}\n\n"


@dataclass
class ChoiceTexts:
    """Per-choice text, finish reason and token counts gathered from the engine's outputs."""

    n: int
    texts: list[str] = field(default_factory=list)
    reasons: list[str | None] = field(default_factory=list)
    completion_tokens: list[int] = field(default_factory=list)
    logprobs: list[list[TokenLogprobs]] = field(default_factory=list)
    prompt_tokens: int = 0

    def __post_init__(self) -> None:
        self.texts = [""] * self.n
        self.reasons = [None] * self.n
        self.completion_tokens = [0] * self.n
        self.logprobs = [[] for _ in range(self.n)]

    def add(self, out: RequestOutput) -> None:
        self.texts[out.index] += out.new_text
        if out.logprobs is not None:
            self.logprobs[out.index].append(out.logprobs)
        self.completion_tokens[out.index] = out.num_output_tokens
        self.prompt_tokens = out.num_prompt_tokens
        if out.finished:
            self.reasons[out.index] = out.finish_reason

    def usage(self) -> Usage:
        return Usage.of(self.prompt_tokens, sum(self.completion_tokens))


def event_stream(events: AsyncIterator[str], headers: dict[str, str]) -> StreamingResponse:
    return StreamingResponse(
        events, media_type="text/event-stream", headers={"Cache-Control": "no-cache", **headers}
    )
