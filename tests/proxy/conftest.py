"""Proxy tests run a real `kvtune serve` (the tiny model) as the upstream and a real `kvtune proxy` in front of
it, each in a thread on a free loopback port, and talk to both over HTTP as a client would."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvtune.contract.admin import CapSetting
from tests.proxy.live_proxy import ADMIN_TOKEN, LiveProxy, start_proxy
from tests.server import conftest as server_conftest
from tests.server.live_server import LiveServer, start_server

TENANT_HEADER = "X-Tenant"

# The engine tests' session fixtures: one torch thread, and the tiny checkpoint.
one_torch_thread = server_conftest.one_torch_thread
tiny_dir = server_conftest.tiny_dir


@pytest.fixture(scope="session")
def upstream(tiny_dir: Path) -> Iterator[LiveServer]:
    """The upstream engine: room for a few 1,000-token prompts at once, no cap of its own."""
    live = start_server(
        tiny_dir, "--kv-cache-tokens", "8192", "--block-size", "16", "--max-num-seqs", "8",
        "--max-model-len", "2048", "--log-stats-interval", "0",
    )  # fmt: skip
    yield live
    live.stop()


@pytest.fixture(scope="session")
def proxy(
    upstream: LiveServer, tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveProxy]:
    """The proxy in front of it: an admin token, no cap until a test sets one, tenants keyed by a header."""
    token_file = tmp_path_factory.mktemp("proxy-admin") / "token"
    token_file.write_text(ADMIN_TOKEN + "\n")
    token_file.chmod(0o600)
    live = start_proxy(
        upstream.url, tiny_dir, "--block-size", "16", "--admin-token-file", str(token_file),
        "--prefix-key-header", TENANT_HEADER,
    )  # fmt: skip
    yield live
    live.stop()


@pytest.fixture()
def client(proxy: LiveProxy) -> Iterator[httpx.Client]:
    """A client of the proxy; the cap is back to none after each test."""
    with httpx.Client(base_url=proxy.url, timeout=60) as http:
        yield http
    proxy.core.set_cap_setting(CapSetting())


@pytest.fixture()
def direct(upstream: LiveServer) -> Iterator[httpx.Client]:
    """A client of the upstream itself, for side-by-side comparisons."""
    with httpx.Client(base_url=upstream.url, timeout=60) as http:
        yield http
