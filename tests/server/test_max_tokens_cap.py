"""The max_tokens cap where only `kvtune serve` has it: completions keep OpenAI's default of 16 under a
larger cap, a request the engine refuses is not counted as capped, and the default never exceeds the room
the context leaves. What both fronts share (clamp, reject, default, live changes, the counters) is tested in
tests/front/test_max_tokens_cap_live.py."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvtune.contract.admin import CAP_HEADER
from kvtune.engine.http.serving import MaxTokensOverCapError, choose_max_tokens
from tests.server.live_server import ADMIN_TOKEN, LiveServer, Samples, scrape

AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def capped(samples: Samples, mode: str) -> float:
    return sum(value for labels, value in samples["kvtune:capped_requests_total"] if labels["mode"] == mode)


@pytest.fixture()
def cap(client: httpx.Client) -> Iterator[Any]:
    """Set the live cap (and mode) through the admin API; the test's end takes it off again."""

    def set_cap(value: int | None, mode: str = "clamp") -> None:
        response = client.patch(
            "/admin/config", json={"max_tokens_cap": value, "cap_mode": mode}, headers=AUTH
        )
        assert response.status_code == 200, response.text
        assert (response.json()["max_tokens_cap"], response.json()["cap_mode"]) == (value, mode)

    yield set_cap
    set_cap(None)


def completion(client: httpx.Client, **body: Any) -> httpx.Response:
    return client.post("/v1/completions", json={"prompt": "cap me", "ignore_eos": True, **body})


def test_completions_keep_their_default_of_16_under_a_larger_cap(client: httpx.Client, cap: Any) -> None:
    """OpenAI's completions default max_tokens to 16: a cap above it must not lengthen the answer."""
    cap(100)
    answer = client.post("/v1/completions", json={"prompt": "hi", "ignore_eos": True})
    assert CAP_HEADER not in answer.headers
    assert answer.json()["usage"]["completion_tokens"] == 16


def test_a_request_the_engine_refuses_is_not_counted_as_capped(client: httpx.Client, cap: Any) -> None:
    cap(2)
    before = scrape(client)
    refused = completion(client, prompt=[10**6], max_tokens=50)  # a token id outside the vocabulary
    assert refused.status_code == 400 and "vocabulary" in refused.json()["error"]["message"]
    assert capped(scrape(client), "clamp") == capped(before, "clamp")


def test_the_default_never_exceeds_what_the_context_leaves(server: LiveServer) -> None:
    limit = server.built.engine.max_model_len
    assert choose_max_tokens(None, 1000, limit, limit, "clamp").max_tokens == limit - 1000
    assert choose_max_tokens(None, 1000, limit, 10, "clamp").max_tokens == 10
    assert choose_max_tokens(None, 1000, limit, None, "clamp").max_tokens == limit - 1000
    assert choose_max_tokens(None, 1000, limit, None, "clamp").headers == {}
    with pytest.raises(MaxTokensOverCapError, match="ask for at most 10"):
        choose_max_tokens(11, 5, limit, 10, "reject")
