"""Nothing is silently ignored: an OpenAI (or vLLM) field kvtune does not implement and that would change the
answer is refused with a 400 naming it, unless it carries its neutral value; harmless fields pass."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.server.live_server import LiveServer

openai = pytest.importorskip("openai", reason="the openai client (dev dependency) is not installed")

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"prompt": "hi", "max_tokens": 2}
REFUSED_BOTH: list[tuple[str, Any]] = [
    ("logit_bias", {"65": 5}),
    ("presence_penalty", 0.5),
    ("frequency_penalty", -1),
    ("repetition_penalty", 1.2),
    ("min_p", 0.1),
    ("min_tokens", 3),
    ("use_beam_search", True),
    ("include_stop_str_in_output", True),
    ("skip_special_tokens", False),
    ("prompt_logprobs", 0),
    ("truncate_prompt_tokens", 8),
    ("allowed_token_ids", [65, 66]),
    ("bad_words", ["no"]),
    ("guided_json", {"type": "object"}),
    ("guided_regex", "a+"),
    ("guided_choice", ["yes", "no"]),
    ("guided_grammar", "root ::= 'a'"),
    ("structured_outputs", {"json": {}}),
]
REFUSED_COMPLETION: list[tuple[str, Any]] = [
    ("suffix", "the end"),
    ("best_of", 3),
    ("logprobs", 6),
    ("logprobs", -1),
    ("response_format", {"type": "json_object"}),
]
REFUSED_CHAT: list[tuple[str, Any]] = [
    ("response_format", {"type": "json_object"}),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}),
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    ("tool_choice", "required"),
    ("tool_choice", {"type": "function", "function": {"name": "f"}}),
    ("functions", [{"name": "f", "parameters": {}}]),
    ("function_call", {"name": "f"}),
    ("modalities", ["text", "audio"]),
    ("audio", {"voice": "alloy", "format": "wav"}),
    ("web_search_options", {}),
    ("echo", True),
    ("continue_final_message", True),
    ("chat_template", "{{ messages }}"),
    ("chat_template_kwargs", {"enable_thinking": True}),
    ("documents", [{"title": "t", "text": "x"}]),
    ("top_logprobs", 21),
    ("top_logprobs", 2),  # without logprobs: true
]
# What clients such as LangChain send by default, and fields that do not change the answer.
ACCEPTED_BOTH: dict[str, Any] = {
    "logit_bias": {},
    "presence_penalty": 0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_p": 0,
    "user": "someone",
    "seed": 4,
    "stream_options": None,
    "store": False,
    "metadata": {"k": "v"},
    "service_tier": "auto",
    "skip_special_tokens": True,
    "some_unknown_field": [1, 2],
}
ACCEPTED_COMPLETION: dict[str, Any] = {"best_of": 1, "suffix": None, "n": 1, "echo": False}
ACCEPTED_CHAT: dict[str, Any] = {
    "response_format": {"type": "text"},
    "tools": [],
    "tool_choice": "none",
    "parallel_tool_calls": False,
    "modalities": ["text"],
    "logprobs": False,
    "top_logprobs": 0,
    "reasoning_effort": "low",
}


def _assert_refused(response: httpx.Response, field: str) -> None:
    """A 400 with OpenAI's error body, its `param` and message naming the field."""
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == field and field in error["message"]


@pytest.mark.parametrize(("field", "value"), REFUSED_BOTH + REFUSED_COMPLETION)
def test_completion_refuses(client: httpx.Client, field: str, value: Any) -> None:
    _assert_refused(client.post("/v1/completions", json={**COMPLETION, field: value}), field)
    _assert_refused(client.post("/v1/completions", json={**COMPLETION, field: value, "stream": True}), field)


@pytest.mark.parametrize(("field", "value"), REFUSED_BOTH + REFUSED_CHAT)
def test_chat_refuses(client: httpx.Client, field: str, value: Any) -> None:
    _assert_refused(client.post("/v1/chat/completions", json={**CHAT, field: value}), field)


def test_neutral_values_and_harmless_fields_are_accepted(client: httpx.Client) -> None:
    completion = client.post("/v1/completions", json={**COMPLETION, **ACCEPTED_BOTH, **ACCEPTED_COMPLETION})
    assert completion.status_code == 200, completion.text
    chat = client.post("/v1/chat/completions", json={**CHAT, **ACCEPTED_BOTH, **ACCEPTED_CHAT})
    assert chat.status_code == 200, chat.text


def test_best_of_equal_to_n_is_plain_sampling(client: httpx.Client) -> None:
    body = {**COMPLETION, "n": 2, "best_of": 2, "seed": 1, "ignore_eos": True}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200 and len(response.json()["choices"]) == 2
    refused = client.post("/v1/completions", json={**body, "best_of": 3})
    _assert_refused(refused, "best_of")
    assert "n (2)" in refused.json()["error"]["message"]


def test_echo_with_logprobs_is_refused_with_the_reason(client: httpx.Client) -> None:
    response = client.post("/v1/completions", json={**COMPLETION, "echo": True, "logprobs": 1})
    _assert_refused(response, "echo")
    assert "prompt's logprobs" in response.json()["error"]["message"]


def test_the_openai_client_sees_a_bad_request(server: LiveServer) -> None:
    oai = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="best_of"):
        oai.completions.create(model="tiny", prompt="x", max_tokens=1, best_of=2)
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        oai.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=1, logit_bias={"65": 100}
        )
