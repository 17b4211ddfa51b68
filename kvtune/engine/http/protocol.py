"""The OpenAI wire format the server speaks: request bodies, responses, stream chunks and errors.

Only what kvtune serves is modelled. Nothing that would change the answer is silently ignored: a known
OpenAI or vLLM field kvtune does not implement (`logit_bias`, penalties, `suffix`, `tools`, a non-text
`response_format`, `best_of` other than n, ...) is refused with a 400 naming it, unless it carries its
neutral value (what clients such as LangChain send by default: `{}`, 0, "text"). Fields that do not change
the answer (`user`, `seed`, `stream_options`, `store`, `metadata`, ...) and unknown fields are ignored, as
OpenAI-compatible servers do; wrong types of the fields we do read are refused.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from kvtune.engine.model.sampling import SamplingParams

MAX_COMPLETION_LOGPROBS = 5  # the legacy completions API's limit
MAX_CHAT_TOP_LOGPROBS = 20


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Lenient):
    include_usage: bool | None = False


def _refused(reason: str) -> PydanticCustomError:
    return PydanticCustomError("unsupported_field", "{reason}", {"reason": reason})


def _only_neutral(is_neutral: Callable[[Any], bool], what: str, neutral: str) -> AfterValidator:
    """Accept a field kvtune does not implement only at the value that means 'not used'."""

    def check(value: Any) -> Any:
        if value is not None and not is_neutral(value):
            raise _refused(f"kvtune does not support {what}; leave it out or send {neutral}")
        return value

    return AfterValidator(check)


def _is_zero(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value == 0


def _is_empty(value: Any) -> bool:
    return value in ("", [], {})


def _zero_biases(value: Any) -> bool:
    return isinstance(value, dict) and all(_is_zero(bias) for bias in value.values())


_Guided = Annotated[Any, _only_neutral(_is_empty, "guided decoding", "null")]
_NoTokenLists = Annotated[Any, _only_neutral(_is_empty, "token allow/deny lists", "[]")]


class _SamplingFields(_Lenient):
    """Knobs the two generate endpoints share (vLLM's extras included: top_k, ignore_eos, stop_token_ids)."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1 - 16)  # torch seeds are 64-bit; n adds
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's field: prompts share prefix-cache blocks only with prompts of the same salt (tenant isolation).
    cache_salt: str | None = Field(default=None, min_length=1)
    # Known fields that would change the answer; refused unless neutral (see the module docstring).
    logit_bias: Annotated[Any, _only_neutral(_zero_biases, "logit_bias", "{}")] = None
    presence_penalty: Annotated[Any, _only_neutral(_is_zero, "presence_penalty", "0")] = None
    frequency_penalty: Annotated[Any, _only_neutral(_is_zero, "frequency_penalty", "0")] = None
    repetition_penalty: Annotated[Any, _only_neutral(lambda v: v == 1, "repetition_penalty", "1")] = None
    min_p: Annotated[Any, _only_neutral(_is_zero, "min_p", "0")] = None
    min_tokens: Annotated[Any, _only_neutral(_is_zero, "min_tokens", "0")] = None
    use_beam_search: Annotated[Any, _only_neutral(lambda v: v is False, "beam search", "false")] = None
    include_stop_str_in_output: Annotated[
        Any, _only_neutral(lambda v: v is False, "returning the stop string", "false")
    ] = None
    skip_special_tokens: Annotated[
        Any, _only_neutral(lambda v: v is True, "decoding special tokens into the text", "true")
    ] = None
    prompt_logprobs: Annotated[Any, _only_neutral(lambda _: False, "prompt logprobs", "null")] = None
    truncate_prompt_tokens: Annotated[Any, _only_neutral(lambda _: False, "prompt truncation", "null")] = None
    allowed_token_ids: _NoTokenLists = None
    bad_words: _NoTokenLists = None
    guided_json: _Guided = None
    guided_regex: _Guided = None
    guided_choice: _Guided = None
    guided_grammar: _Guided = None
    structured_outputs: _Guided = None
    response_format: Annotated[
        Any, _only_neutral(lambda v: v == {"type": "text"}, "response_format", '{"type": "text"}')
    ] = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def logprobs_wanted(self) -> int | None:
        """How many top alternatives to return with each sampled token's logprob; None: no logprobs."""
        return None

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None or self.top_k == 0 else self.top_k,
            seed=self.seed,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            n=self.n,
            logprobs=self.logprobs_wanted(),
        )


PromptInput = str | list[int] | list[str] | list[list[int]]


class CompletionRequest(_SamplingFields):
    prompt: PromptInput
    max_tokens: int | None = 16
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: Annotated[Any, _only_neutral(_is_empty, "suffix (insertion)", "null")] = None

    @field_validator("echo")
    @classmethod
    def _no_prompt_logprobs(cls, echo: bool, info: ValidationInfo) -> bool:
        if echo and info.data.get("logprobs") is not None:
            raise _refused(
                "echo with logprobs would need the prompt's logprobs, which kvtune does not compute; "
                "send echo or logprobs, not both"
            )
        return echo

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, best_of: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n", 1)
        if best_of is not None and best_of != n:
            raise _refused(
                f"kvtune does not rank candidates, so best_of must equal n ({n}) or be left out; got {best_of}"
            )
        return best_of

    def logprobs_wanted(self) -> int | None:
        return self.logprobs


class TextPart(_Lenient):
    type: Literal["text"]
    text: str


class ChatMessage(_Lenient):
    role: str
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        """Content as one string; multi-part content joins its text parts (the only parts we serve)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_CHAT_TOP_LOGPROBS)
    tools: Annotated[Any, _only_neutral(_is_empty, "tools", "[]")] = None
    tool_choice: Annotated[Any, _only_neutral(lambda v: v in ("none", "auto"), "tool_choice", '"none"')] = (
        None
    )
    functions: Annotated[Any, _only_neutral(_is_empty, "functions", "[]")] = None
    function_call: Annotated[
        Any, _only_neutral(lambda v: v in ("none", "auto"), "function_call", '"none"')
    ] = None
    modalities: Annotated[Any, _only_neutral(lambda v: v == ["text"], "modalities", '["text"]')] = None
    audio: Annotated[Any, _only_neutral(lambda _: False, "audio output", "null")] = None
    web_search_options: Annotated[Any, _only_neutral(lambda _: False, "web search", "null")] = None
    echo: Annotated[Any, _only_neutral(lambda v: v is False, "echo on chat", "false")] = None
    continue_final_message: Annotated[
        Any, _only_neutral(lambda v: v is False, "continue_final_message", "false")
    ] = None
    chat_template: Annotated[
        Any, _only_neutral(lambda _: False, "a chat template from the request", "null")
    ] = None
    chat_template_kwargs: Annotated[Any, _only_neutral(_is_empty, "chat_template_kwargs", "{}")] = None
    documents: Annotated[Any, _only_neutral(_is_empty, "documents", "[]")] = None

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, top_logprobs: int | None, info: ValidationInfo) -> int | None:
        if top_logprobs and not info.data.get("logprobs"):
            raise _refused("top_logprobs needs logprobs set to true")
        return top_logprobs

    def logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


# --- responses -----------------------------------------------------------------------------------------
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


def _now() -> int:
    return int(time.time())


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: parallel lists, one entry per token, top alternatives as dicts."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "kvtune"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
