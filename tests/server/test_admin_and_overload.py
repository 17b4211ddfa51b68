"""The operator's levers (admin API) and the waiting-queue limit (429 with Retry-After)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvtune.cli import main
from kvtune.engine.loop.thread import DEFAULT_WAITING_PER_SEQ, UNLIMITED_WAITING, AsyncEngine
from tests.server.live_server import ADMIN_TOKEN, LiveServer, scrape, start_server, total

AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
BOUNDS = {"max_num_seqs": 64, "max_tokens_cap": 1024}  # the 1,024-token pool: 64 blocks of 16


@pytest.fixture()
def restore_config(client: httpx.Client) -> Iterator[None]:
    yield
    reset = client.patch(
        "/admin/config", json={"max_num_seqs": 8, "max_tokens_cap": None, "cap_mode": "clamp"}, headers=AUTH
    )
    assert reset.status_code == 200


def test_admin_routes_do_not_exist_without_a_token(narrow_server: LiveServer) -> None:
    with httpx.Client(base_url=narrow_server.url) as http:
        assert http.get("/admin/config", headers=AUTH).status_code == 404
        assert http.patch("/admin/config", json={"max_num_seqs": 2}, headers=AUTH).status_code == 404


@pytest.mark.parametrize(
    "body",
    [
        {"max_num_seqs": 0},
        {"max_num_seqs": -3},
        {"max_num_seqs": "4"},
        {"max_num_seqs": 2.5},
        {"max_num_seqs": True},
        {"max_num_seqs": None},
    ],
)
def test_admin_validation_of_max_num_seqs(client: httpx.Client, body: Any) -> None:
    """The engine's own knob (the cap's checks, shared with the proxy, are in tests/front)."""
    response = client.patch("/admin/config", json=body, headers=AUTH)
    assert response.status_code == 400, response.text
    assert "error" in response.json()


def test_admin_malformed_json(client: httpx.Client) -> None:
    response = client.patch(
        "/admin/config", content=b"{oops", headers={**AUTH, "content-type": "application/json"}
    )
    assert response.status_code == 400


def test_admin_changes_apply_live(client: httpx.Client, restore_config: None) -> None:
    changed = client.patch("/admin/config", json={"max_num_seqs": 3, "max_tokens_cap": 4}, headers=AUTH)
    assert changed.json() == {"max_num_seqs": 3, "max_tokens_cap": 4, "cap_mode": "clamp", "bounds": BOUNDS}
    capped_before = total(scrape(client), "kvtune:capped_requests_total")
    out = client.post(
        "/v1/completions", json={"prompt": "cap me", "max_tokens": 50, "ignore_eos": True}
    ).json()
    assert out["usage"]["completion_tokens"] == 4 and out["choices"][0]["finish_reason"] == "length"
    samples = scrape(client)
    assert total(samples, "kvtune:max_num_seqs") == 3
    assert total(samples, "kvtune:max_tokens_cap") == 4
    assert total(samples, "kvtune:capped_requests_total") == capped_before + 1
    # A partial patch leaves the other field alone; null removes the cap.
    assert client.patch("/admin/config", json={"max_tokens_cap": None}, headers=AUTH).json() == {
        "max_num_seqs": 3,
        "max_tokens_cap": None,
        "cap_mode": "clamp",
        "bounds": BOUNDS,
    }
    assert total(scrape(client), "kvtune:max_tokens_cap") == 0


def test_lowering_max_num_seqs_evicts_nobody(
    client: httpx.Client, server: LiveServer, restore_config: None
) -> None:
    server.wait_idle()
    results: list[dict[str, Any]] = []

    def one() -> None:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            body = {"prompt": "p" * 20, "max_tokens": 120, "ignore_eos": True}
            results.append(http.post("/v1/completions", json=body).json())

    threads = [threading.Thread(target=one) for _ in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 20
    while server.built.async_engine.latest.num_running < 4:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    preempted = server.counters().num_preemptions
    assert client.patch("/admin/config", json={"max_num_seqs": 1}, headers=AUTH).status_code == 200
    assert server.built.async_engine.latest.num_running == 4  # nobody evicted by the change
    for t in threads:
        t.join(60)
    assert [r["usage"]["completion_tokens"] for r in results] == [120] * 4
    assert server.counters().num_preemptions == preempted


def test_waiting_queue_over_the_limit_gets_429(narrow_server: LiveServer) -> None:
    """max_num_seqs 1 and --max-waiting-requests 1: one runs, one waits, the third is refused."""
    body = {"prompt": "w" * 30, "max_tokens": 600, "ignore_eos": True, "stream": True}
    latest = narrow_server.built.async_engine

    def wait_until(check: Any) -> None:
        deadline = time.monotonic() + 20
        while not check():
            assert time.monotonic() < deadline
            time.sleep(0.01)

    with (
        httpx.Client(base_url=narrow_server.url, timeout=60) as http,
        http.stream("POST", "/v1/completions", json=body) as running,
    ):
        assert running.status_code == 200
        wait_until(lambda: latest.latest.num_running == 1)
        with http.stream("POST", "/v1/completions", json=body) as waiting:
            assert waiting.status_code == 200
            wait_until(lambda: latest.latest.num_waiting == 1)
            rejected_before = total(scrape(http), "kvtune:rejected_requests_total")
            with narrow_server.paused():  # the running one cannot finish and free the waiting slot meanwhile
                refused = httpx.post(f"{narrow_server.url}/v1/completions", json={**body, "stream": False})
                refused_chat = httpx.post(
                    f"{narrow_server.url}/v1/chat/completions",
                    json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                )
            assert refused.status_code == 429
            assert int(refused.headers["Retry-After"]) >= 1
            error = refused.json()["error"]
            assert "--max-waiting-requests" in error["message"] and "retry" in error["message"]
            assert error["type"] == error["code"] == "rate_limit_exceeded"
            assert refused_chat.status_code == 429
            wait_until(lambda: total(scrape(http), "kvtune:rejected_requests_total") == rejected_before + 2)
    narrow_server.wait_idle()
    assert narrow_server.blocks_held() == 0
    with httpx.Client(base_url=narrow_server.url, timeout=60) as http:
        ok = http.post("/v1/completions", json={"prompt": "after", "max_tokens": 2})
        assert ok.status_code == 200


@pytest.fixture(scope="module")
def default_bound_server(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """No --max-waiting-requests: the queue is bounded at 4 x the boot max_num_seqs (1)."""
    token_file = tmp_path_factory.mktemp("admin-bound") / "token"
    token_file.write_text(ADMIN_TOKEN + "\n")
    live = start_server(
        tiny_dir, "--kv-cache-tokens", "1024", "--max-num-seqs", "1", "--admin-token-file", str(token_file)
    )
    yield live
    live.stop()


def wait_until(check: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 20
    while not check():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_the_default_queue_bound_is_sized_from_the_boot_max_num_seqs(
    default_bound_server: LiveServer,
) -> None:
    """The operator retuning max_num_seqs must not turn queued work into 429s: the bound stays put."""
    engine = default_bound_server.built.async_engine
    assert engine.waiting_limit == DEFAULT_WAITING_PER_SEQ * 1
    body = {"prompt": "w" * 30, "max_tokens": 600, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=default_bound_server.url, timeout=60) as http:
        assert http.patch("/admin/config", json={"max_num_seqs": 2}, headers=AUTH).status_code == 200
        wait_until(lambda: engine.latest.max_num_seqs == 2)
        assert engine.waiting_limit == DEFAULT_WAITING_PER_SEQ * 1
        assert http.patch("/admin/config", json={"max_num_seqs": 1}, headers=AUTH).status_code == 200
        wait_until(lambda: engine.latest.max_num_seqs == 1)
        with contextlib.ExitStack() as streams:
            for _ in range(1 + DEFAULT_WAITING_PER_SEQ):
                assert (
                    streams.enter_context(http.stream("POST", "/v1/completions", json=body)).status_code
                    == 200
                )
            wait_until(lambda: engine.latest.num_running == 1)
            wait_until(lambda: engine.latest.num_waiting == DEFAULT_WAITING_PER_SEQ)
            with default_bound_server.paused():  # nothing running can finish and make room meanwhile
                refused = http.post("/v1/completions", json={**body, "stream": False})
            assert refused.status_code == 429 and "Retry-After" in refused.headers
            assert "4 x max_num_seqs" in refused.json()["error"]["message"]
    default_bound_server.wait_idle()
    assert default_bound_server.blocks_held() == 0


def test_waiting_limit_flag_values(
    server: LiveServer, tiny_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """-1 lifts the bound, 0 refuses every new request (as before), below -1 is a one-line error."""
    assert server.on_engine(lambda e: AsyncEngine(e, UNLIMITED_WAITING).waiting_limit) is None
    assert server.on_engine(lambda e: AsyncEngine(e, 0).waiting_limit) == 0
    assert server.built.async_engine.waiting_limit == 64  # the fixture's explicit flag wins
    assert main(["serve", "--model", str(tiny_dir), "--max-waiting-requests", "-2"]) == 2
    assert "--max-waiting-requests must be >= 0, or -1 for no limit" in capsys.readouterr().err
