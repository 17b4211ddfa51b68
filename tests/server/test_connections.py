"""The engine's own connection behaviours: an HTTP/1.0 client still gets a Content-Length on a plain answer
while HTTP/1.1 streams are still chunked; an error repeats a client's value only up to a bound; a bad
deadline flag is one clear line. What both fronts share (the header and idle deadlines, idle crowds, the
close-delimited stream) is tested in tests/front/test_connections.py."""

from __future__ import annotations

import httpx
import pytest

from kvtune.bench.connection_probes import HANG, http10_stream
from kvtune.cli import main
from tests.server.live_server import LiveServer


def test_an_http10_client_still_gets_a_length_and_http11_still_chunks(server: LiveServer) -> None:
    plain = http10_stream(server.url, "/v1/completions", {"model": "tiny", "prompt": "Hi", "max_tokens": 3})
    assert plain.headers.get("content-length") == str(len(plain.body.encode()))
    with httpx.Client(base_url=server.url) as http:
        body = {"model": "tiny", "prompt": "Hi", "max_tokens": 3, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.headers.get("transfer-encoding") == "chunked"
            assert response.read().decode().endswith("data: [DONE]\n\n")


def test_an_unknown_model_is_echoed_only_up_to_a_bound(server: LiveServer) -> None:
    name = "m" * 1_000_000
    with httpx.Client(base_url=server.url, timeout=HANG) as http:
        response = http.post("/v1/completions", json={"model": name, "prompt": "x", "max_tokens": 1})
    assert response.status_code == 404
    assert len(response.content) < 2048 and "more characters" in response.json()["error"]["message"]


@pytest.mark.parametrize("flag", ["--header-timeout", "--idle-timeout"])
@pytest.mark.parametrize("value", ["0", "-1", "inf"])
def test_a_bad_deadline_is_one_clear_line(flag: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--tiny", flag, value]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"kvtune: error: {flag} must be a positive number"), err
