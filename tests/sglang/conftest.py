"""SGLang tests run the real `kvtune proxy` (and the operator's readers) against an SGLang stand-in that
replays what SGLang 0.5.23's own code was recorded answering (see stand_in.py and the README)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvtune.engine.model.tiny_model import write_tiny_model
from tests.proxy.live_proxy import LiveProxy, capless_client, start_tenant_proxy
from tests.sglang.stand_in import SGLangStandIn


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tokenizer and chat template the proxy reads (the recorded server served this tiny model)."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture()
def sglang() -> Iterator[SGLangStandIn]:
    """A fresh stand-in per test: its /metrics starts at the t0 scrape and nothing has reached it."""
    stand_in = SGLangStandIn()
    yield stand_in
    stand_in.stop()


@pytest.fixture()
def proxy(sglang: SGLangStandIn, tiny_dir: Path, tmp_path: Path) -> Iterator[LiveProxy]:
    """`kvtune proxy` in front of the stand-in, as one would deploy it in front of SGLang: its block size is
    SGLang's --page-size (16 in the recording), an admin token, tenants keyed by a header."""
    with start_tenant_proxy(sglang.url, tiny_dir, tmp_path) as live:
        yield live


@pytest.fixture()
def client(proxy: LiveProxy) -> Iterator[httpx.Client]:
    with capless_client(proxy, timeout=30) as http:
        yield http
