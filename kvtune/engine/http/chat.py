"""`POST /v1/chat/completions`: a conversation, rendered by the model's chat template, in; the engine's
choices back as one JSON answer or as server-sent chunks (a role delta first, then content deltas).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kvtune.engine.http.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatResponseMessage,
    Usage,
)
from kvtune.engine.http.serving import OpenAIServing, parse_body
from kvtune.engine.http.streaming import DONE, ChoiceTexts, event_stream, sse
from kvtune.engine.loop.errors import RequestFailedError
from kvtune.engine.loop.thread import RequestStream
from kvtune.errors import KvtuneError
from kvtune.front.errors import ApiError, error_body


def tokenized_conversation(
    serving: OpenAIServing, messages: list[dict[str, str]], add_generation_prompt: bool
) -> list[int]:
    """Token ids of a conversation, its rendered text checked for length before it is tokenized (the
    text the tokenizer sees, whatever the template keeps of each message); special-token text inside
    the messages stays plain text (see `TextTokenizer.encode_chat`). Call it off the event loop."""
    try:
        text = serving.tokenizer.apply_chat_template(messages, add_generation_prompt)
        serving.check_prompt_chars(text, "messages")
        return serving.tokenizer.encode_chat(messages, add_generation_prompt)
    except KvtuneError as err:
        raise ApiError(400, str(err), "messages") from None


async def create(serving: OpenAIServing, request: Request) -> Response:
    body = await parse_body(request, ChatCompletionRequest)
    serving.check_model(body.model)
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    prompt_ids = await serving.tokenize(tokenized_conversation, serving, messages, body.add_generation_prompt)
    newer = body.max_completion_tokens is not None
    requested = body.max_completion_tokens if newer else body.max_tokens
    param = "max_completion_tokens" if newer else "max_tokens"
    cap = serving.max_tokens(requested, len(prompt_ids), param)
    stream = await serving.start("chatcmpl", prompt_ids, body, cap, request)
    if body.stream:
        return event_stream(events(serving, stream, body.include_usage, bool(body.logprobs)), cap.headers)
    choices = await serving.collect(request, stream, body.n)
    return JSONResponse(
        ChatCompletionResponse(
            id=stream.request_id,
            model=serving.model_name,
            choices=[
                ChatChoice(
                    index=i,
                    message=ChatResponseMessage(content=choices.texts[i]),
                    logprobs=serving.logprob_formatter.chat(choices.logprobs[i]) if body.logprobs else None,
                    finish_reason=choices.reasons[i],
                )
                for i in range(body.n)
            ],
            usage=choices.usage(),
        ).model_dump(),
        headers=cap.headers,
    )


async def events(
    serving: OpenAIServing, stream: RequestStream, include_usage: bool, wants_logprobs: bool
) -> AsyncIterator[str]:
    n = stream.choices
    choices = ChoiceTexts(n)

    def chunk(*items: ChatChunkChoice, usage: Usage | None = None) -> str:
        return sse(
            ChatCompletionChunk(
                id=stream.request_id, model=serving.model_name, choices=list(items), usage=usage
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
                    logprobs = serving.logprob_formatter.chat(entries) if wants_logprobs else None
                    yield chunk(
                        ChatChunkChoice(
                            index=out.index,
                            delta=delta,
                            logprobs=logprobs,
                            finish_reason=out.finish_reason,
                        )
                    )
        except RequestFailedError as err:
            yield sse(error_body(err.status, str(err)))
            yield DONE
            return
    if include_usage:
        yield chunk(usage=choices.usage())
    yield DONE
