"""The admin API's upper bounds (one source: the engine's own checks), its own port (`--admin-port`), and
the boot warning about a token file others can read."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvtune.front.flags import read_token_file, token_file_exposure
from kvtune.harness.engine_process import start_engine
from kvtune.harness.local_http import free_port
from kvtune.harness.server import ServerProcess
from tests.server.live_server import ADMIN_TOKEN, LiveServer

AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
POOL_BLOCKS = 64  # the main server's 1,024-token pool in blocks of 16
MAX_MODEL_LEN = 1024  # the pool's size caps the tiny model's 4,096 positions


@pytest.mark.parametrize(
    ("body", "bound"),
    [
        ({"max_num_seqs": 10**9}, f"max_num_seqs must be at most {POOL_BLOCKS}"),
        ({"max_num_seqs": POOL_BLOCKS + 1}, f"max_num_seqs must be at most {POOL_BLOCKS}"),
        ({"max_tokens_cap": 10**30}, f"max_tokens_cap must be at most max_model_len {MAX_MODEL_LEN}"),
        (
            {"max_tokens_cap": MAX_MODEL_LEN + 1},
            f"max_tokens_cap must be at most max_model_len {MAX_MODEL_LEN}",
        ),
        # one field in bounds, one out: the patch is refused whole, nothing changes
        ({"max_num_seqs": 2, "max_tokens_cap": 10**6}, "max_tokens_cap must be at most"),
    ],
)
def test_out_of_bounds_values_get_a_400_naming_the_bound(
    client: httpx.Client, body: dict[str, Any], bound: str
) -> None:
    before = client.get("/admin/config", headers=AUTH).json()
    response = client.patch("/admin/config", json=body, headers=AUTH)
    assert response.status_code == 400, response.text
    assert bound in response.json()["error"]["message"]
    assert client.get("/admin/config", headers=AUTH).json() == before


def test_the_bounds_are_served_and_reachable(client: httpx.Client) -> None:
    config = client.get("/admin/config", headers=AUTH).json()
    assert config["bounds"] == {"max_num_seqs": POOL_BLOCKS, "max_tokens_cap": MAX_MODEL_LEN}
    try:
        at_bounds = {"max_num_seqs": POOL_BLOCKS, "max_tokens_cap": MAX_MODEL_LEN}
        changed = client.patch("/admin/config", json=at_bounds, headers=AUTH)
        assert changed.status_code == 200 and changed.json()["max_num_seqs"] == POOL_BLOCKS
    finally:
        reset = {"max_num_seqs": config["max_num_seqs"], "max_tokens_cap": config["max_tokens_cap"]}
        assert client.patch("/admin/config", json=reset, headers=AUTH).status_code == 200


def test_the_engine_setters_enforce_the_same_bounds(server: LiveServer) -> None:
    with pytest.raises(ValueError, match=f"at most {POOL_BLOCKS}"):
        server.on_engine(lambda e: e.set_max_num_seqs(POOL_BLOCKS + 1))
    with pytest.raises(ValueError, match=f"at most max_model_len {MAX_MODEL_LEN}"):
        server.on_engine(lambda e: e.set_max_tokens_cap(MAX_MODEL_LEN + 1))
    assert server.on_engine(lambda e: (e.max_num_seqs, e.max_tokens_cap)) == (8, None)


def test_by_default_the_admin_api_shares_the_main_port(client: httpx.Client) -> None:
    assert client.get("/admin/config", headers=AUTH).status_code == 200
    assert client.get("/v1/models").status_code == 200


@pytest.fixture(scope="module")
def split_engine(
    tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServerProcess, str]]:
    """`kvtune serve --admin-port P` as a user starts it: a child process with two listening ports."""
    folder = tmp_path_factory.mktemp("admin_port")
    token = folder / "token"
    token.write_text(ADMIN_TOKEN + "\n")
    token.chmod(0o600)
    admin_port = free_port()
    engine = start_engine(tiny_dir, token, folder / "engine.log", "--admin-port", str(admin_port))
    yield engine, f"http://127.0.0.1:{admin_port}"
    engine.stop()


def test_with_an_admin_port_the_admin_api_lives_only_there(split_engine: tuple[ServerProcess, str]) -> None:
    engine, admin_url = split_engine
    with httpx.Client(base_url=engine.url, timeout=30) as public:
        for response in (
            public.get("/admin/config", headers=AUTH),
            public.patch("/admin/config", json={"max_num_seqs": 2}, headers=AUTH),
        ):
            assert response.status_code == 404
            assert "error" in response.json()
        assert public.get("/v1/models").status_code == 200
        assert public.get("/metrics").status_code == 200
    with httpx.Client(base_url=admin_url, timeout=30) as admin:
        assert admin.get("/admin/config").status_code == 401
        changed = admin.patch("/admin/config", json={"max_num_seqs": 3}, headers=AUTH)
        assert changed.status_code == 200 and changed.json()["max_num_seqs"] == 3
        assert admin.get("/v1/models").status_code == 404  # only the admin routes live on this port
        assert admin.patch("/admin/config", json={"max_num_seqs": 10**9}, headers=AUTH).status_code == 400
    with httpx.Client(base_url=engine.url, timeout=30) as public:
        gauges = [
            line
            for line in public.get("/metrics").text.splitlines()
            if line.startswith("kvtune:max_num_seqs")
        ]
        assert gauges and float(gauges[0].rsplit(" ", 1)[1]) == 3  # one engine behind both ports
    log = engine.log_path.read_text()
    assert "admin API on http://127.0.0.1:" in log and "readable by group or others" not in log


def test_admin_port_without_a_token_is_a_clear_cli_error(capsys: pytest.CaptureFixture[str]) -> None:
    from kvtune.cli import main

    assert main(["serve", "--tiny", "--admin-port", "9999"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--admin-port needs --admin-token-file" in err


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604])
def test_a_token_file_others_can_read_is_warned_about(
    tmp_path: Path, mode: int, caplog: pytest.LogCaptureFixture
) -> None:
    token = tmp_path / "token"
    token.write_text("secret\n")
    token.chmod(mode)
    with caplog.at_level(logging.WARNING, logger="kvtune.engine.http.admin"):
        assert read_token_file(token) == "secret"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert str(token) in warnings[0] and f"chmod 600 {token}" in warnings[0] and f"{mode:o}" in warnings[0]


def test_a_private_token_file_is_not_warned_about(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    token = tmp_path / "token"
    token.write_text("secret\n")
    token.chmod(0o600)
    with caplog.at_level(logging.WARNING, logger="kvtune.engine.http.admin"):
        assert read_token_file(token) == "secret"
    assert token_file_exposure(token) is None
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
