"""The max_tokens cap in front of an engine: clamp (and the header), reject (a 400 the upstream never sees),
the cap as default, live changes through the admin API, and the counters by mode."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from kvtune.contract.admin import CAP_HEADER
from kvtune.harness.local_http import free_port
from tests.proxy.live_proxy import ADMIN_TOKEN, LiveProxy, start_proxy
from tests.server.live_server import LiveServer, Samples, scrape

AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
LONG_ANSWER = {"model": "tiny", "prompt": "Count:", "temperature": 0, "ignore_eos": True}


def set_cap(client: httpx.Client, **fields: object) -> dict:
    response = client.patch("/admin/config", json=fields, headers=AUTH)
    assert response.status_code == 200, response.text
    return dict(response.json())


def capped(samples: Samples, mode: str) -> float:
    return next(v for labels, v in samples["kvtune:capped_requests_total"] if labels["mode"] == mode)


def engine_requests(upstream: LiveServer) -> int:
    return sum(upstream.counters().finished.values())


def test_clamp_lowers_max_tokens_and_says_so(client: httpx.Client) -> None:
    before = scrape(client)
    assert set_cap(client, max_tokens_cap=5) == {"max_tokens_cap": 5, "cap_mode": "clamp"}
    response = client.post("/v1/completions", json={**LONG_ANSWER, "max_tokens": 50})
    assert response.status_code == 200
    assert response.headers[CAP_HEADER] == "capped from 50 to 5"
    assert response.json()["usage"]["completion_tokens"] == 5
    under = client.post("/v1/completions", json={**LONG_ANSWER, "max_tokens": 3})
    assert CAP_HEADER not in under.headers
    assert under.json()["usage"]["completion_tokens"] == 3
    after = scrape(client)
    assert capped(after, "clamp") == capped(before, "clamp") + 1
    assert after["kvtune:max_tokens_cap"][0][1] == 5


def test_cap_is_the_default_for_an_absent_max_tokens(client: httpx.Client) -> None:
    before = scrape(client)
    set_cap(client, max_tokens_cap=4)
    response = client.post("/v1/completions", json=LONG_ANSWER)
    assert response.headers[CAP_HEADER] == "defaulted to 4"
    assert response.json()["usage"]["completion_tokens"] == 4
    assert capped(scrape(client), "default") == capped(before, "default") + 1


def test_chat_clamps_max_completion_tokens_and_streams_with_the_header(client: httpx.Client) -> None:
    set_cap(client, max_tokens_cap=3)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}
    response = client.post("/v1/chat/completions", json={**chat, "max_completion_tokens": 40})
    assert response.headers[CAP_HEADER] == "capped from 40 to 3"
    assert response.json()["usage"]["completion_tokens"] == 3
    body = {**chat, "max_tokens": 40, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/chat/completions", json=body) as streamed:
        assert streamed.headers[CAP_HEADER] == "capped from 40 to 3"
        lines = [line for line in streamed.iter_lines() if line.startswith("data:")]
    assert '"completion_tokens":3' in lines[-2].replace(" ", "")


def test_reject_answers_400_without_touching_the_upstream(client: httpx.Client, upstream: LiveServer) -> None:
    before = scrape(client)
    set_cap(client, max_tokens_cap=5, cap_mode="reject")
    upstream.wait_idle()
    served_before = engine_requests(upstream)
    response = client.post("/v1/completions", json={**LONG_ANSWER, "max_tokens": 50})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert "exceeds this server's cap of 5" in error["message"]
    assert engine_requests(upstream) == served_before
    within = client.post("/v1/completions", json={**LONG_ANSWER, "max_tokens": 5})
    assert within.status_code == 200
    after = scrape(client)
    assert capped(after, "reject") == capped(before, "reject") + 1
    rejected = [
        v
        for labels, v in after["kvtune:proxy_requests_total"]
        if labels == {"endpoint": "completions", "outcome": "rejected"}
    ]
    rejected_before = [
        v
        for labels, v in before["kvtune:proxy_requests_total"]
        if labels == {"endpoint": "completions", "outcome": "rejected"}
    ]
    assert rejected[0] == rejected_before[0] + 1


def test_a_non_integer_max_tokens_under_a_cap_is_a_clear_400(client: httpx.Client) -> None:
    set_cap(client, max_tokens_cap=5)
    response = client.post("/v1/completions", json={**LONG_ANSWER, "max_tokens": "lots"})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == 'max_tokens must be an integer, got "lots"'
    assert response.json()["error"]["param"] == "max_tokens"


def test_admin_api_changes_the_cap_live_and_removes_it(client: httpx.Client, proxy: LiveProxy) -> None:
    assert client.get("/admin/config", headers=AUTH).json() == {"max_tokens_cap": None, "cap_mode": "clamp"}
    set_cap(client, max_tokens_cap=2)
    assert (
        client.post("/v1/completions", json={**LONG_ANSWER, "max_tokens": 9}).json()["usage"][
            "completion_tokens"
        ]
        == 2
    )
    assert set_cap(client, cap_mode="reject") == {"max_tokens_cap": 2, "cap_mode": "reject"}
    assert set_cap(client, max_tokens_cap=None) == {"max_tokens_cap": None, "cap_mode": "reject"}
    free = client.post("/v1/completions", json={**LONG_ANSWER, "max_tokens": 9})
    assert free.json()["usage"]["completion_tokens"] == 9
    assert CAP_HEADER not in free.headers
    assert scrape(client)["kvtune:max_tokens_cap"][0][1] == 0


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"max_tokens_cap": 0}, "greater than or equal to 1"),
        ({"max_tokens_cap": "10"}, "valid integer"),
        ({"cap_mode": "truncate"}, "'clamp' or 'reject'"),
        ({"cap_mode": None}, "cap_mode cannot be null"),
        ({"max_num_seqs": 4}, "Extra inputs are not permitted"),
    ],
)
def test_admin_api_refuses_bad_patches_and_changes_nothing(
    client: httpx.Client, patch: dict, message: str
) -> None:
    set_cap(client, max_tokens_cap=7)
    response = client.patch("/admin/config", json=patch, headers=AUTH)
    assert response.status_code == 400
    assert message in response.json()["error"]["message"]
    assert client.get("/admin/config", headers=AUTH).json() == {"max_tokens_cap": 7, "cap_mode": "clamp"}


def test_admin_api_needs_the_token(client: httpx.Client) -> None:
    for response in (
        client.get("/admin/config"),
        client.patch("/admin/config", json={"max_tokens_cap": 1}, headers={"Authorization": "Bearer wrong"}),
    ):
        assert response.status_code == 401
        assert response.headers["www-authenticate"] == "Bearer"
        assert response.json()["error"]["type"] == "authentication_error"
    assert client.get("/admin/config", headers=AUTH).json()["max_tokens_cap"] is None


def test_admin_port_keeps_the_admin_api_off_the_main_port(
    upstream: LiveServer, tiny_dir: Path, tmp_path: Path
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(ADMIN_TOKEN)
    admin_port = free_port()
    live = start_proxy(
        upstream.url, tiny_dir, "--admin-token-file", str(token_file), "--admin-port", str(admin_port)
    )
    try:
        with (
            httpx.Client(base_url=live.url, timeout=30) as main,
            httpx.Client(base_url=f"http://127.0.0.1:{admin_port}", timeout=30) as admin,
        ):
            assert main.get("/admin/config", headers=AUTH).status_code == 404
            assert set_cap(admin, max_tokens_cap=2) == {"max_tokens_cap": 2, "cap_mode": "clamp"}
            answer = main.post("/v1/completions", json={**LONG_ANSWER, "max_tokens": 9})
            assert answer.json()["usage"]["completion_tokens"] == 2
    finally:
        live.stop()
