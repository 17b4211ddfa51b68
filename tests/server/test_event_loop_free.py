"""No request can stall the others: while a 10 MiB body is uploaded and refused, or long prompts are
tokenized, /health answers within 100 ms every time and an open stream keeps receiving tokens.

Each probe is timed on its own keep-alive connection. Before these limits, a 10 MiB prompt held the event
loop for 8 s (buffered, parsed and tokenized on it), and every stream with it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvtune.engine_sidecar.prompt_chars import prompt_char_limit
from tests.server.live_server import LiveServer, start_server

BODY_LIMIT = 3_000_000
HEALTH_BUDGET_S = 0.1
UPLOAD_BYTES = 10 * 1024 * 1024


@pytest.fixture(scope="module")
def roomy_server(tiny_dir: Path) -> Iterator[LiveServer]:
    """A 4096-token context, so prompts near the character bound take the tokenizer a while."""
    live = start_server(
        tiny_dir, "--kv-cache-tokens", "8192", "--max-model-len", "4096", "--max-num-seqs", "4",
        "--max-request-body-bytes", str(BODY_LIMIT), "--log-stats-interval", "0",
    )  # fmt: skip
    yield live
    live.stop()


class HealthProbe(threading.Thread):
    """GET /health every few milliseconds on one keep-alive connection, recording (start, seconds, status)."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.samples: list[tuple[float, float, int]] = []
        self.connected = threading.Event()
        self.done = threading.Event()

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as client:
            client.get("/health")
            self.connected.set()
            while not self.done.is_set():
                start = time.monotonic()
                status = client.get("/health").status_code
                self.samples.append((start, time.monotonic() - start, status))
                self.done.wait(0.02)

    def __enter__(self) -> HealthProbe:
        self.start()
        assert self.connected.wait(10)
        return self

    def __exit__(self, *_: object) -> None:
        self.done.set()
        self.join(30)

    def within(self, start: float, end: float) -> list[tuple[float, float, int]]:
        return [sample for sample in self.samples if start <= sample[0] <= end]


class TokenStream(threading.Thread):
    """A long streamed completion, recording when each event arrives; it hangs up when told to."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.arrivals: list[float] = []
        self.done = threading.Event()

    def run(self) -> None:
        body = {"prompt": "once upon a time", "max_tokens": 3000, "ignore_eos": True, "stream": True}
        with (
            httpx.Client(base_url=self.url, timeout=60) as client,
            client.stream("POST", "/v1/completions", json=body) as response,
        ):
            for line in response.iter_lines():
                if line.startswith("data: "):
                    self.arrivals.append(time.monotonic())
                if self.done.is_set():
                    return

    def __enter__(self) -> TokenStream:
        self.start()
        deadline = time.monotonic() + 30
        while len(self.arrivals) < 3:
            assert time.monotonic() < deadline, "the stream sent no tokens"
            time.sleep(0.01)
        return self

    def __exit__(self, *_: object) -> None:
        self.done.set()
        self.join(30)

    def within(self, start: float, end: float) -> list[float]:
        return [arrival for arrival in self.arrivals if start <= arrival <= end]


def paced(data_size: int, chunk: int = 256 * 1024, pause: float = 0.025) -> Iterator[bytes]:
    """A JSON prompt body of `data_size` bytes, sent a chunk at a time so the upload lasts a while."""
    yield b'{"prompt": "'
    for _ in range(data_size // chunk):
        yield b"y" * chunk
        time.sleep(pause)
    yield b'"}'


def assert_loop_stayed_free(probe: HealthProbe, stream: TokenStream, start: float, end: float) -> None:
    probes = probe.within(start, end)
    assert len(probes) >= 5, f"only {len(probes)} probes during {end - start:.2f} s"
    slowest = max(seconds for _, seconds, _ in probes)
    assert slowest < HEALTH_BUDGET_S, f"/health took {slowest * 1000:.0f} ms"
    assert all(status == 200 for _, _, status in probes)
    assert len(stream.within(start, end)) >= 3, "the open stream stopped receiving tokens"


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
def test_a_10_mib_body_stalls_nobody(roomy_server: LiveServer, declared: bool) -> None:
    headers = {"content-type": "application/json"}
    if declared:
        headers["content-length"] = str(UPLOAD_BYTES + len(b'{"prompt": ""}'))
    with TokenStream(roomy_server.url) as stream, HealthProbe(roomy_server.url) as probe:
        with httpx.Client(base_url=roomy_server.url, timeout=60) as client:
            start = time.monotonic()
            response = client.post("/v1/completions", content=paced(UPLOAD_BYTES), headers=headers)
            end = time.monotonic()
        assert response.status_code == 413, response.text
        assert_loop_stayed_free(probe, stream, start, end)
    roomy_server.wait_idle()


def test_tokenizing_long_prompts_stalls_nobody(roomy_server: LiveServer) -> None:
    """Prompts just under the character bound are tokenized (and then refused for their token count)
    while ordinary prompts are served; all at once, four at a time."""
    max_model_len = roomy_server.built.engine.max_model_len
    char_bound = prompt_char_limit(roomy_server.built.engine.tokenizer.tokenizer, max_model_len)
    assert char_bound is not None
    long_text = ("ab " * char_bound)[:char_bound]
    near_bound: list[tuple[str, dict[str, Any], int]] = [
        ("/v1/completions", {"prompt": long_text, "max_tokens": 1}, 400),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": long_text[:-60]}]}, 400),
        ("/v1/completions", {"prompt": "an ordinary prompt " * 10, "max_tokens": 4}, 200),
    ]

    def send(job: tuple[str, dict[str, Any], int]) -> tuple[int, int, str]:
        path, body, expected = job
        with httpx.Client(base_url=roomy_server.url, timeout=120) as client:
            response = client.post(path, json=body)
        return response.status_code, expected, response.text

    with TokenStream(roomy_server.url) as stream, HealthProbe(roomy_server.url) as probe:
        start = time.monotonic()
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(send, near_bound * 4))
        end = time.monotonic()
        assert_loop_stayed_free(probe, stream, start, end)
    for status, expected, text in results:
        assert status == expected, text
        if expected == 400:
            assert "tokens" in text and "characters" not in text, text  # tokenized, then refused
    roomy_server.wait_idle()
