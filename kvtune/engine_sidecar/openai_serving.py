"""The two generate endpoints: OpenAI request in, engine request out, and back as JSON or server-sent events.

Everything a client can get wrong is checked before the request reaches the engine's queue or by the
engine's own `add_request` (a ValueError there becomes a 400), so a bad request never costs KV cache.
A client that goes away is noticed (the stream is cancelled, or the disconnect watcher fires for a plain
request) and its request aborted, which frees its blocks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from kvtune.engine_sidecar.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineOverloadedError,
    RequestFailedError,
    RequestStream,
)
from kvtune.engine_sidecar.engine import RequestOutput
from kvtune.engine_sidecar.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatResponseMessage,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    Usage,
    error_body,
)
from kvtune.errors import KvtuneError

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")


class ApiError(Exception):
    """An error the client caused or should hear about, sent as an OpenAI-style body."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def response(self) -> JSONResponse:
        body = error_body(self.status, self.message, self.param, self.code)
        return JSONResponse(body, self.status, headers=self.headers)


class ClientGoneError(Exception):
    """The client disconnected before its (non-streamed) answer was ready."""


def describe_validation_error(err: ValidationError) -> ApiError:
    """The first problem pydantic found, as a one-line 400 naming the field (OpenAI's `param`)."""
    first = err.errors()[0]
    param = ".".join(str(part) for part in first.get("loc", ())) or None
    return ApiError(400, f"{param}: {first.get('msg')}" if param else str(first.get("msg")), param)


async def parse_body(request: Request, model: type[M]) -> M:
    """The JSON body as `model`, or a 400 for malformed JSON or wrong types (never FastAPI's 422)."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as err:
        raise ApiError(400, f"the request body is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise describe_validation_error(err) from None


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


def _sse(payload: BaseModel | dict[str, Any]) -> str:
    body = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {body}\n\n"


@dataclass
class _Choices:
    """Per-choice text, finish reason and token counts gathered from the engine's outputs."""

    n: int
    texts: list[str] = field(default_factory=list)
    reasons: list[str | None] = field(default_factory=list)
    completion_tokens: list[int] = field(default_factory=list)
    prompt_tokens: int = 0

    def __post_init__(self) -> None:
        self.texts = [""] * self.n
        self.reasons = [None] * self.n
        self.completion_tokens = [0] * self.n

    def add(self, out: RequestOutput) -> None:
        self.texts[out.index] += out.new_text
        self.completion_tokens[out.index] = out.num_output_tokens
        self.prompt_tokens = out.num_prompt_tokens
        if out.finished:
            self.reasons[out.index] = out.finish_reason

    def usage(self) -> Usage:
        return Usage.of(self.prompt_tokens, sum(self.completion_tokens))


class OpenAIServing:
    """Handlers for /v1/completions and /v1/chat/completions over one AsyncEngine."""

    def __init__(self, async_engine: AsyncEngine) -> None:
        self.async_engine = async_engine
        engine = async_engine.engine
        self.model_name = engine.served_model_name
        self.max_model_len = engine.max_model_len
        self.tokenizer = engine.tokenizer

    # --- request checks --------------------------------------------------------------------------------
    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise ApiError(404, f"The model `{name}` does not exist.", "model", "model_not_found")

    def _completion_prompt(self, prompt: str | list[int] | list[str] | list[list[int]]) -> list[int]:
        """Token ids of a completion prompt: text, token ids, or a batch of exactly one of either."""
        single: str | list[int]
        if isinstance(prompt, str):
            single = prompt
        elif prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise ApiError(
                    400, "batched prompts are not supported; send one prompt per request", "prompt"
                )
            single = prompt[0]
        else:
            single = [t for t in prompt if isinstance(t, int)]
        if not single:
            raise ApiError(400, "the prompt is empty", "prompt")
        return self.tokenizer.encode(single) if isinstance(single, str) else list(single)

    def _max_tokens(self, requested: int | None, prompt_len: int) -> int:
        """An absent max_tokens means 'up to the context length', as in vLLM."""
        return requested if requested is not None else max(1, self.max_model_len - prompt_len)

    async def _start(self, prefix: str, prompt_ids: list[int], body: Any, max_tokens: int) -> RequestStream:
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        try:
            params = body.sampling_params(max_tokens)
            return await self.async_engine.add_request(request_id, prompt_ids, params)
        except (ValueError, KvtuneError) as err:
            raise ApiError(400, str(err)) from None
        except EngineOverloadedError as err:
            retry = {"Retry-After": str(err.retry_after)}
            raise ApiError(429, str(err), code="rate_limit_exceeded", headers=retry) from None
        except EngineDeadError as err:
            raise ApiError(503, str(err), code="server_overloaded") from None
        except Exception as err:  # a bug met while queueing: refuse this request, keep serving the rest
            logger.exception("the engine could not queue %s", request_id)
            raise ApiError(503, f"the engine could not accept this request: {err}") from None

    # --- /v1/completions --------------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        body = await parse_body(request, CompletionRequest)
        self._check_model(body.model)
        prompt_ids = self._completion_prompt(body.prompt)
        stream = await self._start(
            "cmpl", prompt_ids, body, self._max_tokens(body.max_tokens, len(prompt_ids))
        )
        request_id = stream.request_id
        if body.stream:
            return self._event_stream(self._completion_events(stream, body.include_usage))
        choices = await self._collect(request, stream, body.n)
        return JSONResponse(
            CompletionResponse(
                id=request_id,
                model=self.model_name,
                choices=[
                    CompletionChoice(index=i, text=choices.texts[i], finish_reason=choices.reasons[i])
                    for i in range(body.n)
                ],
                usage=choices.usage(),
            ).model_dump()
        )

    async def _completion_events(self, stream: RequestStream, include_usage: bool) -> AsyncIterator[str]:
        choices = _Choices(stream.choices)
        async with stream:
            try:
                async for outputs in stream:
                    for out in outputs:
                        choices.add(out)
                        choice = CompletionChoice(
                            index=out.index, text=out.new_text, finish_reason=out.finish_reason
                        )
                        yield _sse(
                            CompletionResponse(id=stream.request_id, model=self.model_name, choices=[choice])
                        )
            except RequestFailedError as err:
                yield _sse(error_body(err.status, str(err)))
                yield "data: [DONE]\n\n"
                return
        if include_usage:
            yield _sse(
                CompletionResponse(
                    id=stream.request_id, model=self.model_name, choices=[], usage=choices.usage()
                )
            )
        yield "data: [DONE]\n\n"

    # --- /v1/chat/completions ---------------------------------------------------------------------------
    async def chat_completions(self, request: Request) -> Response:
        body = await parse_body(request, ChatCompletionRequest)
        self._check_model(body.model)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            prompt_ids = self.tokenizer.encode_chat(messages, body.add_generation_prompt)
        except KvtuneError as err:
            raise ApiError(400, str(err), "messages") from None
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        stream = await self._start("chatcmpl", prompt_ids, body, self._max_tokens(requested, len(prompt_ids)))
        if body.stream:
            return self._event_stream(self._chat_events(stream, body.include_usage))
        choices = await self._collect(request, stream, body.n)
        return JSONResponse(
            ChatCompletionResponse(
                id=stream.request_id,
                model=self.model_name,
                choices=[
                    ChatChoice(
                        index=i,
                        message=ChatResponseMessage(content=choices.texts[i]),
                        finish_reason=choices.reasons[i],
                    )
                    for i in range(body.n)
                ],
                usage=choices.usage(),
            ).model_dump()
        )

    async def _chat_events(self, stream: RequestStream, include_usage: bool) -> AsyncIterator[str]:
        n = stream.choices
        choices = _Choices(n)

        def chunk(*items: ChatChunkChoice, usage: Usage | None = None) -> str:
            return _sse(
                ChatCompletionChunk(
                    id=stream.request_id, model=self.model_name, choices=list(items), usage=usage
                )
            )

        for i in range(n):
            yield chunk(ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content="")))
        async with stream:
            try:
                async for outputs in stream:
                    for out in outputs:
                        choices.add(out)
                        delta = ChatDelta(content=out.new_text)
                        yield chunk(
                            ChatChunkChoice(index=out.index, delta=delta, finish_reason=out.finish_reason)
                        )
            except RequestFailedError as err:
                yield _sse(error_body(err.status, str(err)))
                yield "data: [DONE]\n\n"
                return
        if include_usage:
            yield chunk(usage=choices.usage())
        yield "data: [DONE]\n\n"

    # --- shared ------------------------------------------------------------------------------------------
    @staticmethod
    def _event_stream(events: AsyncIterator[str]) -> StreamingResponse:
        return StreamingResponse(
            events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    async def _collect(self, request: Request, stream: RequestStream, n: int) -> _Choices:
        async def gather() -> _Choices:
            choices = _Choices(n)
            async with stream:
                async for outputs in stream:
                    for out in outputs:
                        choices.add(out)
            return choices

        try:
            return await unless_disconnected(request, gather())
        except RequestFailedError as err:
            raise ApiError(err.status, str(err)) from None
        finally:
            stream.abort()
