"""`cache_salt` (vLLM's request field) on `kvtune serve`: identical prompts under different salts share no
prefix-cache block; under one salt they share as unsalted prompts do."""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import pytest

from tests.server.live_server import LiveServer


def _hit(client: httpx.Client, server: LiveServer, route: str, body: dict[str, Any]) -> int:
    """Prompt tokens the request found in the prefix cache (the engine's own count, read on its thread)."""
    before = server.on_engine(lambda e: e.counters.prefix_cache_hits)
    response = client.post(route, json={"max_tokens": 1, **body})
    assert response.status_code == 200, response.text
    server.wait_idle()
    return server.on_engine(lambda e: e.counters.prefix_cache_hits) - before


@pytest.mark.parametrize(
    ("route", "prompt"),
    [
        ("/v1/completions", lambda text: {"prompt": text}),
        ("/v1/chat/completions", lambda text: {"messages": [{"role": "system", "content": text}]}),
    ],
)
def test_salts_split_identical_prompts_and_one_salt_shares(
    client: httpx.Client, server: LiveServer, route: str, prompt: Any
) -> None:
    body = prompt(f"{uuid.uuid4().hex} " + "a shared document, " * 8)  # ~180 tokens: 11 full blocks
    first = _hit(client, server, route, {**body, "cache_salt": "tenant-a"})
    assert first == 0
    assert _hit(client, server, route, {**body, "cache_salt": "tenant-b"}) == 0
    assert _hit(client, server, route, body) == 0  # unsalted: a chain of its own too
    same_salt = _hit(client, server, route, {**body, "cache_salt": "tenant-a"})
    unsalted_again = _hit(client, server, route, body)
    assert same_salt == unsalted_again >= 10 * 16


@pytest.mark.parametrize("salt", ["", 7, ["a"]])
def test_a_salt_that_is_not_a_non_empty_string_is_a_400(client: httpx.Client, salt: Any) -> None:
    response = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "cache_salt": salt})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "cache_salt"
