"""An SGLang stand-in: a small HTTP server that answers with the shapes recorded from SGLang 0.5.23's own code
(tests/fixtures/sglang, written by scripts/record_sglang_shapes.py), since SGLang does not serve on these
CPU-only machines. It replays each recorded status, content type and body byte for byte, streams the recorded
SSE events one chunk each, answers /metrics with the recorded scrapes in order, and keeps the bodies it was
sent so a test can see what reached it."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "sglang"
CONTEXT_LEN = 4096  # the recorded server's context length (models.json's max_model_len)
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # prometheus_client's make_asgi_app


@dataclass(frozen=True)
class Answer:
    status: int
    content_type: str
    body: bytes


def recorded_answers() -> dict[str, Answer]:
    """Route key (as in answers.json) -> the recorded answer."""
    manifest = json.loads((FIXTURES / "answers.json").read_text())
    return {
        route: Answer(entry["status"], entry["content_type"], (FIXTURES / entry["body_file"]).read_bytes())
        for route, entry in manifest.items()
        if not route.startswith("_")
    }


def recorded_events(answer: Answer) -> list[bytes]:
    """An SSE body split into its events, each with its blank-line terminator."""
    return [event + b"\n\n" for event in answer.body.split(b"\n\n") if event]


def metrics_scrapes() -> list[str]:
    return [(FIXTURES / name).read_text() for name in ("metrics_t0.prom", "metrics_t1.prom")]


@dataclass
class Received:
    """What reached the stand-in: (path, parsed JSON body) per POST, in order."""

    bodies: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, path: str, body: dict[str, Any]) -> None:
        with self.lock:
            self.bodies.append((path, body))

    def snapshot(self) -> list[tuple[str, dict[str, Any]]]:
        with self.lock:
            return list(self.bodies)


class SGLangStandIn:
    """The server in a thread on a free loopback port. A completion whose prompt reaches the context length
    gets the recorded 400 (SGLang's check counts tokens; the tiny tokenizer is one byte a token)."""

    def __init__(self, scrapes: list[str] | None = None) -> None:
        self.answers = recorded_answers()
        self.received = Received()
        self.scrapes = list(scrapes if scrapes is not None else metrics_scrapes())
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_port}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)

    def next_scrape(self) -> str:
        """The recorded scrapes in order, the last one from then on (a server whose counters stopped)."""
        return self.scrapes.pop(0) if len(self.scrapes) > 1 else self.scrapes[0]

    def answer_for(self, path: str, body: dict[str, Any]) -> tuple[Answer, bool]:
        """The recorded answer to a POST, and whether it is streamed."""
        if path == "/v1/completions":
            prompt = body.get("prompt")
            too_long = isinstance(prompt, str) and len(prompt.encode()) >= CONTEXT_LEN
            key = "POST /v1/completions prompt too long" if too_long else "POST /v1/completions"
            return self.answers[key], False
        if body.get("stream"):
            return self.answers["POST /v1/chat/completions stream"], True
        return self.answers["POST /v1/chat/completions"], False

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive and chunked streams, as uvicorn serves SGLang

            def do_GET(self) -> None:
                if self.path == "/v1/models":
                    self.whole(stand_in.answers["GET /v1/models"])
                elif self.path == "/health":
                    self.whole(Answer(200, "", b""))  # SGLang's /health: an empty 200
                elif self.path == "/metrics":
                    self.whole(Answer(200, METRICS_CONTENT_TYPE, stand_in.next_scrape().encode()))
                else:
                    self.whole(Answer(404, "application/json", b'{"detail":"Not Found"}'))

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                body = json.loads(raw)
                stand_in.received.add(self.path, body)
                if self.path not in ("/v1/completions", "/v1/chat/completions"):
                    self.whole(Answer(404, "application/json", b'{"detail":"Not Found"}'))
                    return
                answer, streamed = stand_in.answer_for(self.path, body)
                if streamed:
                    self.stream(answer)
                else:
                    self.whole(answer)

            def whole(self, answer: Answer) -> None:
                self.send_response(answer.status)
                if answer.content_type:
                    self.send_header("Content-Type", answer.content_type)
                self.send_header("Content-Length", str(len(answer.body)))
                self.end_headers()
                self.wfile.write(answer.body)

            def stream(self, answer: Answer) -> None:
                self.send_response(answer.status)
                self.send_header("Content-Type", answer.content_type)
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for event in recorded_events(answer):
                    self.wfile.write(f"{len(event):x}\r\n".encode() + event + b"\r\n")
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")

            def log_message(self, *args: object) -> None:
                pass

        return Handler
