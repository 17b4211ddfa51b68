"""Server tests start the real `kvtune serve` stack in a thread on a free loopback port (see live_server)
and talk to it over HTTP exactly as a client would."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from kvtune.engine.model.tiny_model import write_tiny_model
from tests.server.live_server import ADMIN_TOKEN, LiveServer, start_server


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread() -> Iterator[None]:
    """Tiny models run fastest on one thread; more threads spin-wait against each other on a 2-core box."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def server(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """The main server: a 1024-token pool that 8 concurrent ~200-token requests overrun (preemption),
    an admin token, and a waiting-queue limit high enough that ordinary tests never meet it."""
    token_file = tmp_path_factory.mktemp("admin") / "token"
    token_file.write_text(ADMIN_TOKEN + "\n")
    with start_server(
        tiny_dir,
        "--kv-cache-tokens", "1024", "--block-size", "16", "--max-num-seqs", "8",
        "--max-waiting-requests", "64", "--admin-token-file", str(token_file), "--log-stats-interval", "1",
    ) as live:  # fmt: skip
        yield live


@pytest.fixture(scope="session")
def narrow_server(tiny_dir: Path) -> Iterator[LiveServer]:
    """One running request, one waiting, no admin token: for the 503 and admin-404 checks."""
    with start_server(
        tiny_dir, "--kv-cache-tokens", "1024", "--max-num-seqs", "1", "--max-waiting-requests", "1"
    ) as live:
        yield live


@pytest.fixture()
def client(server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as http:
        yield http
