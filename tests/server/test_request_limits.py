"""Limits at the door of `kvtune serve`: oversized bodies (413), deep JSON, invalid UTF-8, unpaired
surrogates and prompts too long to tokenize each get an OpenAI-style 4xx, and the same keep-alive
connection then serves the client's next request."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvtune.engine import command as serve
from kvtune.errors import KvtuneError
from kvtune.front.body import DEFAULT_MAX_REQUEST_BODY_BYTES, MAX_JSON_DEPTH
from tests.server.live_server import ADMIN_TOKEN, LiveServer
from tests.server.test_bad_inputs import assert_openai_error

JSON_HEADERS = {"content-type": "application/json"}
ADMIN_HEADERS = {**JSON_HEADERS, "authorization": f"Bearer {ADMIN_TOKEN}"}
GOOD_COMPLETION = {"prompt": "still here", "max_tokens": 2, "ignore_eos": True}
TINY_CHARS_PER_TOKEN = len("<|begin_of_text|>")  # the tiny tokenizer's longest entry


def local_port(response: httpx.Response) -> int:
    """The client-side port of the connection a response came on: equal ports mean one connection."""
    return int(response.extensions["network_stream"].get_extra_info("client_addr")[1])


def assert_refused_then_served(client: httpx.Client, response: httpx.Response, status: int) -> httpx.Response:
    """`response` is the expected error, and a good request then succeeds on that same connection."""
    assert_openai_error(response, status)
    ok = client.post("/v1/completions", json=GOOD_COMPLETION)
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] == 2
    assert local_port(ok) == local_port(response), "the connection was not kept alive"
    return response


def nested_lists(depth: int) -> str:
    return "[" * depth + "]" * depth


def chunks(data: bytes, size: int = 256 * 1024) -> Iterator[bytes]:
    """The body as an iterator, so httpx sends it chunked, without a Content-Length."""
    for start in range(0, len(data), size):
        yield data[start : start + size]


# --- body size --------------------------------------------------------------------------------------------
def padded_body(size: int) -> bytes:
    """A valid completion request of exactly `size` bytes (JSON whitespace as padding)."""
    body = json.dumps(GOOD_COMPLETION).encode()
    return body + b" " * (size - len(body))


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_body_over_the_limit_is_413_and_the_connection_serves_on(client: httpx.Client, chunked: bool) -> None:
    body = b'{"prompt": "' + b"y" * (10 * 1024 * 1024) + b'"}'
    content = chunks(body) if chunked else body
    response = client.post("/v1/completions", content=content, headers=JSON_HEADERS)
    assert_refused_then_served(client, response, 413)
    assert str(DEFAULT_MAX_REQUEST_BODY_BYTES) in response.json()["error"]["message"]


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_body_exactly_at_the_limit_is_read(client: httpx.Client, chunked: bool) -> None:
    at_limit = padded_body(DEFAULT_MAX_REQUEST_BODY_BYTES)
    content = chunks(at_limit) if chunked else at_limit
    assert client.post("/v1/completions", content=content, headers=JSON_HEADERS).status_code == 200
    over = padded_body(DEFAULT_MAX_REQUEST_BODY_BYTES + 1)
    content = chunks(over) if chunked else over
    assert_refused_then_served(
        client, client.post("/v1/completions", content=content, headers=JSON_HEADERS), 413
    )


def test_every_route_has_the_body_limit(client: httpx.Client) -> None:
    huge = b"{" + b" " * (DEFAULT_MAX_REQUEST_BODY_BYTES + 1) + b"}"
    assert_refused_then_served(
        client, client.post("/v1/chat/completions", content=huge, headers=JSON_HEADERS), 413
    )
    assert_refused_then_served(
        client, client.patch("/admin/config", content=huge, headers=ADMIN_HEADERS), 413
    )


def test_max_request_body_bytes_must_be_positive(tiny_dir: Path) -> None:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(["--model", str(tiny_dir), "--max-request-body-bytes", "0"])
    with pytest.raises(KvtuneError, match="--max-request-body-bytes must be positive"):
        serve.build_server(args)


# --- JSON depth -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 1000, 100_000])
def test_deep_json_is_a_400_naming_the_limit(client: httpx.Client, depth: int) -> None:
    completion = f'{{"prompt": "x", "extra": {nested_lists(depth - 1)}}}'
    chat = f'{{"messages": [{{"role": "user", "content": "x"}}], "extra": {nested_lists(depth - 1)}}}'
    for path, body in (("/v1/completions", completion), ("/v1/chat/completions", chat)):
        response = client.post(path, content=body, headers=JSON_HEADERS)
        assert_refused_then_served(client, response, 400)
        assert f"deeper than {MAX_JSON_DEPTH} levels" in response.json()["error"]["message"]
    admin = client.patch("/admin/config", content=nested_lists(depth), headers=ADMIN_HEADERS)
    assert_refused_then_served(client, admin, 400)
    assert f"deeper than {MAX_JSON_DEPTH} levels" in admin.json()["error"]["message"]


def test_json_at_the_depth_limit_is_served(client: httpx.Client) -> None:
    body = f'{{"prompt": "x", "max_tokens": 1, "extra": {nested_lists(MAX_JSON_DEPTH - 1)}}}'
    assert client.post("/v1/completions", content=body, headers=JSON_HEADERS).status_code == 200


def test_brackets_inside_strings_are_not_nesting(client: httpx.Client) -> None:
    body = {"prompt": "[{" * 300, "max_tokens": 1, "stop": ["]" * 5]}
    assert client.post("/v1/completions", json=body).status_code == 200


# --- Unicode ----------------------------------------------------------------------------------------------
SURROGATE_BODIES = [
    ("prompt", "/v1/completions", r'{"prompt": "a\ud800b"}', "prompt"),
    ("low surrogate alone", "/v1/completions", r'{"prompt": "\udc00"}', "prompt"),
    ("pair in the wrong order", "/v1/completions", r'{"prompt": "\udc00\ud800"}', "prompt"),
    ("batched prompt", "/v1/completions", r'{"prompt": ["\ud800"]}', "prompt.0"),
    ("stop string", "/v1/completions", r'{"prompt": "x", "stop": ["\udfff"]}', "stop.0"),
    ("object key", "/v1/completions", r'{"prompt": "x", "\ud800": 1}', r"\ud800"),
    (
        "chat content",
        "/v1/chat/completions",
        r'{"messages": [{"role": "user", "content": "hi \ud83d"}]}',
        "messages.0.content",
    ),
    (
        "chat role",
        "/v1/chat/completions",
        r'{"messages": [{"role": "us\udbffer", "content": "hi"}]}',
        "messages.0.role",
    ),
    (
        "chat content part",
        "/v1/chat/completions",
        r'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}',
        "messages.0.content.0.text",
    ),
]


@pytest.mark.parametrize(
    ("path", "body", "param"), [b[1:] for b in SURROGATE_BODIES], ids=[b[0] for b in SURROGATE_BODIES]
)
def test_unpaired_surrogate_is_a_400(client: httpx.Client, path: str, body: str, param: str) -> None:
    response = client.post(path, content=body.encode(), headers=JSON_HEADERS)
    assert_refused_then_served(client, response, 400)
    error = response.json()["error"]
    assert "surrogate" in error["message"]
    assert error["param"] == param


def test_escaped_surrogate_pair_and_escaped_backslash_are_valid(client: httpx.Client) -> None:
    emoji = rb'{"prompt": "smile \ud83d\ude00", "max_tokens": 1}'  # how json.dumps(ensure_ascii) sends one
    assert client.post("/v1/completions", content=emoji, headers=JSON_HEADERS).status_code == 200
    backslash = rb'{"prompt": "a path C:\\ud800", "max_tokens": 1}'  # a backslash, then the text "ud800"
    assert client.post("/v1/completions", content=backslash, headers=JSON_HEADERS).status_code == 200
    chat = {"messages": [{"role": "user", "content": "\U0001f600"}], "max_tokens": 1}
    assert (
        client.post("/v1/chat/completions", content=json.dumps(chat), headers=JSON_HEADERS).status_code == 200
    )


@pytest.mark.parametrize(
    "raw",
    [
        b'{"prompt": "\xff"}',
        b'{"prompt": "\xed\xa0\x80"}',
        b'{"prompt": "\xe2\x82"}',
        b'{"prompt": "\xc0\xaf"}',
    ],
    ids=["invalid byte", "utf-8-encoded surrogate", "truncated sequence", "overlong encoding"],
)
def test_invalid_utf8_is_a_400(client: httpx.Client, raw: bytes) -> None:
    for path in ("/v1/completions", "/v1/chat/completions"):
        response = client.post(path, content=raw, headers=JSON_HEADERS)
        assert_refused_then_served(client, response, 400)
        assert "not valid UTF-8" in response.json()["error"]["message"]


# --- prompt length before tokenizing ----------------------------------------------------------------------
def test_prompt_longer_than_any_fitting_text_is_refused_untokenized(
    client: httpx.Client, server: LiveServer
) -> None:
    max_model_len = server.built.engine.max_model_len
    limit = max_model_len * TINY_CHARS_PER_TOKEN
    over = client.post("/v1/completions", json={"prompt": "y" * (limit + 1), "max_tokens": 1})
    assert_refused_then_served(client, over, 400)
    assert over.json()["error"]["param"] == "prompt"
    assert f"{limit + 1} characters" in over.json()["error"]["message"]
    # Just under the bound it is tokenized, and the engine counts the tokens (a different refusal).
    under = client.post("/v1/completions", json={"prompt": "y" * limit, "max_tokens": 1})
    assert_refused_then_served(client, under, 400)
    assert f"the prompt has {limit + 1} tokens" in under.json()["error"]["message"]


def test_chat_longer_than_any_fitting_text_is_refused_untokenized(
    client: httpx.Client, server: LiveServer
) -> None:
    limit = server.built.engine.max_model_len * TINY_CHARS_PER_TOKEN
    half = "z" * (limit // 2)
    body = {"messages": [{"role": "user", "content": half}, {"role": "assistant", "content": half}]}
    response = client.post("/v1/chat/completions", json={**body, "max_tokens": 1})
    assert_refused_then_served(client, response, 400)
    assert response.json()["error"]["param"] == "messages"
    assert "characters" in response.json()["error"]["message"]
