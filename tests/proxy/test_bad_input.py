"""Bodies refused at the proxy's intake get the engine's own 400/413 answers, and never reach the upstream."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.server.live_server import LiveServer

JSON = {"content-type": "application/json"}
BAD_BODIES = [
    pytest.param(
        b'{"model": "tiny", "prompt": "caf\xe9", "max_tokens": 2}', "not valid UTF-8", id="invalid-utf8"
    ),
    pytest.param(b'{"model": "tiny", "prompt": ', "not valid JSON", id="invalid-json"),
    pytest.param(b'{"prompt": "\\ud800", "max_tokens": 2}', "unpaired UTF-16 surrogate", id="lone-surrogate"),
    pytest.param(b'{"a": ' * 80 + b"1" + b"}" * 80, "deeper than 64 levels", id="too-deep"),
    pytest.param(b'["model", "tiny"]', "must be a JSON object", id="not-an-object"),
]


def engine_requests(upstream: LiveServer) -> int:
    return sum(upstream.counters().finished.values())


@pytest.mark.parametrize(("raw", "message"), BAD_BODIES)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_bad_body_is_the_engines_400(
    client: httpx.Client, direct: httpx.Client, upstream: LiveServer, path: str, raw: bytes, message: str
) -> None:
    upstream.wait_idle()
    served_before = engine_requests(upstream)
    response = client.post(path, content=raw, headers=JSON)
    assert response.status_code == 400
    error = response.json()["error"]
    assert message in error["message"]
    assert error["type"] == "invalid_request_error"
    assert engine_requests(upstream) == served_before
    assert direct.post(path, content=raw, headers=JSON).json()["error"]["message"] == error["message"]


def test_body_over_the_limit_is_a_413(client: httpx.Client) -> None:
    body = b'{"model": "tiny", "prompt": "' + b"x" * 70_000 + b'"}'
    response = client.post("/v1/completions", content=body, headers=JSON)
    assert response.status_code == 413
    assert (
        response.json()["error"]["message"]
        == "the request body is larger than the server's limit of 65536 bytes"
    )

    def chunks() -> Iterator[bytes]:
        yield body[:40_000]
        yield body[40_000:]

    chunked = client.post("/v1/completions", content=chunks(), headers=JSON)  # no Content-Length
    assert chunked.status_code == 413
    assert client.get("/health").status_code == 200


def test_unknown_route_is_a_json_404(client: httpx.Client) -> None:
    response = client.get("/v1/nothing-here")
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "not_found_error"
