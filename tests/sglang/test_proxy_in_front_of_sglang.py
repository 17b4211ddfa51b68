"""`kvtune proxy` in front of SGLang's recorded API: its answers, its error and its stream reach the client
byte for byte with their status and content type, each request is counted once, the detector is fed, and
the cap clamps (or rejects) what reaches SGLang."""

from __future__ import annotations

import httpx

from kvtune.contract.admin import CAP_HEADER
from tests.proxy.live_proxy import ADMIN_TOKEN, TENANT_HEADER, LiveProxy
from tests.proxy.prefix_chats import stamped_chat
from tests.server.live_server import Samples, scrape
from tests.sglang.stand_in import CONTEXT_LEN, SGLangStandIn, recorded_events

COMPLETION = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8}
AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def by_labels(samples: Samples, name: str) -> dict[tuple[str, ...], float]:
    return {tuple(labels.values()): value for labels, value in samples[name]}


def test_models_and_answers_pass_through_byte_for_byte(client: httpx.Client, sglang: SGLangStandIn) -> None:
    for method, path, body, key in (
        ("GET", "/v1/models", None, "GET /v1/models"),
        ("POST", "/v1/completions", COMPLETION, "POST /v1/completions"),
        ("POST", "/v1/chat/completions", CHAT, "POST /v1/chat/completions"),
    ):
        recorded = sglang.answers[key]
        response = client.request(method, path, json=body)
        assert (response.status_code, response.content) == (recorded.status, recorded.body), key
        assert response.headers["content-type"] == recorded.content_type
    assert client.get("/v1/models").json()["data"][0]["owned_by"] == "sglang"


def test_sglang_400_passes_through_unchanged(client: httpx.Client, sglang: SGLangStandIn) -> None:
    """SGLang's error is flat ({"object": "error", ...}), not OpenAI's {"error": {...}}: the proxy must not
    rewrap it."""
    recorded = sglang.answers["POST /v1/completions prompt too long"]
    response = client.post("/v1/completions", json={**COMPLETION, "prompt": "x" * (CONTEXT_LEN + 10)})
    assert response.status_code == 400
    assert response.content == recorded.body
    assert response.headers["content-type"] == recorded.content_type
    assert response.json()["object"] == "error" and "context length" in response.json()["message"]


def test_the_stream_arrives_event_for_event(client: httpx.Client, sglang: SGLangStandIn) -> None:
    recorded = sglang.answers["POST /v1/chat/completions stream"]
    with client.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"] == recorded.content_type
        body = response.read()
    assert body == recorded.body
    events = recorded_events(recorded)
    assert len(events) == 11 and events[-1] == b"data: [DONE]\n\n"


def test_each_request_is_counted_once(client: httpx.Client, sglang: SGLangStandIn) -> None:
    assert client.get("/v1/models").status_code == 200
    assert client.post("/v1/completions", json=COMPLETION).status_code == 200
    too_long = {**COMPLETION, "prompt": "y" * CONTEXT_LEN}
    assert client.post("/v1/completions", json=too_long).status_code == 400
    assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
    with client.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as stream:
        assert stream.read().endswith(b"data: [DONE]\n\n")
    assert client.get("/health").json()["status"] == "ok"  # SGLang's empty 200 reads as healthy
    samples = scrape(client)
    requests = by_labels(samples, "kvtune:proxy_requests_total")
    assert requests[("completions", "completed")] == 1
    assert requests[("completions", "failed")] == 1  # SGLang's 400, passed through
    assert requests[("chat_completions", "completed")] == 2
    assert requests[("models", "completed")] == 1
    assert sum(requests.values()) == 5
    assert by_labels(samples, "kvtune:proxy_upstream_errors_total")[("http_status",)] == 1
    assert samples["kvtune:proxy_in_flight"][0][1] == 0
    assert [path for path, _ in sglang.received.snapshot()] == [
        "/v1/completions", "/v1/completions", "/v1/chat/completions", "/v1/chat/completions",
    ]  # fmt: skip


def test_the_detector_sees_prompts_bound_for_sglang(
    proxy: LiveProxy, client: httpx.Client, sglang: SGLangStandIn
) -> None:
    for i in range(8):
        response = client.post("/v1/chat/completions", json=stamped_chat(i), headers={TENANT_HEADER: "t"})
        assert response.status_code == 200
    proxy.core.watch.drain()
    report = client.get("/kvtune/prefix-report").json()
    assert report["observed"] == 8 and report["block_size"] == 16
    assert report["reasons"]["varying_head"]["defeats"] >= 6
    defeats = by_labels(scrape(client), "kvtune:prefix_defeats_total")
    assert defeats[("varying_head",)] == report["reasons"]["varying_head"]["defeats"]
    assert len(sglang.received.snapshot()) == 8  # the detector watched; every request still went through


def test_the_cap_clamps_what_reaches_sglang(client: httpx.Client, sglang: SGLangStandIn) -> None:
    assert client.patch("/admin/config", json={"max_tokens_cap": 16}, headers=AUTH).status_code == 200
    clamped = client.post("/v1/completions", json={**COMPLETION, "max_tokens": 500})
    assert clamped.status_code == 200 and clamped.headers[CAP_HEADER] == "capped from 500 to 16"
    unset = {key: value for key, value in CHAT.items() if key != "max_tokens"}
    assert client.post("/v1/chat/completions", json=unset).status_code == 200
    newer_field = {**unset, "max_completion_tokens": 64}
    assert client.post("/v1/chat/completions", json=newer_field).status_code == 200
    under = client.post("/v1/completions", json={**COMPLETION, "max_tokens": 4})
    assert CAP_HEADER not in under.headers
    received = [body for _, body in sglang.received.snapshot()]
    assert received[0]["max_tokens"] == 16 and received[0]["prompt"] == COMPLETION["prompt"]
    assert received[1]["max_tokens"] == 16  # the cap is the default of a request without one
    assert received[2]["max_completion_tokens"] == 16
    assert received[3]["max_tokens"] == 4

    policy = {"max_tokens_cap": 16, "cap_mode": "reject"}
    assert client.patch("/admin/config", json=policy, headers=AUTH).status_code == 200
    rejected = client.post("/v1/completions", json={**COMPLETION, "max_tokens": 500})
    assert rejected.status_code == 400 and "16" in rejected.json()["error"]["message"]
    assert len(sglang.received.snapshot()) == 4  # a rejected request never reaches SGLang
    capped = by_labels(scrape(client), "kvtune:capped_requests_total")
    assert capped == {("clamp",): 2, ("reject",): 1, ("default",): 1}
