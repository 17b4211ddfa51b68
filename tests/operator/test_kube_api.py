"""The operator's one Kubernetes client logs in once, and again only when the API server stops accepting its
token (a service-account token rotated on disk while the pod runs)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import kopf
import pytest

from kvtune.operator.kube_api import KubeApi, KubeError
from tests.operator.helpers import reply


class TokenCheckingHandler(BaseHTTPRequestHandler):
    """Accepts only `Bearer current`; records the token of every request."""

    def do_GET(self) -> None:
        token = self.headers.get("Authorization")
        self.server.seen.append(token)  # type: ignore[attr-defined]
        status, body = (
            (200, {"kind": "Secret"}) if token == "Bearer current" else (401, {"reason": "Unauthorized"})
        )
        reply(self, status, "application/json", json.dumps(body).encode())

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[ThreadingHTTPServer]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), TokenCheckingHandler)
    httpd.seen = []  # type: ignore[attr-defined]
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def logins(server: ThreadingHTTPServer, tokens: list[str]) -> tuple[list[str], KubeApi]:
    url = f"http://127.0.0.1:{server.server_address[1]}"
    issued: list[str] = []

    def login() -> kopf.ConnectionInfo:
        issued.append(tokens[min(len(issued), len(tokens) - 1)])
        return kopf.ConnectionInfo(server=url, token=issued[-1])

    return issued, KubeApi(login)


def test_a_rejected_token_logs_in_again_once(server: ThreadingHTTPServer) -> None:
    issued, api = logins(server, ["rotated-away", "current"])
    with api:
        assert api.get("/api/v1/namespaces/a/secrets/s") == {"kind": "Secret"}
        assert api.get("/api/v1/namespaces/a/secrets/s") == {"kind": "Secret"}
    assert issued == ["rotated-away", "current"]
    assert server.seen == ["Bearer rotated-away", "Bearer current", "Bearer current"]  # type: ignore[attr-defined]


def test_a_token_rejected_after_login_is_an_error(server: ThreadingHTTPServer) -> None:
    issued, api = logins(server, ["wrong"])
    with api, pytest.raises(KubeError) as raised:
        api.get("/api/v1/namespaces/a/secrets/s")
    assert raised.value.status == 401 and issued == ["wrong", "wrong"]
