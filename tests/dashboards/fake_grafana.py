"""A small fake of the Grafana HTTP API on loopback: the folder and dashboard endpoints `kvtune dashboards
push` uses. It checks the bearer token, the paths and the bodies the way Grafana does, and keeps what it was
sent so a test can compare it with dashboards/."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tests.stand_in_http import QuietHandler


@dataclass
class GrafanaState:
    token: str
    folders: dict[str, str] = field(default_factory=dict)  # uid -> title
    dashboards: dict[str, dict[str, Any]] = field(default_factory=dict)  # uid -> the POSTed body
    versions: dict[str, int] = field(default_factory=dict)
    requests: list[tuple[str, str]] = field(default_factory=list)  # (method, path)
    problems: list[str] = field(default_factory=list)  # requests Grafana would have rejected


def _handler(state: GrafanaState) -> type[BaseHTTPRequestHandler]:
    class Handler(QuietHandler):
        def _authorised(self) -> bool:
            state.requests.append((self.command, self.path))
            if self.headers.get("Authorization") != f"Bearer {state.token}":
                self.send_json(401, {"message": "invalid API key"})
                return False
            return True

        def _body(self) -> dict[str, Any]:
            if "application/json" not in self.headers.get("Content-Type", ""):
                state.problems.append(f"{self.path}: Content-Type {self.headers.get('Content-Type')}")
            loaded: dict[str, Any] = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            return loaded

        def do_GET(self) -> None:
            if not self._authorised():
                return
            prefix = "/api/folders/"
            if self.path.startswith(prefix) and self.path[len(prefix) :] in state.folders:
                uid = self.path[len(prefix) :]
                self.send_json(200, {"uid": uid, "title": state.folders[uid]})
            elif self.path.startswith(prefix):
                self.send_json(404, {"message": "folder not found", "status": "not-found"})
            else:
                state.problems.append(f"GET {self.path}")
                self.send_json(404, {"message": "Not found"})

        def do_POST(self) -> None:
            if not self._authorised():
                return
            body = self._body()
            if self.path == "/api/folders":
                if body.get("uid") in state.folders:
                    self.send_json(409, {"message": "a folder with the same uid already exists"})
                    return
                state.folders[body["uid"]] = body["title"]
                self.send_json(200, {"uid": body["uid"], "title": body["title"]})
            elif self.path == "/api/dashboards/db":
                self._save_dashboard(body)
            else:
                state.problems.append(f"POST {self.path}")
                self.send_json(404, {"message": "Not found"})

        def _save_dashboard(self, body: dict[str, Any]) -> None:
            dashboard = body.get("dashboard") or {}
            uid = dashboard.get("uid")
            if not uid or body.get("folderUid") not in state.folders:
                self.send_json(400, {"message": "dashboard uid and an existing folderUid are required"})
                return
            if uid in state.dashboards and not body.get("overwrite"):
                self.send_json(412, {"message": "a dashboard with the same uid already exists"})
                return
            state.dashboards[uid] = body
            state.versions[uid] = state.versions.get(uid, 0) + 1
            self.send_json(
                200,
                {
                    "id": list(state.dashboards).index(uid) + 1,
                    "uid": uid,
                    "url": f"/d/{uid}/{uid}",
                    "status": "success",
                    "version": state.versions[uid],
                },
            )

    return Handler


@contextmanager
def fake_grafana(token: str) -> Iterator[tuple[str, GrafanaState]]:
    """Yields the fake's base URL and its state; the server stops when the block ends."""
    state = GrafanaState(token=token)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}", state
    finally:
        server.shutdown()
        server.server_close()
