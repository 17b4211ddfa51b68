"""The prefix-defeat detector fed through the proxy: prompts tokenized with the upstream's tokenizer and chat
template, keyed by tenant, exported in /kvtune/prefix-report and /metrics; prompt text only when opted in."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.proxy.live_proxy import TENANT_HEADER, LiveProxy, start_proxy
from tests.proxy.prefix_chats import SHARED_SYSTEM_PROMPT, clean_chat, stamped_chat
from tests.server.live_server import LiveServer, scrape


def defeats(samples: dict, name: str, reason: str) -> float:
    return next(v for labels, v in samples[name] if labels == {"reason": reason})


def send(http: httpx.Client, bodies: list[dict], tenant: str) -> None:
    for body in bodies:
        assert (
            http.post("/v1/chat/completions", json=body, headers={TENANT_HEADER: tenant}).status_code == 200
        )


def test_a_timestamp_at_the_head_is_reported_as_varying_head(proxy: LiveProxy, client: httpx.Client) -> None:
    before = client.get("/kvtune/prefix-report").json()
    send(client, [clean_chat(i) for i in range(6)], tenant="clean-tenant")
    proxy.core.watch.drain()
    clean = client.get("/kvtune/prefix-report").json()
    assert clean["observed"] == before["observed"] + 6
    assert {r: v["defeats"] for r, v in clean["reasons"].items()} == {
        r: v["defeats"] for r, v in before["reasons"].items()
    }, "clean shared-prefix traffic must not be flagged"

    send(client, [stamped_chat(i) for i in range(8)], tenant="stamped-tenant")
    proxy.core.watch.drain()
    report = client.get("/kvtune/prefix-report").json()
    varying = report["reasons"]["varying_head"]
    new_defeats = varying["defeats"] - before["reasons"]["varying_head"]["defeats"]
    assert new_defeats >= 6, report
    example = varying["examples"][-1]
    # where the stamps first differ: after the template's BOS and "system: " and the stamps' common start
    assert 9 <= example["span_start"] < 32
    assert example["shared_length"] >= len(SHARED_SYSTEM_PROMPT) - 16
    assert example["tokens_lost"] > 0
    assert "text" not in example and "span_token_ids" not in example  # prompt text needs the opt-in flag
    assert "timestamp" in report["fixes"]["varying_head"] or "varying" in report["fixes"]["varying_head"]
    assert report["block_size"] == 16
    assert report["keys"] >= 2

    samples = scrape(client)
    assert defeats(samples, "kvtune:prefix_defeats_total", "varying_head") == varying["defeats"]
    assert defeats(samples, "kvtune:prefix_defeat_tokens_total", "varying_head") == varying["tokens_lost"]
    for reason in ("shorter_than_block", "misaligned", "salted", "evicted"):
        assert defeats(samples, "kvtune:prefix_defeats_total", reason) >= 0  # every reason is present


def test_cache_salt_reaches_the_detector(proxy: LiveProxy, client: httpx.Client) -> None:
    before = client.get("/kvtune/prefix-report").json()["reasons"]["salted"]["defeats"]
    prompt = SHARED_SYSTEM_PROMPT + "Which aisle?"
    for salt in ("tenant-a", "tenant-b", "tenant-c", "tenant-d"):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "cache_salt": salt}
        response = client.post("/v1/completions", json=body, headers={TENANT_HEADER: "salted-tenant"})
        assert response.status_code == 200
    proxy.core.watch.drain()
    assert client.get("/kvtune/prefix-report").json()["reasons"]["salted"]["defeats"] >= before + 3


@pytest.fixture()
def text_proxy(upstream: LiveServer, tiny_dir: Path) -> Iterator[LiveProxy]:
    live = start_proxy(upstream.url, tiny_dir, "--prefix-report-text")
    yield live
    live.stop()


def test_span_text_only_with_the_opt_in_flag(text_proxy: LiveProxy) -> None:
    with httpx.Client(base_url=text_proxy.url, timeout=60) as http:
        send(http, [stamped_chat(i) for i in range(4)], tenant="ignored: no key header on this proxy")
        text_proxy.core.watch.drain()
        example = http.get("/kvtune/prefix-report").json()["reasons"]["varying_head"]["examples"][-1]
    assert "Z req-" in example["text"]
