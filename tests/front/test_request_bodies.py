"""The door of both fronts: a body over the size limit (413), malformed or deep JSON, invalid UTF-8 and
unpaired surrogates each get OpenAI's error with a 4xx, the same message from the proxy as from the engine,
before the engine sees the request; the same keep-alive connection then serves the client's next request.
An unknown route is a JSON 404 too."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from kvtune.front.body import DEFAULT_MAX_REQUEST_BODY_BYTES, MAX_JSON_DEPTH
from tests.front.fronts import AUTH, Front
from tests.front.refusals import GOOD_COMPLETION, assert_openai_error, assert_refused_then_served

JSON_HEADERS = {"content-type": "application/json"}
ADMIN_HEADERS = {**JSON_HEADERS, **AUTH}
ROUTES = ["/v1/completions", "/v1/chat/completions"]

BAD_BODIES = [
    pytest.param(b'{"model": "tiny", "prompt": "caf\xe9", "max_tokens": 2}', "not valid UTF-8", id="latin-1"),
    pytest.param(b'{"prompt": "\xff"}', "not valid UTF-8", id="invalid-byte"),
    pytest.param(b'{"prompt": "\xed\xa0\x80"}', "not valid UTF-8", id="utf-8-encoded-surrogate"),
    pytest.param(b'{"prompt": "\xe2\x82"}', "not valid UTF-8", id="truncated-sequence"),
    pytest.param(b'{"prompt": "\xc0\xaf"}', "not valid UTF-8", id="overlong-encoding"),
    pytest.param(b"\xff\xfe", "not valid UTF-8", id="not-utf-8"),
    pytest.param(b'{"model": "tiny", "prompt": ', "not valid JSON", id="truncated-json"),
    pytest.param(b"{not json", "not valid JSON", id="malformed-json"),
    pytest.param(b"", "not valid JSON", id="empty"),
    pytest.param(b'{"prompt": "\\ud800", "max_tokens": 2}', "unpaired UTF-16 surrogate", id="lone-surrogate"),
    pytest.param(b'{"a": ' * 80 + b"1" + b"}" * 80, f"deeper than {MAX_JSON_DEPTH} levels", id="too-deep"),
    pytest.param(b'["model", "tiny"]', "must be a JSON object", id="a-list"),
    pytest.param(b"null", "must be a JSON object", id="null"),
    pytest.param(b'"just a string"', "must be a JSON object", id="a-string"),
]


def nested_lists(depth: int) -> str:
    return "[" * depth + "]" * depth


def chunks(data: bytes, size: int = 256 * 1024) -> Iterator[bytes]:
    """The body as an iterator, so httpx sends it chunked, without a Content-Length."""
    for start in range(0, len(data), size):
        yield data[start : start + size]


def padded_body(size: int) -> bytes:
    """A valid completion request of exactly `size` bytes (JSON whitespace as padding)."""
    body = json.dumps(GOOD_COMPLETION).encode()
    return body + b" " * (size - len(body))


# --- malformed bodies -------------------------------------------------------------------------------------
@pytest.mark.parametrize(("raw", "message"), BAD_BODIES)
@pytest.mark.parametrize("path", ROUTES)
def test_a_bad_body_is_the_engines_400_and_never_reaches_it(
    front: Front, client: httpx.Client, direct: httpx.Client, path: str, raw: bytes, message: str
) -> None:
    served_before = front.engine_requests()
    response = client.post(path, content=raw, headers=JSON_HEADERS)
    assert_refused_then_served(client, response, 400)
    error = response.json()["error"]
    assert message in error["message"]
    assert error["type"] == "invalid_request_error"
    assert front.engine_requests() == served_before + 1  # the good request after it, alone
    assert direct.post(path, content=raw, headers=JSON_HEADERS).json()["error"]["message"] == error["message"]


def test_a_nan_in_the_body_is_a_400(client: httpx.Client) -> None:
    raw = b'{"prompt": "x", "max_tokens": NaN}'  # Python's json reads NaN; max_tokens must be an integer
    for path in ROUTES:
        assert_refused_then_served(client, client.post(path, content=raw, headers=JSON_HEADERS), 400)


def test_an_unknown_route_is_a_json_404(client: httpx.Client) -> None:
    missing = client.get("/v1/nothing-here")
    assert_openai_error(missing, 404)
    assert missing.json()["error"]["type"] == "not_found_error"


# --- body size --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_body_over_the_limit_is_a_413_and_the_connection_serves_on(
    client: httpx.Client, chunked: bool
) -> None:
    body = b'{"prompt": "' + b"y" * (2 * DEFAULT_MAX_REQUEST_BODY_BYTES) + b'"}'
    content = chunks(body) if chunked else body
    response = client.post("/v1/completions", content=content, headers=JSON_HEADERS)
    assert_refused_then_served(client, response, 413)
    assert response.json()["error"]["message"] == (
        f"the request body is larger than the server's limit of {DEFAULT_MAX_REQUEST_BODY_BYTES} bytes"
    )
    assert client.get("/health").status_code == 200


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_body_exactly_at_the_limit_is_read(client: httpx.Client, chunked: bool) -> None:
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
def test_an_unpaired_surrogate_is_a_400_naming_where(
    client: httpx.Client, path: str, body: str, param: str
) -> None:
    response = client.post(path, content=body.encode(), headers=JSON_HEADERS)
    assert_refused_then_served(client, response, 400)
    error = response.json()["error"]
    assert "surrogate" in error["message"]
    assert error["param"] == param


def test_an_escaped_surrogate_pair_and_an_escaped_backslash_are_valid(client: httpx.Client) -> None:
    emoji = rb'{"prompt": "smile \ud83d\ude00", "max_tokens": 1}'  # how json.dumps(ensure_ascii) sends one
    assert client.post("/v1/completions", content=emoji, headers=JSON_HEADERS).status_code == 200
    backslash = rb'{"prompt": "a path C:\\ud800", "max_tokens": 1}'  # a backslash, then the text "ud800"
    assert client.post("/v1/completions", content=backslash, headers=JSON_HEADERS).status_code == 200
    chat = {"messages": [{"role": "user", "content": "\U0001f600"}], "max_tokens": 1}
    assert (
        client.post("/v1/chat/completions", content=json.dumps(chat), headers=JSON_HEADERS).status_code == 200
    )
