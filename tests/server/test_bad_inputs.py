"""Whatever a client sends, it gets an OpenAI-style JSON error with a 4xx status, and the server serves on.
Bodies refused at the door both fronts share (malformed JSON, bad UTF-8, size) are tested in tests/front."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.front.refusals import assert_openai_error
from tests.server.live_server import LiveServer

BAD_COMPLETIONS: list[tuple[str, Any, int]] = [
    ("negative max_tokens", {"prompt": "x", "max_tokens": -1}, 400),
    ("zero max_tokens", {"prompt": "x", "max_tokens": 0}, 400),
    ("absurd max_tokens", {"prompt": "x", "max_tokens": 10**12}, 400),
    ("astronomic max_tokens", {"prompt": "x", "max_tokens": 10**40}, 400),
    ("fractional max_tokens", {"prompt": "x", "max_tokens": 1.5}, 400),
    ("prompt over max_model_len", {"prompt": "y" * 2000, "max_tokens": 1}, 400),
    ("token prompt over max_model_len", {"prompt": [65] * 1024, "max_tokens": 1}, 400),
    ("prompt plus max_tokens over max_model_len", {"prompt": "y" * 1000, "max_tokens": 100}, 400),
    ("unknown model", {"model": "gpt-4", "prompt": "x"}, 404),
    ("empty prompt", {"prompt": ""}, 400),
    ("empty token prompt", {"prompt": []}, 400),
    ("missing prompt", {"max_tokens": 3}, 400),
    ("prompt of wrong type", {"prompt": 42}, 400),
    ("token id out of vocabulary", {"prompt": [1, 2, 10**6]}, 400),
    ("negative token id", {"prompt": [-1]}, 400),
    ("batched prompts", {"prompt": ["a", "b"]}, 400),
    ("temperature of wrong type", {"prompt": "x", "temperature": "hot"}, 400),
    ("negative temperature", {"prompt": "x", "temperature": -1}, 400),
    ("top_p out of range", {"prompt": "x", "top_p": 0}, 400),
    ("top_k negative", {"prompt": "x", "top_k": -5}, 400),
    ("n too large", {"prompt": "x", "n": 1000}, 400),
    ("n zero", {"prompt": "x", "n": 0}, 400),
    ("seed too large for torch", {"prompt": "x", "seed": 2**70}, 400),
    ("stop of wrong type", {"prompt": "x", "stop": 5}, 400),
    ("empty stop string", {"prompt": "x", "stop": [""]}, 400),
    ("stop token id out of vocabulary", {"prompt": "x", "stop_token_ids": [10**9]}, 400),
    ("stream of wrong type", {"prompt": "x", "stream": "maybe"}, 400),
    ("body is a list", [1, 2, 3], 400),
]
BAD_CHAT: list[tuple[str, Any, int]] = [
    ("no messages", {"messages": []}, 400),
    ("message without role", {"messages": [{"content": "hi"}]}, 400),
    ("content of wrong type", {"messages": [{"role": "user", "content": 7}]}, 400),
    (
        "negative max_completion_tokens",
        {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -2},
        400,
    ),
    ("unknown model", {"model": "llama", "messages": [{"role": "user", "content": "hi"}]}, 404),
    (
        "conversation over max_model_len",
        {"messages": [{"role": "user", "content": "z" * 1100}], "max_tokens": 1},
        400,
    ),
]


@pytest.mark.parametrize(
    ("body", "status"), [(b, s) for _, b, s in BAD_COMPLETIONS], ids=[i for i, _, _ in BAD_COMPLETIONS]
)
def test_bad_completion_requests(client: httpx.Client, body: Any, status: int) -> None:
    assert_openai_error(client.post("/v1/completions", json=body), status)
    if isinstance(body, dict) and "stream" not in body:
        assert_openai_error(client.post("/v1/completions", json={**body, "stream": True}), status)


@pytest.mark.parametrize(
    ("body", "status"), [(b, s) for _, b, s in BAD_CHAT], ids=[i for i, _, _ in BAD_CHAT]
)
def test_bad_chat_requests(client: httpx.Client, body: Any, status: int) -> None:
    assert_openai_error(client.post("/v1/chat/completions", json=body), status)


def test_a_wrong_method_is_a_json_405(client: httpx.Client) -> None:
    assert_openai_error(client.get("/v1/completions"), 405)


def test_server_keeps_serving_after_bad_input(client: httpx.Client, server: LiveServer) -> None:
    for _, body, _ in BAD_COMPLETIONS:
        client.post("/v1/completions", json=body)
    ok = client.post("/v1/completions", json={"prompt": "still here", "max_tokens": 3, "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    assert client.get("/health").status_code == 200
    server.wait_idle()
    assert server.blocks_held() == 0
