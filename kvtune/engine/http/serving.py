"""What the two generate endpoints (`completions`, `chat`) share: the request checks, tokenizing off the
event loop, the max_tokens cap and the hand-over to the engine, and gathering a non-streamed answer.

Everything a client can get wrong is checked before the request reaches the engine's queue or by the
engine's own `add_request` (a ValueError there becomes a 400), so a bad request never costs KV cache.
A client that goes away is noticed (the stream is cancelled, or the disconnect watcher fires for a plain
request) and its request aborted, which frees its blocks.

The max_tokens a request runs with is decided here (`choose_max_tokens`: the cap of
`front.max_tokens_cap`, which the proxy applies too, plus the room the context leaves): a clamped or
defaulted request carries the cap header on its JSON or streamed response, a rejected one gets a 400, and
each is counted once, under its mode, when the engine accepts it (a rejection when it is refused).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from kvtune.contract.admin import CAP_HEADER
from kvtune.contract.knobs import CapMode
from kvtune.engine.http.openai_logprobs import LogprobsFormatter
from kvtune.engine.http.streaming import ChoiceTexts, unless_disconnected
from kvtune.engine.loop.errors import EngineDeadError, EngineOverloadedError, RequestFailedError
from kvtune.engine.loop.thread import AsyncEngine, RequestStream
from kvtune.errors import KvtuneError
from kvtune.front.body import read_json
from kvtune.front.errors import ApiError, describe_validation_error, echoed
from kvtune.front.max_tokens_cap import OVER_CAP_CODE, apply_max_tokens_cap
from kvtune.front.text.prompt_chars import prompt_char_limit

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)
# Longest tenant key taken from --prefix-key-header: the detector tracks a bounded number of keys, and this
# bounds each one too.
MAX_PREFIX_KEY_CHARS = 128


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


@dataclass(frozen=True)
class RequestMaxTokens:
    """What to run with, how to count it, and the header that tells the client (empty when untouched)."""

    max_tokens: int
    counted_as: str | None
    headers: dict[str, str]


class MaxTokensOverCapError(Exception):
    """The cap is in `reject` mode and the request asked for more: the client's 400."""

    def __init__(self, message: str, counted_as: str) -> None:
        super().__init__(message)
        self.message = message
        self.counted_as = counted_as


def choose_max_tokens(
    requested: int | None, prompt_len: int, max_model_len: int, cap: int | None, mode: CapMode
) -> RequestMaxTokens:
    """The request's max_tokens under the cap, within the room the prompt leaves (`requested` None: the
    room, as in vLLM, or the cap where lower); raises MaxTokensOverCapError when the cap refuses it."""
    decision = apply_max_tokens_cap(requested, cap, mode)
    if decision.error is not None:
        raise MaxTokensOverCapError(decision.error, decision.counted_as or "reject")
    room = max(1, max_model_len - prompt_len)
    if requested is None:
        max_tokens = room if decision.max_tokens is None else min(decision.max_tokens, room)
    else:
        max_tokens = requested if decision.max_tokens is None else decision.max_tokens
    headers = {CAP_HEADER: decision.header} if decision.header is not None else {}
    return RequestMaxTokens(max_tokens, decision.counted_as, headers)


class OpenAIServing:
    """The state both endpoints share over one AsyncEngine (one tokenizing thread for both).

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
    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise ApiError(404, f"The model `{echoed(name)}` does not exist.", "model", "model_not_found")

    def check_prompt_chars(self, text: str, param: str) -> None:
        """Refuse, without tokenizing it, text too long to fit max_model_len tokens (see prompt_chars)."""
        if self.prompt_char_limit is not None and len(text) > self.prompt_char_limit:
            raise ApiError(
                400,
                f"the prompt has {len(text)} characters, more than {self.max_model_len} tokens "
                f"(this model's maximum context length) can hold with this tokenizer",
                param,
            )

    async def tokenize(self, tokenize: Callable[..., list[int]], *args: Any) -> list[int]:
        """Run a tokenizing call off the event loop, so /health and other streams never wait on it."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizing, tokenize, *args)

    def _count_capped(self, counted_as: str | None) -> None:
        if counted_as is not None and self.on_capped is not None:
            self.on_capped(counted_as)

    def max_tokens(self, requested: int | None, prompt_len: int, param: str) -> RequestMaxTokens:
        """The request's max_tokens under the live cap (None asked: up to the context length, as in vLLM).
        The engine replaces its CapSetting whole, so this one read sees a consistent cap and mode."""
        setting = self.async_engine.engine.cap_setting
        try:
            return choose_max_tokens(requested, prompt_len, self.max_model_len, setting.cap, setting.mode)
        except MaxTokensOverCapError as err:
            self._count_capped(err.counted_as)
            raise ApiError(400, err.message, param, OVER_CAP_CODE) from None

    def _prefix_key(self, request: Request) -> str | None:
        """The tenant named by --prefix-key-header, or None (the model name) when absent."""
        if self.prefix_key_header is None:
            return None
        value = request.headers.get(self.prefix_key_header, "")
        return value[:MAX_PREFIX_KEY_CHARS] or None

    async def start(
        self, prefix: str, prompt_ids: list[int], body: Any, cap: RequestMaxTokens, request: Request
    ) -> RequestStream:
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        try:
            params = body.sampling_params(cap.max_tokens)
            stream = await self.async_engine.add_request(
                request_id,
                prompt_ids,
                params,
                cache_salt=body.cache_salt,
                prefix_key=self._prefix_key(request),
                whole=not body.stream,
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
        self._count_capped(cap.counted_as)
        return stream

    async def collect(self, request: Request, stream: RequestStream, n: int) -> ChoiceTexts:
        """A non-streamed answer's choices, aborting the request if the client hangs up first."""

        async def gather() -> ChoiceTexts:
            choices = ChoiceTexts(n)
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
