"""A real `kvtune serve` stack (uvicorn, the engine thread, a checkpoint) running in a thread on a free
loopback port, with handles on its engine for checks no HTTP endpoint exposes; and a /metrics scraper."""

from __future__ import annotations

import argparse
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvtune.engine_sidecar import serve
from kvtune.engine_sidecar.engine import EngineCounters, LLMEngine

T = TypeVar("T")
ADMIN_TOKEN = "test-admin-token"


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

    def counters(self) -> EngineCounters:
        """The engine's counters as of its last step."""
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
