"""Raw-socket clients that misbehave on purpose, for either HTTP front (the engine, the proxy): one that
trickles its headers (slowloris), ones that connect and say nothing, and an HTTP/1.0 client (curl). Each
waits for what the server does (an answer, a close) with a generous limit that only catches a hang, and
returns what it measured. `kvtune bench connections` and the connection tests share them."""

from __future__ import annotations

import json
import selectors
import shutil
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

HANG = 60.0  # seconds: far past any deadline under test; only a server that never acts reaches it


def address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    return parts.hostname, parts.port


@dataclass
class Cut:
    """What a misbehaving client saw: how long until the server closed on it, and what it answered."""

    seconds: float
    answer: bytes
    closed: bool


def slowloris(url: str, trickle_every: float = 0.25) -> Cut:
    """A request whose headers arrive one byte every `trickle_every` seconds, for as long as the server
    lets it (a header that would take `HANG` seconds to finish)."""
    sock = socket.create_connection(address(url))
    sock.setblocking(False)
    start = time.monotonic()
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: probe\r\n")
    trickle = b"X-Slow: " + b"a" * int(HANG / trickle_every)
    answer, sent = b"", 0
    try:
        while time.monotonic() - start < HANG:
            try:
                chunk = sock.recv(65536)
            except BlockingIOError:
                chunk = None
            except ConnectionResetError:
                return Cut(time.monotonic() - start, answer, True)
            if chunk == b"":
                return Cut(time.monotonic() - start, answer, True)
            if chunk:
                answer += chunk
                continue
            if sent < len(trickle):
                try:
                    sock.send(trickle[sent : sent + 1])
                except (BrokenPipeError, ConnectionResetError):
                    return Cut(time.monotonic() - start, answer, True)
                sent += 1
            time.sleep(trickle_every)
        return Cut(time.monotonic() - start, answer, False)
    finally:
        sock.close()


def silent(url: str, after_request: bool = False, nudge_every: float | None = None) -> Cut:
    """A connection that sends nothing (or, with `after_request`, one request and then nothing, or only
    CRLFs every `nudge_every` seconds), until the server closes it."""
    sock = socket.create_connection(address(url))
    start = time.monotonic()
    answer = b""
    if after_request:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: probe\r\n\r\n")
    sock.settimeout(nudge_every or HANG)
    try:
        while time.monotonic() - start < HANG:
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                if nudge_every is not None:
                    sock.sendall(b"\r\n")
                continue
            except ConnectionResetError:
                return Cut(time.monotonic() - start, answer, True)
            if not chunk:
                return Cut(time.monotonic() - start, answer, True)
            answer += chunk
        return Cut(time.monotonic() - start, answer, False)
    finally:
        sock.close()


@dataclass
class IdleCrowd:
    """`count` connections that say nothing, and `/health` polled by a real client meanwhile."""

    opened: int = 0
    lifetimes: list[float] = field(default_factory=list)  # seconds from open to the server's close
    still_open: int = 0
    health: list[float] = field(default_factory=list)  # seconds per /health, all while the crowd was open
    health_failures: list[str] = field(default_factory=list)

    def health_p99(self) -> float:
        ordered = sorted(self.health)
        return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def idle_crowd(url: str, count: int) -> IdleCrowd:
    crowd = IdleCrowd()
    selector = selectors.DefaultSelector()
    opened_at: dict[socket.socket, float] = {}
    for _ in range(count):
        sock = socket.create_connection(address(url))
        sock.setblocking(False)
        opened_at[sock] = time.monotonic()
        selector.register(sock, selectors.EVENT_READ, sock)
    crowd.opened = len(opened_at)
    done = threading.Event()

    def poll_health() -> None:
        with httpx.Client(base_url=url, timeout=HANG) as http:
            while not done.is_set():
                began = time.perf_counter()
                try:
                    response = http.get("/health")
                    if response.status_code != 200:
                        crowd.health_failures.append(f"HTTP {response.status_code}")
                except httpx.HTTPError as err:
                    crowd.health_failures.append(f"{type(err).__name__}: {err}")
                crowd.health.append(time.perf_counter() - began)
                time.sleep(0.01)

    poller = threading.Thread(target=poll_health, daemon=True)
    poller.start()
    deadline = time.monotonic() + HANG
    try:
        while opened_at and time.monotonic() < deadline:
            for key, _ in selector.select(timeout=0.5):
                sock = key.data
                try:
                    data = sock.recv(4096)
                except ConnectionResetError:
                    data = b""
                if data:
                    continue  # a server that answers an idle connection: keep waiting for its close
                crowd.lifetimes.append(time.monotonic() - opened_at.pop(sock))
                selector.unregister(sock)
                sock.close()
    finally:
        done.set()
        poller.join(HANG)
        crowd.still_open = len(opened_at)
        for sock in opened_at:
            sock.close()
        selector.close()
    return crowd


def curl() -> str:
    found = shutil.which("curl")
    assert found, "curl, the HTTP/1.0 client of these tests, is missing: apt-get install -y curl"
    return found


@dataclass
class Http10Answer:
    status_line: str
    headers: dict[str, str]
    events: list[str]  # the SSE data payloads, in order
    body: str


def http10_stream(url: str, path: str, body: dict[str, object]) -> Http10Answer:
    """POST `body` with `curl --http1.0` (a real HTTP/1.0 client) and read the answer to its end."""
    done = subprocess.run(
        [curl(), "--http1.0", "-sS", "-N", "-D", "-", "--max-time", str(int(HANG)), "-X", "POST",
         "-H", "Content-Type: application/json", "--data-binary", json.dumps(body), f"{url}{path}"],
        capture_output=True, check=True, timeout=HANG + 10,
    )  # fmt: skip
    head, _, rest = done.stdout.decode().partition("\r\n\r\n")
    status_line, *lines = head.split("\r\n")
    headers = {
        name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)
    }
    events = [line[len("data: ") :] for line in rest.split("\n") if line.startswith("data: ")]
    return Http10Answer(status_line, headers, events, rest)


def check_http10_stream(answer: Http10Answer) -> None:
    """A stream an HTTP/1.0 client reads: no Transfer-Encoding, close-delimited, every line of the body
    an SSE line (no chunk-size lines inside it), ending with [DONE]."""
    assert answer.status_line.split(" ")[1] == "200", answer.status_line
    assert "transfer-encoding" not in answer.headers, answer.headers
    assert "content-length" not in answer.headers and answer.headers.get("connection") == "close"
    assert answer.events and answer.events[-1] == "[DONE]", answer.body[-300:]
    assert all(line.startswith("data: ") for line in answer.body.split("\n") if line), answer.body[:300]
    chunks = [json.loads(event) for event in answer.events[:-1]]
    assert chunks and all(chunk["object"] == "text_completion" for chunk in chunks)
