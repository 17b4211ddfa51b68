"""What every refusal of both fronts looks like: OpenAI's JSON error body with a 4xx status, on a keep-alive
connection that then serves the client's next request."""

from __future__ import annotations

import httpx

GOOD_COMPLETION = {"prompt": "still here", "max_tokens": 2, "ignore_eos": True}


def assert_openai_error(response: httpx.Response, status: int) -> None:
    """`response` is a `status` answer whose JSON body is OpenAI's error object, with a message."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]


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
