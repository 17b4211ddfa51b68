"""The max_tokens cap where the proxy differs from the engine: a completion without max_tokens gets the cap
as its default (the engine keeps OpenAI's 16), a max_tokens that is not an integer is the proxy's own 400,
max_num_seqs is not a proxy knob, and `--admin-port` keeps the admin API off the main port. What both fronts
share (clamp, reject, default, live changes, the counters) is tested in tests/front/test_max_tokens_cap_live.py.
"""

from __future__ import annotations

from pathlib import Path

import httpx

from kvtune.contract.admin import CAP_HEADER
from kvtune.harness.local_http import free_port
from tests.proxy.live_proxy import ADMIN_TOKEN, start_proxy
from tests.server.live_server import LiveServer, Samples, scrape

AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
LONG_ANSWER = {"model": "tiny", "prompt": "Count:", "temperature": 0, "ignore_eos": True}


def set_cap(client: httpx.Client, **fields: object) -> dict:
    response = client.patch("/admin/config", json=fields, headers=AUTH)
    assert response.status_code == 200, response.text
    return dict(response.json())


def capped(samples: Samples, mode: str) -> float:
    return next(v for labels, v in samples["kvtune:capped_requests_total"] if labels["mode"] == mode)


def test_a_completion_without_max_tokens_gets_the_cap_as_its_default(client: httpx.Client) -> None:
    before = scrape(client)
    set_cap(client, max_tokens_cap=4)
    response = client.post("/v1/completions", json=LONG_ANSWER)
    assert response.headers[CAP_HEADER] == "defaulted to 4"
    assert response.json()["usage"]["completion_tokens"] == 4
    assert capped(scrape(client), "default") == capped(before, "default") + 1


def test_a_non_integer_max_tokens_under_a_cap_is_a_clear_400(client: httpx.Client) -> None:
    set_cap(client, max_tokens_cap=5)
    response = client.post("/v1/completions", json={**LONG_ANSWER, "max_tokens": "lots"})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == 'max_tokens must be an integer, got "lots"'
    assert response.json()["error"]["param"] == "max_tokens"


def test_max_num_seqs_is_not_a_proxy_knob(client: httpx.Client) -> None:
    set_cap(client, max_tokens_cap=7)
    response = client.patch("/admin/config", json={"max_num_seqs": 4}, headers=AUTH)
    assert response.status_code == 400
    assert "Extra inputs are not permitted" in response.json()["error"]["message"]
    assert client.get("/admin/config", headers=AUTH).json() == {"max_tokens_cap": 7, "cap_mode": "clamp"}


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
