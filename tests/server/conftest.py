"""Server tests start the real `kvtune serve` stack (uvicorn, the engine thread, the tiny checkpoint) in a
thread on a free loopback port, and talk to it over HTTP exactly as a client would."""

from __future__ import annotations

import argparse
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import torch

from kvtune.engine_sidecar import serve
from kvtune.engine_sidecar.engine import LLMEngine
from kvtune.engine_sidecar.tiny_model import write_tiny_model

T = TypeVar("T")
ADMIN_TOKEN = "test-admin-token"


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread() -> Iterator[None]:
    """Tiny models run fastest on one thread; more threads spin-wait against each other on a 2-core box."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@dataclass
class LiveServer:
    """A running server and handles on its engine, for checks no HTTP endpoint exposes."""

    url: str
    built: serve.Server
    thread: threading.Thread

    def on_engine(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run `fn` on the engine thread between steps (the engine is not thread-safe)."""
        return self.built.async_engine.call_sync(fn)

    def wait_idle(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while self.on_engine(lambda e: e.has_unfinished_requests()):
            if time.monotonic() > deadline:
                raise AssertionError("the engine did not go idle")
            time.sleep(0.05)

    def blocks_held(self) -> int:
        return self.on_engine(lambda e: e.allocator.slots_held // e.cache.block_size)

    def counters(self) -> Any:
        return self.built.async_engine.latest.counters

    def stop(self) -> None:
        self.built.uvicorn.should_exit = True
        self.thread.join(30)


def start_server(model_dir: Path, *flags: str) -> LiveServer:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(
        ["--model", str(model_dir), "--served-model-name", "tiny", "--threads", "1", *flags]
    )
    built = serve.build_server(args)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    thread = threading.Thread(target=built.uvicorn.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not built.uvicorn.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.02)
    return LiveServer(f"http://127.0.0.1:{port}", built, thread)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def server(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """The main server: a 1024-token pool that 8 concurrent ~200-token requests overrun (preemption),
    an admin token, and a waiting-queue limit high enough that ordinary tests never meet it."""
    token_file = tmp_path_factory.mktemp("admin") / "token"
    token_file.write_text(ADMIN_TOKEN + "\n")
    live = start_server(
        tiny_dir,
        "--kv-cache-tokens", "1024", "--block-size", "16", "--max-num-seqs", "8",
        "--max-waiting-requests", "64", "--admin-token-file", str(token_file), "--log-stats-interval", "1",
    )  # fmt: skip
    yield live
    live.stop()


@pytest.fixture(scope="session")
def narrow_server(tiny_dir: Path) -> Iterator[LiveServer]:
    """One running request, one waiting, no admin token: for the 503 and admin-404 checks."""
    live = start_server(
        tiny_dir, "--kv-cache-tokens", "1024", "--max-num-seqs", "1", "--max-waiting-requests", "1"
    )
    yield live
    live.stop()


@pytest.fixture()
def client(server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as http:
        yield http
