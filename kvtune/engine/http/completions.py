"""`POST /v1/completions`: a prompt (text or token ids, a batch of one) in, the engine's choices back as one
JSON answer or as server-sent events, with `echo` and `logprobs` as OpenAI's API has them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kvtune.engine.http.protocol import CompletionChoice, CompletionRequest, CompletionResponse
from kvtune.engine.http.serving import OpenAIServing, parse_body
from kvtune.engine.http.streaming import DONE, ChoiceTexts, event_stream, sse
from kvtune.engine.loop.errors import RequestFailedError
from kvtune.engine.loop.thread import RequestStream
from kvtune.front.errors import ApiError, error_body


def tokenized_prompt(
    serving: OpenAIServing, prompt: str | list[int] | list[str] | list[list[int]]
) -> list[int]:
    """Token ids of a completion prompt: text, token ids, or a batch of exactly one of either.
    Tokenizing takes long for long text: call it off the event loop."""
    single: str | list[int]
    if isinstance(prompt, str):
        single = prompt
    elif prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise ApiError(400, "batched prompts are not supported; send one prompt per request", "prompt")
        single = prompt[0]
    else:
        single = [t for t in prompt if isinstance(t, int)]
    if not single:
        raise ApiError(400, "the prompt is empty", "prompt")
    if isinstance(single, str):
        serving.check_prompt_chars(single, "prompt")
        return serving.tokenizer.encode(single)
    return list(single)


def echo_text(serving: OpenAIServing, prompt: str | list[int] | list[str] | list[list[int]]) -> str:
    """The prompt as `echo` returns it: the client's own text, or its token ids decoded (BOS dropped)."""
    single: str | list[int]
    if isinstance(prompt, str):
        single = prompt
    elif prompt and not isinstance(prompt[0], int):
        single = prompt[0]
    else:
        single = [t for t in prompt if isinstance(t, int)]
    return single if isinstance(single, str) else serving.tokenizer.decode(single)


async def create(serving: OpenAIServing, request: Request) -> Response:
    body = await parse_body(request, CompletionRequest)
    serving.check_model(body.model)
    prompt_ids = await serving.tokenize(tokenized_prompt, serving, body.prompt)
    cap = serving.max_tokens(body.max_tokens, len(prompt_ids), "max_tokens")
    stream = await serving.start("cmpl", prompt_ids, body, cap, request)
    request_id = stream.request_id
    echo = echo_text(serving, body.prompt) if body.echo else ""
    wants_logprobs = body.logprobs is not None
    if body.stream:
        return event_stream(events(serving, stream, body.include_usage, echo, wants_logprobs), cap.headers)
    choices = await serving.collect(request, stream, body.n)
    return JSONResponse(
        CompletionResponse(
            id=request_id,
            model=serving.model_name,
            choices=[
                CompletionChoice(
                    index=i,
                    text=echo + choices.texts[i],
                    logprobs=serving.logprob_formatter.completion(choices.logprobs[i], len(echo))[0]
                    if wants_logprobs
                    else None,
                    finish_reason=choices.reasons[i],
                )
                for i in range(body.n)
            ],
            usage=choices.usage(),
        ).model_dump(),
        headers=cap.headers,
    )


async def events(
    serving: OpenAIServing, stream: RequestStream, include_usage: bool, echo: str, wants_logprobs: bool
) -> AsyncIterator[str]:
    """Echo: each choice's first chunk is the prompt text. Logprobs: each chunk carries its token's."""
    choices = ChoiceTexts(stream.choices)
    offsets = [len(echo)] * stream.choices
    if echo:
        for i in range(stream.choices):
            echoed = CompletionChoice(index=i, text=echo)
            yield sse(CompletionResponse(id=stream.request_id, model=serving.model_name, choices=[echoed]))
    async with stream:
        try:
            async for outputs in stream:
                for out in outputs:
                    choices.add(out)
                    logprobs = None
                    if wants_logprobs:
                        entries = [out.logprobs] if out.logprobs is not None else []
                        logprobs, offsets[out.index] = serving.logprob_formatter.completion(
                            entries, offsets[out.index]
                        )
                    choice = CompletionChoice(
                        index=out.index,
                        text=out.new_text,
                        logprobs=logprobs,
                        finish_reason=out.finish_reason,
                    )
                    yield sse(
                        CompletionResponse(id=stream.request_id, model=serving.model_name, choices=[choice])
                    )
        except RequestFailedError as err:
            yield sse(error_body(err.status, str(err)))
            yield DONE
            return
    if include_usage:
        yield sse(
            CompletionResponse(
                id=stream.request_id, model=serving.model_name, choices=[], usage=choices.usage()
            )
        )
    yield DONE
