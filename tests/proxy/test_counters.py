"""After a mix of every way a request can end, each request is counted exactly once, as completed, failed or
rejected, nothing is left in flight, and the histograms saw each request once. This proxy is started from
the cap flags (reject mode), the way an operator would deploy it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.proxy.live_proxy import LiveProxy, start_proxy
from tests.server.live_server import LiveServer, Samples, scrape

JSON = {"content-type": "application/json"}
PROMPT = {"model": "tiny", "prompt": "Count to ten:", "temperature": 0}


@pytest.fixture()
def capped_proxy(upstream: LiveServer, tiny_dir: Path) -> Iterator[LiveProxy]:
    live = start_proxy(
        upstream.url, tiny_dir, "--max-tokens-cap", "16", "--cap-mode", "reject",
        "--max-request-body-bytes", "4096",
    )  # fmt: skip
    yield live
    live.stop()


def by_labels(samples: Samples, name: str) -> dict[tuple[str, ...], float]:
    return {tuple(labels.values()): value for labels, value in samples[name]}


def test_every_request_is_counted_once(capped_proxy: LiveProxy, upstream: LiveServer) -> None:
    with httpx.Client(base_url=capped_proxy.url, timeout=60) as http:
        assert http.post("/v1/completions", json={**PROMPT, "max_tokens": 4}).status_code == 200
        with http.stream(
            "POST", "/v1/completions", json={**PROMPT, "max_tokens": 4, "stream": True}
        ) as stream:
            assert stream.read().endswith(b"data: [DONE]\n\n")
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        assert http.post("/v1/chat/completions", json=chat).status_code == 200
        assert http.get("/v1/models").status_code == 200
        assert (
            http.post("/v1/completions", json={**PROMPT, "model": "gone", "max_tokens": 2}).status_code == 404
        )
        assert http.post("/v1/completions", json={**PROMPT, "max_tokens": 17}).status_code == 400  # the cap
        assert http.post("/v1/completions", content=b'{"prompt": "\xff"}', headers=JSON).status_code == 400
        assert http.post("/v1/chat/completions", content=b"{", headers=JSON).status_code == 400
        big = b'{"prompt": "' + b"x" * 5000 + b'"}'
        assert http.post("/v1/completions", content=big, headers=JSON).status_code == 413
        long_stream = {**PROMPT, "max_tokens": 16, "ignore_eos": True, "stream": True}
        with http.stream("POST", "/v1/completions", json=long_stream) as stream:
            next(stream.iter_lines())  # then hang up
    upstream.wait_idle()
    with httpx.Client(base_url=capped_proxy.url, timeout=60) as http:
        samples = scrape(http)
    assert by_labels(samples, "kvtune:proxy_requests_total") == {
        ("completions", "completed"): 2,
        ("completions", "failed"): 2,  # the upstream's 404, the client that hung up
        ("completions", "rejected"): 3,  # the cap, invalid UTF-8, too big
        ("chat_completions", "completed"): 1,
        ("chat_completions", "failed"): 0,
        ("chat_completions", "rejected"): 1,  # invalid JSON
        ("models", "completed"): 1,
        ("models", "failed"): 0,
        ("models", "rejected"): 0,
    }
    assert by_labels(samples, "kvtune:proxy_upstream_errors_total") == {
        ("connect",): 0,
        ("timeout",): 0,
        ("closed_mid_stream",): 0,
        ("http_status",): 1,
    }
    assert by_labels(samples, "kvtune:capped_requests_total") == {
        ("clamp",): 0,
        ("reject",): 1,
        ("default",): 0,
    }
    assert samples["kvtune:max_tokens_cap"][0][1] == 16
    assert samples["kvtune:proxy_in_flight"][0][1] == 0
    durations = by_labels(samples, "kvtune:proxy_request_duration_seconds_count")
    assert durations == {("completions",): 7, ("chat_completions",): 2, ("models",): 1}
    first_bytes = by_labels(samples, "kvtune:proxy_time_to_first_byte_seconds_count")
    assert first_bytes == {("completions",): 4, ("chat_completions",): 1, ("models",): 1}
