"""Through the proxy, a client gets what the upstream sends: the same answers, the same streamed events,
the same errors (status, body, content type)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.proxy.live_proxy import LiveProxy

COMPLETION = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0}
CHAT = {
    "model": "tiny",
    "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}],
    "max_tokens": 8,
    "temperature": 0,
}
ROUTES = [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)]


def without_ids(value: Any) -> Any:
    """An answer with the fields that differ between two runs of the same request (id, time) removed."""
    if isinstance(value, dict):
        return {k: without_ids(v) for k, v in value.items() if k not in ("id", "created")}
    if isinstance(value, list):
        return [without_ids(v) for v in value]
    return value


def stream_events(http: httpx.Client, path: str, body: dict[str, Any]) -> tuple[httpx.Headers, list[str]]:
    """The data lines of one streamed answer, in order, as they arrived."""
    with http.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200
        return response.headers, [line for line in response.iter_lines() if line.startswith("data:")]


@pytest.mark.parametrize(("path", "body"), ROUTES)
def test_plain_answer_matches_direct(
    client: httpx.Client, direct: httpx.Client, path: str, body: dict
) -> None:
    via_proxy = client.post(path, json=body)
    straight = direct.post(path, json=body)
    assert via_proxy.status_code == straight.status_code == 200
    assert via_proxy.headers["content-type"] == straight.headers["content-type"]
    assert without_ids(via_proxy.json()) == without_ids(straight.json())
    assert via_proxy.json()["usage"]["completion_tokens"] == 8


@pytest.mark.parametrize(("path", "body"), ROUTES)
def test_stream_has_the_same_events_as_direct(
    client: httpx.Client, direct: httpx.Client, path: str, body: dict
) -> None:
    proxy_headers, via_proxy = stream_events(client, path, body)
    _, straight = stream_events(direct, path, body)
    assert proxy_headers["content-type"].startswith("text/event-stream")
    assert len(via_proxy) == len(straight) > 8
    assert via_proxy[-1] == straight[-1] == "data: [DONE]"
    parsed = [without_ids(json.loads(line[len("data: ") :])) for line in via_proxy[:-1]]
    assert parsed == [without_ids(json.loads(line[len("data: ") :])) for line in straight[:-1]]


def test_models_is_the_upstream_list(client: httpx.Client, direct: httpx.Client) -> None:
    via_proxy = client.get("/v1/models")
    assert via_proxy.status_code == 200
    assert without_ids(via_proxy.json()) == without_ids(direct.get("/v1/models").json())
    assert via_proxy.json()["data"][0]["id"] == "tiny"


def test_health_reports_the_upstream(client: httpx.Client, proxy: LiveProxy) -> None:
    response = client.get("/health")
    assert response.status_code == 200
    assert response.json() == {"status": "ok", "upstream": proxy.core.upstream.base_url}


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        ("/v1/completions", {**COMPLETION, "model": "no-such-model"}, 404),
        ("/v1/completions", {**COMPLETION, "temperature": -1}, 400),
        ("/v1/chat/completions", {**CHAT, "messages": []}, 400),
    ],
)
def test_upstream_errors_pass_through_unchanged(
    client: httpx.Client, direct: httpx.Client, path: str, body: dict, status: int
) -> None:
    via_proxy = client.post(path, json=body)
    straight = direct.post(path, json=body)
    assert via_proxy.status_code == straight.status_code == status
    assert via_proxy.headers["content-type"] == straight.headers["content-type"]
    assert via_proxy.content == straight.content


def test_prompt_beyond_the_context_is_a_clear_400(client: httpx.Client, direct: httpx.Client) -> None:
    """The upstream's own refusal, passed through: it names the limit (text and token ids alike)."""
    for prompt in ("q" * 2500, [3 + i % 250 for i in range(2500)]):
        check_too_long(client, direct, {"model": "tiny", "prompt": prompt, "max_tokens": 4})


def check_too_long(client: httpx.Client, direct: httpx.Client, body: dict) -> None:
    via_proxy = client.post("/v1/completions", json=body)
    assert via_proxy.status_code == 400
    assert via_proxy.content == direct.post("/v1/completions", json=body).content
    message = via_proxy.json()["error"]["message"]
    assert "2048" in message, message
