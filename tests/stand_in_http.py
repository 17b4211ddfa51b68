"""The request handler the tests' stand-in HTTP servers (a fake Grafana, Prometheus, a metrics relay) share."""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler
from typing import Any


class QuietHandler(BaseHTTPRequestHandler):
    """A stand-in's handler: whole answers with their length, and no access log cluttering the test output."""

    def send_whole(self, status: int, body: bytes, content_type: str) -> None:
        """One complete response: the status, the type, the length, the body."""
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def send_json(self, status: int, body: Any) -> None:
        self.send_whole(status, json.dumps(body).encode(), "application/json")

    def log_message(self, *args: Any) -> None:
        pass
