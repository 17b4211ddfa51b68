"""Proxy tests run a real `kvtune serve` (the tiny model) as the upstream and a real `kvtune proxy` in front of
it, each in a thread on a free loopback port, and talk to both over HTTP as a client would."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.proxy.live_proxy import LiveProxy, capless_client, start_tenant_proxy
from tests.server import conftest as server_conftest
from tests.server.live_server import LiveServer, start_server

# The engine tests' session fixtures: one torch thread, and the tiny checkpoint.
one_torch_thread = server_conftest.one_torch_thread
tiny_dir = server_conftest.tiny_dir


@pytest.fixture(scope="session")
def upstream(tiny_dir: Path) -> Iterator[LiveServer]:
    """The upstream engine: room for a few 1,000-token prompts at once, no cap of its own."""
    with start_server(
        tiny_dir, "--kv-cache-tokens", "8192", "--block-size", "16", "--max-num-seqs", "8",
        "--max-model-len", "2048", "--log-stats-interval", "0",
    ) as live:  # fmt: skip
        yield live


@pytest.fixture(scope="session")
def proxy(
    upstream: LiveServer, tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveProxy]:
    """The proxy in front of it: an admin token, no cap until a test sets one, tenants keyed by a header."""
    with start_tenant_proxy(upstream.url, tiny_dir, tmp_path_factory.mktemp("proxy-admin")) as live:
        yield live


@pytest.fixture()
def client(proxy: LiveProxy) -> Iterator[httpx.Client]:
    """A client of the proxy; the cap is back to none after each test."""
    with capless_client(proxy, timeout=60) as http:
        yield http


@pytest.fixture()
def direct(upstream: LiveServer) -> Iterator[httpx.Client]:
    """A client of the upstream itself, for side-by-side comparisons."""
    with httpx.Client(base_url=upstream.url, timeout=60) as http:
        yield http
