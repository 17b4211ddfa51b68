"""The two generate endpoints: OpenAI request in, engine request out, and back as JSON or server-sent events.

Everything a client can get wrong is checked before the request reaches the engine's queue or by the
engine's own `add_request` (a ValueError there becomes a 400), so a bad request never costs KV cache.
A client that goes away is noticed (the stream is cancelled, or the disconnect watcher fires for a plain
request) and its request aborted, which frees its blocks.

The max_tokens cap is decided here, the only place that does (see request_max_tokens): a clamped or
defaulted request carries the cap header on its JSON or streamed response, a rejected one gets a 400, and
each is counted once, under its mode, when the engine accepts it (a rejection when it is refused).
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from kvtune.engine.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineOverloadedError,
    RequestFailedError,
    RequestStream,
)
from kvtune.engine.engine import RequestOutput
from kvtune.engine.logprobs import TokenLogprobs
from kvtune.engine.openai_logprobs import LogprobsFormatter
from kvtune.engine.protocol import (
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
)
from kvtune.engine.request_max_tokens import MaxTokensChoice, MaxTokensOverCapError, choose_max_tokens
from kvtune.errors import KvtuneError
from kvtune.front.body import read_json
from kvtune.front.errors import ApiError, describe_validation_error, echoed, error_body
from kvtune.front.text.prompt_chars import prompt_char_limit

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")
# Longest tenant key taken from --prefix-key-header: the detector tracks a bounded number of keys, and this
# bounds each one too.
MAX_PREFIX_KEY_CHARS = 128


class ClientGoneError(Exception):
    """The client disconnected before its (non-streamed) answer was ready."""


async def parse_body(request: Request, model: type[M]) -> M:
    """The JSON body as `model`, or a 400 for malformed JSON or wrong types (never FastAPI's 422); the
    door's checks (size, depth, valid Unicode) are `read_json`'s."""
    data = await read_json(request)
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise describe_validation_error(err.errors()) from None


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


def _sse(payload: BaseModel | dict[str, Any]) -> str:
    """One server-sent event whose data cannot be cut in two by a client that splits on Unicode line
    breaks (U+0085, U+2028... are legal unescaped in JSON, and generated text holds them)."""
    body = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {body.translate(_LINE_BREAKS_ESCAPED)}\n\n"


@dataclass
class _Choices:
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


class OpenAIServing:
    """Handlers for /v1/completions and /v1/chat/completions over one AsyncEngine.

    `on_capped(mode)` counts a request the cap changed or refused; `prefix_key_header` names the request
    header whose value (a tenant) the prefix-defeat detector groups prompts by, instead of the model name.
    """

    def __init__(
        self,
        async_engine: AsyncEngine,
        on_capped: Callable[[str], None] | None = None,
        prefix_key_header: str | None = None,
    ) -> None:
        self.async_engine = async_engine
        self.on_capped = on_capped
        self.prefix_key_header = prefix_key_header
        engine = async_engine.engine
        self.model_name = engine.served_model_name
        self.max_model_len = engine.max_model_len
        self.tokenizer = engine.tokenizer
        self.logprob_formatter = LogprobsFormatter(self.tokenizer)
        # One thread: tokenizing is CPU-bound, and parallel encodes would take every core from the event
        # loop and the engine thread; a long prompt waits for the one before it instead.
        self._tokenizing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtune-tokenize")
        self.prompt_char_limit = prompt_char_limit(self.tokenizer.tokenizer, self.max_model_len)
        if self.prompt_char_limit is None:
            logger.info("this tokenizer can drop characters: prompts are bounded by the body size only")

    # --- request checks --------------------------------------------------------------------------------
    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise ApiError(404, f"The model `{echoed(name)}` does not exist.", "model", "model_not_found")

    def _check_prompt_chars(self, text: str, param: str) -> None:
        """Refuse, without tokenizing it, text too long to fit max_model_len tokens (see prompt_chars)."""
        if self.prompt_char_limit is not None and len(text) > self.prompt_char_limit:
            raise ApiError(
                400,
                f"the prompt has {len(text)} characters, more than {self.max_model_len} tokens "
                f"(this model's maximum context length) can hold with this tokenizer",
                param,
            )

    def _completion_prompt(self, prompt: str | list[int] | list[str] | list[list[int]]) -> list[int]:
        """Token ids of a completion prompt: text, token ids, or a batch of exactly one of either.
        Tokenizing takes long for long text: call it off the event loop."""
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
        if isinstance(single, str):
            self._check_prompt_chars(single, "prompt")
            return self.tokenizer.encode(single)
        return list(single)

    def _chat_prompt(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
        """Token ids of a conversation, its rendered text checked for length before it is tokenized (the
        text the tokenizer sees, whatever the template keeps of each message); special-token text inside
        the messages stays plain text (see `TextTokenizer.encode_chat`). Call it off the event loop."""
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt)
            self._check_prompt_chars(text, "messages")
            return self.tokenizer.encode_chat(messages, add_generation_prompt)
        except KvtuneError as err:
            raise ApiError(400, str(err), "messages") from None

    async def _tokenize(self, tokenize: Callable[..., list[int]], *args: Any) -> list[int]:
        """Run a tokenizing call off the event loop, so /health and other streams never wait on it."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizing, tokenize, *args)

    def _echo_text(self, prompt: str | list[int] | list[str] | list[list[int]]) -> str:
        """The prompt as `echo` returns it: the client's own text, or its token ids decoded (BOS dropped)."""
        single: str | list[int]
        if isinstance(prompt, str):
            single = prompt
        elif prompt and not isinstance(prompt[0], int):
            single = prompt[0]
        else:
            single = [t for t in prompt if isinstance(t, int)]
        return single if isinstance(single, str) else self.tokenizer.decode(single)

    def _count_capped(self, counted_as: str | None) -> None:
        if counted_as is not None and self.on_capped is not None:
            self.on_capped(counted_as)

    def _max_tokens(self, requested: int | None, prompt_len: int, param: str) -> MaxTokensChoice:
        """The request's max_tokens under the live cap (None asked: up to the context length, as in vLLM).
        The engine replaces its CapSetting whole, so this one read sees a consistent cap and mode."""
        setting = self.async_engine.engine.cap_setting
        try:
            return choose_max_tokens(requested, prompt_len, self.max_model_len, setting.cap, setting.mode)
        except MaxTokensOverCapError as err:
            self._count_capped(err.counted_as)
            raise ApiError(400, err.message, param, "max_tokens_over_cap") from None

    def _prefix_key(self, request: Request) -> str | None:
        """The tenant named by --prefix-key-header, or None (the model name) when absent."""
        if self.prefix_key_header is None:
            return None
        value = request.headers.get(self.prefix_key_header, "")
        return value[:MAX_PREFIX_KEY_CHARS] or None

    async def _start(
        self, prefix: str, prompt_ids: list[int], body: Any, choice: MaxTokensChoice, request: Request
    ) -> RequestStream:
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        try:
            params = body.sampling_params(choice.max_tokens)
            stream = await self.async_engine.add_request(
                request_id,
                prompt_ids,
                params,
                cache_salt=body.cache_salt,
                prefix_key=self._prefix_key(request),
            )
        except (ValueError, KvtuneError) as err:
            raise ApiError(400, str(err)) from None
        except EngineOverloadedError as err:
            retry = {"Retry-After": str(err.retry_after)}
            raise ApiError(429, str(err), code="rate_limit_exceeded", headers=retry) from None
        except EngineDeadError as err:
            raise ApiError(503, str(err), code="engine_not_running") from None
        except Exception as err:  # a bug met while queueing: fail this request (a fault, not overload)
            logger.exception("the engine could not queue %s", request_id)
            raise ApiError(500, f"the engine could not accept this request: {err}") from None
        self._count_capped(choice.counted_as)
        return stream

    # --- /v1/completions --------------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        body = await parse_body(request, CompletionRequest)
        self._check_model(body.model)
        prompt_ids = await self._tokenize(self._completion_prompt, body.prompt)
        choice = self._max_tokens(body.max_tokens, len(prompt_ids), "max_tokens")
        stream = await self._start("cmpl", prompt_ids, body, choice, request)
        request_id = stream.request_id
        echo = self._echo_text(body.prompt) if body.echo else ""
        wants_logprobs = body.logprobs is not None
        if body.stream:
            return self._event_stream(
                self._completion_events(stream, body.include_usage, echo, wants_logprobs), choice.headers
            )
        choices = await self._collect(request, stream, body.n)
        return JSONResponse(
            CompletionResponse(
                id=request_id,
                model=self.model_name,
                choices=[
                    CompletionChoice(
                        index=i,
                        text=echo + choices.texts[i],
                        logprobs=self.logprob_formatter.completion(choices.logprobs[i], len(echo))[0]
                        if wants_logprobs
                        else None,
                        finish_reason=choices.reasons[i],
                    )
                    for i in range(body.n)
                ],
                usage=choices.usage(),
            ).model_dump(),
            headers=choice.headers,
        )

    async def _completion_events(
        self, stream: RequestStream, include_usage: bool, echo: str, wants_logprobs: bool
    ) -> AsyncIterator[str]:
        """Echo: each choice's first chunk is the prompt text. Logprobs: each chunk carries its token's."""
        choices = _Choices(stream.choices)
        offsets = [len(echo)] * stream.choices
        if echo:
            for i in range(stream.choices):
                echoed = CompletionChoice(index=i, text=echo)
                yield _sse(CompletionResponse(id=stream.request_id, model=self.model_name, choices=[echoed]))
        async with stream:
            try:
                async for outputs in stream:
                    for out in outputs:
                        choices.add(out)
                        logprobs = None
                        if wants_logprobs:
                            entries = [out.logprobs] if out.logprobs is not None else []
                            logprobs, offsets[out.index] = self.logprob_formatter.completion(
                                entries, offsets[out.index]
                            )
                        choice = CompletionChoice(
                            index=out.index,
                            text=out.new_text,
                            logprobs=logprobs,
                            finish_reason=out.finish_reason,
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
        prompt_ids = await self._tokenize(self._chat_prompt, messages, body.add_generation_prompt)
        newer = body.max_completion_tokens is not None
        requested = body.max_completion_tokens if newer else body.max_tokens
        param = "max_completion_tokens" if newer else "max_tokens"
        choice = self._max_tokens(requested, len(prompt_ids), param)
        stream = await self._start("chatcmpl", prompt_ids, body, choice, request)
        if body.stream:
            return self._event_stream(
                self._chat_events(stream, body.include_usage, bool(body.logprobs)), choice.headers
            )
        choices = await self._collect(request, stream, body.n)
        return JSONResponse(
            ChatCompletionResponse(
                id=stream.request_id,
                model=self.model_name,
                choices=[
                    ChatChoice(
                        index=i,
                        message=ChatResponseMessage(content=choices.texts[i]),
                        logprobs=self.logprob_formatter.chat(choices.logprobs[i]) if body.logprobs else None,
                        finish_reason=choices.reasons[i],
                    )
                    for i in range(body.n)
                ],
                usage=choices.usage(),
            ).model_dump(),
            headers=choice.headers,
        )

    async def _chat_events(
        self, stream: RequestStream, include_usage: bool, wants_logprobs: bool
    ) -> AsyncIterator[str]:
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
                        entries = [out.logprobs] if out.logprobs is not None else []
                        logprobs = self.logprob_formatter.chat(entries) if wants_logprobs else None
                        yield chunk(
                            ChatChunkChoice(
                                index=out.index,
                                delta=delta,
                                logprobs=logprobs,
                                finish_reason=out.finish_reason,
                            )
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
    def _event_stream(events: AsyncIterator[str], headers: dict[str, str]) -> StreamingResponse:
        return StreamingResponse(
            events, media_type="text/event-stream", headers={"Cache-Control": "no-cache", **headers}
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
