"""Front tests run each behaviour twice, through one fixture, `front`: against a real `kvtune serve` (the tiny
model) and against a real `kvtune proxy` in front of that same engine, each in a thread on a free loopback
port; a client talks to either over HTTP exactly as it would to the other."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.front.fronts import ADMIN_TOKEN, AUTH, FRONTS, Front
from tests.proxy.live_proxy import LiveProxy, start_proxy
from tests.server import conftest as server_conftest
from tests.server.live_server import LiveServer, start_server

# The engine tests' session fixtures: one torch thread, and the tiny checkpoint.
one_torch_thread = server_conftest.one_torch_thread
tiny_dir = server_conftest.tiny_dir

# The engine's pool: 512 blocks of 16, and a 2,048-token context.
ENGINE_CONFIG = {"max_num_seqs": 8, "bounds": {"max_num_seqs": 512, "max_tokens_cap": 2048}}


@pytest.fixture(scope="session")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The admin token both fronts read, private to its owner."""
    path = tmp_path_factory.mktemp("front-admin") / "token"
    path.write_text(ADMIN_TOKEN + "\n")
    path.chmod(0o600)
    return path


@pytest.fixture(scope="session")
def engine(tiny_dir: Path, token_file: Path) -> Iterator[LiveServer]:
    """`kvtune serve`: room for a few long requests at once, an admin token, no cap until a test sets one."""
    live = start_server(
        tiny_dir, "--kv-cache-tokens", "8192", "--block-size", "16", "--max-num-seqs", "8",
        "--max-model-len", "2048", "--log-stats-interval", "0", "--admin-token-file", str(token_file),
    )  # fmt: skip
    yield live
    live.stop()


@pytest.fixture(scope="session")
def proxy(engine: LiveServer, tiny_dir: Path, token_file: Path) -> Iterator[LiveProxy]:
    """`kvtune proxy` in front of the engine, with its own admin token and no cap until a test sets one."""
    live = start_proxy(engine.url, tiny_dir, "--block-size", "16", "--admin-token-file", str(token_file))
    yield live
    live.stop()


@pytest.fixture(scope="session", params=FRONTS)
def front(request: pytest.FixtureRequest) -> Front:
    """The engine, or the proxy in front of it (started only when a test asks for it)."""
    engine = request.getfixturevalue("engine")
    if request.param == "engine":
        return Front("engine", engine.url, engine, None, ENGINE_CONFIG)
    proxy = request.getfixturevalue("proxy")
    return Front("proxy", proxy.url, engine, proxy, {})


@pytest.fixture()
def client(front: Front) -> Iterator[httpx.Client]:
    """A client of the front; the cap is off again after each test."""
    with httpx.Client(base_url=front.url, timeout=60) as http:
        yield http
        reset = http.patch("/admin/config", json={"max_tokens_cap": None, "cap_mode": "clamp"}, headers=AUTH)
        assert reset.status_code == 200, reset.text


@pytest.fixture()
def direct(front: Front) -> Iterator[httpx.Client]:
    """A client of the engine behind the front (the front itself, for the engine), to compare answers."""
    with httpx.Client(base_url=front.engine.url, timeout=60) as http:
        yield http
