"""No request can stall the others: while a 10 MiB body is uploaded and refused, or long prompts are
tokenized, /health keeps answering and an open stream keeps receiving tokens.

Before these limits, a 10 MiB prompt held the event loop for 8 s (buffered, parsed and tokenized on it), and
every stream with it. The checks are made of events, not durations, so a fast or a slow machine reaches the
same verdict: between two pieces of the upload a /health request is both sent and answered and a token
arrives; and while the tokenizer works on a long prompt (the real call, timed by a wrapper on the live
server's tokenizer) a /health request is both sent and answered and a token arrives. Neither can happen while
the event loop is blocked, nor while the tokenizer holds the GIL (the library's `encode` does; the server uses
`encode_batch`, which releases it). A deadline only catches a hang.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvtune.front.text.prompt_chars import prompt_char_limit
from tests.server.live_server import LiveServer, start_server

BODY_LIMIT = 3_000_000
UPLOAD_BYTES = 10 * 1024 * 1024
HANG_S = 60.0


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
    """GET /health back to back on one keep-alive connection, recording (sent, answered, status)."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.samples: list[tuple[float, float, int]] = []
        self.connected = threading.Event()
        self.done = threading.Event()

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=HANG_S) as client:
            client.get("/health")
            self.connected.set()
            while not self.done.is_set():
                sent = time.monotonic()
                status = client.get("/health").status_code
                self.samples.append((sent, time.monotonic(), status))

    def __enter__(self) -> HealthProbe:
        self.start()
        assert self.connected.wait(HANG_S)
        return self

    def __exit__(self, *_: object) -> None:
        self.done.set()
        self.join(30)

    def answered_within(self, start: float, end: float) -> bool:
        """A /health request was both sent and answered between `start` and `end`."""
        return any(start <= sent and answered <= end for sent, answered, _ in list(self.samples))


class TokenStream(threading.Thread):
    """Long streamed completions one after another (so tokens never run out, however fast the engine),
    recording when each event arrives; it hangs up when told to."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.arrivals: list[float] = []
        self.done = threading.Event()

    def run(self) -> None:
        body = {"prompt": "once upon a time", "max_tokens": 3000, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=self.url, timeout=HANG_S) as client:
            while not self.done.is_set():
                with client.stream("POST", "/v1/completions", json=body) as response:
                    for line in response.iter_lines():
                        if line.startswith("data: "):
                            self.arrivals.append(time.monotonic())
                        if self.done.is_set():
                            return

    def __enter__(self) -> TokenStream:
        self.start()
        wait_until(lambda: len(self.arrivals) >= 3, "the stream's first tokens")
        return self

    def __exit__(self, *_: object) -> None:
        self.done.set()
        self.join(30)

    def arrived_within(self, start: float, end: float) -> bool:
        return any(start <= arrival <= end for arrival in list(self.arrivals))


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + HANG_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


def interleaved(
    data_size: int, probe: HealthProbe, stream: TokenStream, chunk: int = 256 * 1024
) -> Iterator[bytes]:
    """A JSON prompt body of `data_size` bytes, a chunk at a time; after each chunk, the next waits until a
    /health request sent after it has been answered and a token has arrived: the event loop is serving others
    while it receives the body."""
    yield b'{"prompt": "'
    for _ in range(data_size // chunk):
        yield b"y" * chunk
        sent = time.monotonic()

        def served_since(since: float = sent) -> bool:
            now = time.monotonic()
            return probe.answered_within(since, now) and stream.arrived_within(since, now)

        wait_until(served_since, "/health and a token while the body was being received")
    yield b'"}'


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
def test_a_10_mib_body_stalls_nobody(roomy_server: LiveServer, declared: bool) -> None:
    headers = {"content-type": "application/json"}
    if declared:
        headers["content-length"] = str(UPLOAD_BYTES + len(b'{"prompt": ""}'))
    with TokenStream(roomy_server.url) as stream, HealthProbe(roomy_server.url) as probe:
        with httpx.Client(base_url=roomy_server.url, timeout=HANG_S) as client:
            response = client.post(
                "/v1/completions", content=interleaved(UPLOAD_BYTES, probe, stream), headers=headers
            )
        assert response.status_code == 413, response.text
        assert all(status == 200 for _, _, status in probe.samples)
    roomy_server.wait_idle()


class TimedTokenizer:
    """Wraps the live server's tokenizer calls for prompts of at least `long_chars`: each real call is repeated
    (same text, same answer) until a /health request and a token both fitted inside one call, which proves
    the call held neither the event loop nor the GIL. Long calls are counted, and so are those that found
    nothing else served before the deadline (after the first, the wrapper stops trying, so a regression
    fails in a minute, not eight)."""

    def __init__(self, server: LiveServer, long_chars: int, probe: HealthProbe, stream: TokenStream) -> None:
        self.tokenizer = server.built.engine.tokenizer
        self.long_chars = long_chars
        self.probe, self.stream = probe, stream
        self.long_calls = 0
        self.stalled = 0
        self.real = self.tokenizer.encode

    def encode(self, text: str, *args: Any, **kwargs: Any) -> list[int]:
        if len(text) < self.long_chars:
            return self.real(text, *args, **kwargs)
        self.long_calls += 1
        deadline = time.monotonic() + HANG_S
        while True:
            start = time.monotonic()
            ids = self.real(text, *args, **kwargs)
            end = time.monotonic()
            if self.probe.answered_within(start, end) and self.stream.arrived_within(start, end):
                return ids
            if self.stalled or end > deadline:
                self.stalled += 1
                return ids

    def __enter__(self) -> TimedTokenizer:
        self.tokenizer.encode = self.encode  # type: ignore[method-assign]  # the instance's, shadowing the class's
        return self

    def __exit__(self, *_: object) -> None:
        del self.tokenizer.encode  # the class's method shows through again


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

    with (
        TokenStream(roomy_server.url) as stream,
        HealthProbe(roomy_server.url) as probe,
        TimedTokenizer(roomy_server, char_bound // 2, probe, stream) as timed,
        ThreadPoolExecutor(4) as pool,
    ):
        results = list(pool.map(send, near_bound * 4))
    assert timed.long_calls == 8  # every long prompt was tokenized
    assert timed.stalled == 0, "nothing else was served while the tokenizer worked on a long prompt"
    assert all(status == 200 for _, _, status in probe.samples)
    for status, expected, text in results:
        assert status == expected, text
        if expected == 400:
            assert "tokens" in text and "characters" not in text, text  # tokenized, then refused
    roomy_server.wait_idle()
