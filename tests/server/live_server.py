"""A real `kvtune serve` stack (uvicorn, the engine thread, a checkpoint) running in a thread on a free
loopback port, with handles on its engine for checks no HTTP endpoint exposes; and a /metrics scraper."""

from __future__ import annotations

import argparse
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self, TypeVar

import httpx
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from kvtune.engine import command as serve
from kvtune.engine.loop.llm_engine import EngineCounters, LLMEngine

T = TypeVar("T")
ADMIN_TOKEN = "test-admin-token"


class StoppedOnExit:
    """A running server as a context manager: `with start_server(...) as live:` stops it however the block
    ends, for the live server and the live proxy alike."""

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class LiveServer(StoppedOnExit):
    """A running server and handles on its engine, for checks no HTTP endpoint exposes."""

    url: str
    built: serve.Server
    thread: threading.Thread

    def on_engine(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run `fn` on the engine thread between steps (the engine is not thread-safe)."""
        return self.built.async_engine.submit(fn).result(30.0)

    def wait_idle(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while self.on_engine(lambda e: e.has_unfinished_requests()):
            if time.monotonic() > deadline:
                raise AssertionError("the engine did not go idle")
            time.sleep(0.05)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Hold the engine thread between two steps for the block's length: no token is generated meanwhile,
        so a test can act on a request known to be mid-way (hang up, send more) however fast the machine is.
        Commands sent meanwhile (an abort, an add) queue up and run, in order, before the next step."""
        holding, release = threading.Event(), threading.Event()

        def hold(_: LLMEngine) -> None:
            holding.set()
            release.wait(120)

        held = self.built.async_engine.submit(hold)
        try:
            assert holding.wait(30), "the engine thread did not reach the pause"
            yield
        finally:
            release.set()
            held.result(30)

    def commands_queued(self) -> int:
        """Commands (adds, aborts, admin changes) waiting for the engine thread; with the engine paused, a
        test sees here that the front has handed a command over, such as the abort of a client that left."""
        return self.built.async_engine._commands.qsize()

    def blocks_held(self) -> int:
        return self.on_engine(lambda e: e.allocator.slots_held // e.cache.block_size)

    def counters(self) -> EngineCounters:
        """The engine's counters as of its last step."""
        return self.built.async_engine.latest.counters

    def stop(self) -> None:
        self.built.uvicorn.should_exit = True
        self.thread.join(30)


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    """Poll `condition` until it holds; the timeout only catches a hang."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def hang_up_mid_way(url: str, path: str, body: dict[str, Any], engine: LiveServer) -> None:
    """POST `body` (not streamed) to `url` + `path`, and hang up once `engine` holds its blocks. The engine is
    paused from then until the front has queued the abort, so the request cannot finish before the client
    leaves, however fast the machine (a client whose read timeout fires closes its connection just so)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    payload = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    )
    with socket.create_connection((host, int(port)), timeout=60) as client:
        client.sendall(head.encode() + payload)
        wait_for(lambda: engine.blocks_held() > 0, "the request to be running")
        with engine.paused():
            client.close()
            wait_for(lambda: engine.commands_queued() > 0, "the front to queue the abort of the client")


def start_server(model_dir: Path, *flags: str) -> LiveServer:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(
        ["--model", str(model_dir), "--served-model-name", "tiny", "--threads", "1", *flags]
    )
    built = serve.build_server(args)
    url, thread = run_on_loopback("server", built.uvicorn)
    return LiveServer(url, built, thread)


def run_on_loopback(what: str, main: uvicorn.Server, *others: uvicorn.Server) -> tuple[str, threading.Thread]:
    """Run `main` in a daemon thread on a free loopback port (`others` on the ports their configs name) and
    wait until all have started: how the live server and the live proxy both come up. Returns main's URL and
    thread."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    thread = threading.Thread(target=main.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    for other in others:
        threading.Thread(target=other.run, daemon=True).start()
    deadline = time.monotonic() + 30
    while not all(server.started for server in (main, *others)):
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the {what} did not start")
        time.sleep(0.02)
    return f"http://127.0.0.1:{port}", thread


PROMETHEUS_2_ACCEPT = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
    "text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)


Samples = dict[str, list[tuple[dict[str, str], float]]]


def scrape(client: httpx.Client) -> Samples:
    """Sample name -> [(labels, value)], from the same parser Prometheus tooling uses."""
    response = client.get("/metrics", headers={"Accept": PROMETHEUS_2_ACCEPT})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    samples: Samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


def total(samples: Samples, name: str) -> float:
    return sum(value for _, value in samples.get(name, []))
