"""The max_tokens cap on `kvtune serve`: clamp (with its response header), reject (a 400), the cap as the
default of an absent max_tokens, live changes through the admin API, and kvtune:capped_requests_total{mode}.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvtune.contract.admin import CAP_HEADER
from kvtune.contract.metrics import CAPPED_LABELS
from kvtune.engine.http.request_max_tokens import MaxTokensOverCapError, choose_max_tokens
from tests.server.live_server import ADMIN_TOKEN, LiveServer, Samples, scrape

AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
CHAT = [{"role": "user", "content": "tell me everything"}]


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


def chat(client: httpx.Client, **body: Any) -> httpx.Response:
    return client.post("/v1/chat/completions", json={"messages": CHAT, "ignore_eos": True, **body})


def streamed_tokens(response: httpx.Response) -> int:
    """Completion tokens of a streamed chat answer, from its usage chunk."""
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return int(json.loads(events[-2])["usage"]["completion_tokens"])


def test_every_mode_is_exported_at_zero_before_any_cap(client: httpx.Client) -> None:
    modes = {labels["mode"] for labels, _ in scrape(client)["kvtune:capped_requests_total"]}
    assert modes == set(CAPPED_LABELS)


def test_clamp_lowers_max_tokens_and_says_so_on_json_and_streamed_answers(
    client: httpx.Client, cap: Any
) -> None:
    cap(4)
    before = scrape(client)
    plain = completion(client, max_tokens=50)
    assert plain.status_code == 200, plain.text
    assert plain.headers[CAP_HEADER] == "capped from 50 to 4"
    assert plain.json()["usage"]["completion_tokens"] == 4
    streamed = chat(client, max_completion_tokens=30, stream=True, stream_options={"include_usage": True})
    assert streamed.status_code == 200, streamed.text
    assert streamed.headers[CAP_HEADER] == "capped from 30 to 4"
    assert streamed_tokens(streamed) == 4
    under = completion(client, max_tokens=3)
    assert CAP_HEADER not in under.headers and under.json()["usage"]["completion_tokens"] == 3
    after = scrape(client)
    assert capped(after, "clamp") == capped(before, "clamp") + 2
    assert capped(after, "reject") == capped(before, "reject")


def test_reject_answers_400_naming_the_cap_and_the_field(client: httpx.Client, cap: Any) -> None:
    cap(4, "reject")
    before = scrape(client)
    for response, param in (
        (completion(client, max_tokens=50), "max_tokens"),
        (chat(client, max_completion_tokens=9), "max_completion_tokens"),
        (chat(client, max_tokens=9, stream=True), "max_tokens"),
    ):
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert "exceeds this server's cap of 4" in error["message"]
        assert (error["param"], error["code"]) == (param, "max_tokens_over_cap")
    assert completion(client, max_tokens=4).json()["usage"]["completion_tokens"] == 4
    after = scrape(client)
    assert capped(after, "reject") == capped(before, "reject") + 3
    assert capped(after, "clamp") == capped(before, "clamp")


def test_an_absent_max_tokens_gets_the_cap_as_its_default(client: httpx.Client, cap: Any) -> None:
    cap(3, "reject")  # a default is never a rejection, whatever the mode
    before = scrape(client)
    answer = chat(client)
    assert answer.status_code == 200, answer.text
    assert answer.headers[CAP_HEADER] == "defaulted to 3"
    assert answer.json()["usage"]["completion_tokens"] == 3
    explicit_null = completion(client, max_tokens=None)
    assert explicit_null.json()["usage"]["completion_tokens"] == 3
    assert capped(scrape(client), "default") == capped(before, "default") + 2


def test_completions_keep_their_default_of_16_under_a_larger_cap(client: httpx.Client, cap: Any) -> None:
    """OpenAI's completions default max_tokens to 16: a cap above it must not lengthen the answer."""
    cap(100)
    answer = client.post("/v1/completions", json={"prompt": "hi", "ignore_eos": True})
    assert CAP_HEADER not in answer.headers
    assert answer.json()["usage"]["completion_tokens"] == 16


def test_switching_the_mode_live_takes_effect_on_the_next_request(client: httpx.Client, cap: Any) -> None:
    cap(2, "reject")
    assert completion(client, max_tokens=5).status_code == 400
    cap(2, "clamp")
    answer = completion(client, max_tokens=5)
    assert answer.status_code == 200 and answer.headers[CAP_HEADER] == "capped from 5 to 2"
    cap(None)
    answer = completion(client, max_tokens=5)
    assert CAP_HEADER not in answer.headers and answer.json()["usage"]["completion_tokens"] == 5


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
