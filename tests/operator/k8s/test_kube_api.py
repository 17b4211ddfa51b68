"""The operator's one Kubernetes client (the official `kubernetes` package behind a small facade): it logs in
once, and again only when the API server stops accepting its token (a service-account token rotated on
disk while the pod runs); it retries what is safe to retry (a 5xx on a GET) and nothing else (a 4xx, a POST);
every failure is a KubeError, status 0 when the server cannot be reached."""

from __future__ import annotations

import json
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from urllib.parse import parse_qs

import pytest
from kubernetes import client

from kvtune.operator.k8s.kube_api import METADATA_ONLY, USER_AGENT, KubeApi, KubeError
from tests.operator.helpers import QuietHandler, reply, serving

SECRET = {"kind": "Secret", "metadata": {"name": "s", "resourceVersion": "7"}, "data": {"token": "dA=="}}


class ApiServerHandler(QuietHandler):
    """Accepts only `Bearer current`; records (method, path, token, accept, user agent) of every request;
    answers the statuses queued in `server.answers` first (503, 404, ...), then the Secret."""

    def _answer(self) -> None:
        server = self.server
        token = self.headers.get("Authorization")
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        server.seen.append((self.command, self.path, token, self.headers.get("Accept"),  # type: ignore[attr-defined]
                            self.headers.get("User-Agent")))  # fmt: skip
        if token != "Bearer current":
            status, body = 401, {"kind": "Status", "reason": "Unauthorized", "message": "bad token"}
        elif server.answers:  # type: ignore[attr-defined]
            status = server.answers.pop(0)  # type: ignore[attr-defined]
            body = {"kind": "Status", "reason": f"Reason{status}", "message": f"answered {status}"}
        else:
            status, body = 200, SECRET
        reply(self, status, "application/json", json.dumps(body).encode())

    do_GET = do_POST = do_PATCH = _answer


@pytest.fixture
def server() -> Iterator[ThreadingHTTPServer]:
    with serving(ApiServerHandler, seen=[], answers=[]) as httpd:
        yield httpd


def logins(server: ThreadingHTTPServer, tokens: list[str]) -> tuple[list[str], KubeApi]:
    """A KubeApi whose every login issues the next token of `tokens` (the last one repeats)."""
    url = f"http://127.0.0.1:{server.server_address[1]}"
    issued: list[str] = []

    def load() -> client.Configuration:
        issued.append(tokens[min(len(issued), len(tokens) - 1)])
        configuration = client.Configuration(host=url)
        configuration.api_key = {"authorization": f"Bearer {issued[-1]}"}
        return configuration

    return issued, KubeApi(load, timeout=5.0)


def tokens_seen(server: ThreadingHTTPServer) -> list[str]:
    return [seen[2] for seen in server.seen]  # type: ignore[attr-defined]


def test_a_rejected_token_logs_in_again_once(server: ThreadingHTTPServer) -> None:
    issued, api = logins(server, ["rotated-away", "current"])
    with api:
        assert api.read_secret("a", "s") == SECRET
        assert api.read_secret("a", "s") == SECRET
    assert issued == ["rotated-away", "current"]
    assert tokens_seen(server) == ["Bearer rotated-away", "Bearer current", "Bearer current"]
    assert {seen[4] for seen in server.seen} == {USER_AGENT}  # type: ignore[attr-defined]


def test_a_token_rejected_after_login_is_an_error(server: ThreadingHTTPServer) -> None:
    issued, api = logins(server, ["wrong"])
    with api, pytest.raises(KubeError) as raised:
        api.read_secret("a", "s")
    assert (raised.value.status, raised.value.reason) == (401, "Unauthorized") and issued == [
        "wrong",
        "wrong",
    ]
    assert "bad token" in raised.value.message


def test_a_server_error_on_a_read_is_retried_by_the_library(server: ThreadingHTTPServer) -> None:
    server.answers = [503, 500]  # type: ignore[attr-defined]
    _, api = logins(server, ["current"])
    with api:
        assert api.read_workload("StatefulSet", "a", "web") == SECRET
    paths = [seen[1] for seen in server.seen]  # type: ignore[attr-defined]
    assert paths == ["/apis/apps/v1/namespaces/a/statefulsets/web"] * 3


def test_a_client_error_is_not_retried_and_keeps_the_servers_reason(server: ThreadingHTTPServer) -> None:
    server.answers = [409, 409]  # type: ignore[attr-defined]
    _, api = logins(server, ["current"])
    with api, pytest.raises(KubeError) as raised:
        api.patch_workload("Deployment", "a", "llama", {"spec": {}})
    assert (raised.value.status, raised.value.reason) == (409, "Reason409")
    assert len(server.seen) == 1  # type: ignore[attr-defined]


def test_an_event_post_is_never_repeated(server: ThreadingHTTPServer) -> None:
    server.answers = [503]  # type: ignore[attr-defined]
    _, api = logins(server, ["current"])
    event = {"metadata": {"name": "p.1", "namespace": "a"}, "involvedObject": {"kind": "KVTuningPolicy"},
             "reason": "TuningApplied", "message": "m", "type": "Normal"}  # fmt: skip
    with api, pytest.raises(KubeError) as raised:
        api.create_event("a", event)
    assert raised.value.status == 503 and [s[0] for s in server.seen] == ["POST"]  # type: ignore[attr-defined]


def test_metadata_reads_ask_for_partial_metadata(server: ThreadingHTTPServer) -> None:
    _, api = logins(server, ["current"])
    with api:
        api.read_secret_metadata("a", "s")
        api.list_endpoint_slices("a", "llama")
    (_, path, _, accept, _), (_, list_path, _, _, _) = server.seen  # type: ignore[attr-defined]
    assert (path, accept) == ("/api/v1/namespaces/a/secrets/s", METADATA_ONLY)
    where, _, query = list_path.partition("?")
    assert where == "/apis/discovery.k8s.io/v1/namespaces/a/endpointslices"
    assert parse_qs(query) == {"labelSelector": ["kubernetes.io/service-name=llama"]}


def test_an_unreachable_server_is_status_zero() -> None:
    def load() -> client.Configuration:
        return client.Configuration(host="http://127.0.0.1:9")  # discard port: nothing listens

    with KubeApi(load, timeout=2.0) as api, pytest.raises(KubeError) as raised:
        api.read_secret("a", "s")
    assert raised.value.status == 0 and raised.value.reason == "Unreachable"
