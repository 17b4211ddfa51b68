"""The max_tokens cap on both fronts, live: clamp (with its response header, on JSON and streamed answers),
reject (a 400 naming the cap and the field, before the engine sees the request), the cap as the default of
an absent max_tokens, changes through the admin API taking effect on the next request, and
kvtune:capped_requests_total{mode} and kvtune:max_tokens_cap. The decision table itself is
test_max_tokens_cap.py."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from kvtune.contract.admin import CAP_HEADER
from kvtune.contract.metrics import CAPPED_LABELS
from tests.front.fronts import AUTH, Front, proxy_requests
from tests.server.live_server import Samples, scrape

CHAT = [{"role": "user", "content": "tell me everything"}]


def set_cap(client: httpx.Client, front: Front, **patch: Any) -> None:
    """PATCH the cap (and/or its mode); the answer is the whole config, as GET shows it."""
    response = client.patch("/admin/config", json=patch, headers=AUTH)
    assert response.status_code == 200, response.text
    config = response.json()
    assert config == front.config(config["max_tokens_cap"], config["cap_mode"])
    assert {k: config[k] for k in patch} == patch


def capped(samples: Samples, mode: str) -> float:
    return sum(value for labels, value in samples["kvtune:capped_requests_total"] if labels["mode"] == mode)


def cap_gauge(client: httpx.Client) -> float:
    return sum(value for _, value in scrape(client)["kvtune:max_tokens_cap"])


def completion(client: httpx.Client, **body: Any) -> httpx.Response:
    return client.post(
        "/v1/completions", json={"model": "tiny", "prompt": "cap me", "ignore_eos": True, **body}
    )


def chat(client: httpx.Client, **body: Any) -> httpx.Response:
    return client.post(
        "/v1/chat/completions", json={"model": "tiny", "messages": CHAT, "ignore_eos": True, **body}
    )


def tokens(response: httpx.Response) -> int:
    """Completion tokens of an answer: from its usage, or from a stream's usage chunk."""
    assert response.status_code == 200, response.text
    if not response.headers["content-type"].startswith("text/event-stream"):
        return int(response.json()["usage"]["completion_tokens"])
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return int(json.loads(events[-2])["usage"]["completion_tokens"])


STREAM_USAGE = {"stream": True, "stream_options": {"include_usage": True}}


def test_every_mode_is_exported(client: httpx.Client) -> None:
    modes = {labels["mode"] for labels, _ in scrape(client)["kvtune:capped_requests_total"]}
    assert modes == set(CAPPED_LABELS)


def test_clamp_lowers_max_tokens_and_says_so_on_json_and_streamed_answers(
    front: Front, client: httpx.Client
) -> None:
    set_cap(client, front, max_tokens_cap=4, cap_mode="clamp")
    before = scrape(client)
    for response, asked in (
        (completion(client, max_tokens=50), 50),
        (chat(client, max_completion_tokens=40), 40),
        (chat(client, max_completion_tokens=30, **STREAM_USAGE), 30),
        (chat(client, max_tokens=40, **STREAM_USAGE), 40),
    ):
        assert response.headers[CAP_HEADER] == f"capped from {asked} to 4"
        assert tokens(response) == 4
    under = completion(client, max_tokens=3)
    assert CAP_HEADER not in under.headers and tokens(under) == 3
    after = scrape(client)
    assert capped(after, "clamp") == capped(before, "clamp") + 4
    assert capped(after, "reject") == capped(before, "reject")
    assert cap_gauge(client) == 4


def test_reject_answers_400_naming_the_cap_and_the_field_before_the_engine(
    front: Front, client: httpx.Client
) -> None:
    set_cap(client, front, max_tokens_cap=4, cap_mode="reject")
    before = scrape(client)
    served_before = front.engine_requests()
    for response, param in (
        (completion(client, max_tokens=50), "max_tokens"),
        (chat(client, max_completion_tokens=9), "max_completion_tokens"),
        (chat(client, max_tokens=9, stream=True), "max_tokens"),
    ):
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert "exceeds this server's cap of 4" in error["message"]
        assert (error["type"], error["param"]) == ("invalid_request_error", param)
        assert error["code"] == "max_tokens_over_cap"
    assert front.engine_requests() == served_before
    assert tokens(completion(client, max_tokens=4)) == 4
    after = scrape(client)
    assert capped(after, "reject") == capped(before, "reject") + 3
    assert capped(after, "clamp") == capped(before, "clamp")
    if front.proxy is not None:  # the proxy counts its own refusals
        assert (
            proxy_requests(after, "completions", "rejected")
            == proxy_requests(before, "completions", "rejected") + 1
        )
        assert (
            proxy_requests(after, "chat_completions", "rejected")
            == proxy_requests(before, "chat_completions", "rejected") + 2
        )


@pytest.mark.parametrize("mode", ["clamp", "reject"])
def test_an_absent_max_tokens_gets_the_cap_as_its_default(
    front: Front, client: httpx.Client, mode: str
) -> None:
    set_cap(
        client, front, max_tokens_cap=3, cap_mode=mode
    )  # a default is never a rejection, whatever the mode
    before = scrape(client)
    for response in (chat(client), chat(client, **STREAM_USAGE), completion(client, max_tokens=None)):
        assert response.headers[CAP_HEADER] == "defaulted to 3"
        assert tokens(response) == 3
    assert capped(scrape(client), "default") == capped(before, "default") + 3


def test_admin_changes_take_effect_on_the_next_request(front: Front, client: httpx.Client) -> None:
    assert client.get("/admin/config", headers=AUTH).json() == front.config(None, "clamp")
    set_cap(client, front, max_tokens_cap=2, cap_mode="reject")
    assert completion(client, max_tokens=5).status_code == 400
    set_cap(client, front, cap_mode="clamp")  # a partial patch leaves the cap as it is
    answer = completion(client, max_tokens=5)
    assert answer.headers[CAP_HEADER] == "capped from 5 to 2" and tokens(answer) == 2
    set_cap(client, front, cap_mode="reject")
    set_cap(client, front, max_tokens_cap=None)  # null removes the cap and leaves the mode
    assert client.get("/admin/config", headers=AUTH).json() == front.config(None, "reject")
    free = completion(client, max_tokens=9)
    assert CAP_HEADER not in free.headers and tokens(free) == 9
    assert cap_gauge(client) == 0
