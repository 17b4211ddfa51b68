"""`kvtune serve --ssl-certfile F --ssl-keyfile K` serves HTTPS, as vLLM's flags of the same names do (KServe
runs vLLM so, and scrapes its /metrics over HTTPS): the API and /metrics answer over TLS, plain HTTP gets no
answer, and a half-given or unreadable pair is refused at the command line."""

from __future__ import annotations

import ssl
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvtune.cli import main
from kvtune.harness.local_http import health_ok
from tests.server.live_server import LiveServer, start_server


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "tls.crt", folder / "tls.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                    "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)  # fmt: skip
    return cert, key


@pytest.fixture(scope="module")
def https_server(tiny_dir: Path, certificate: tuple[Path, Path]) -> Iterator[LiveServer]:
    cert, key = certificate
    live = start_server(tiny_dir, "--ssl-certfile", str(cert), "--ssl-keyfile", str(key))
    yield live
    live.stop()


def test_the_api_and_metrics_answer_over_https(
    https_server: LiveServer, certificate: tuple[Path, Path]
) -> None:
    url = https_server.url.replace("http://", "https://")
    with httpx.Client(
        base_url=url, verify=ssl.create_default_context(cafile=str(certificate[0])), timeout=60
    ) as https:
        assert "vllm:num_requests_running" in https.get("/metrics").text
        done = https.post("/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 2})
        assert done.status_code == 200 and done.json()["choices"]
    assert health_ok(url)  # the harness's readiness check, which a pod's own certificate must not stop


def test_plain_http_gets_no_answer(https_server: LiveServer) -> None:
    with pytest.raises(httpx.HTTPError):
        response = httpx.get(f"{https_server.url}/health", timeout=10)
        response.raise_for_status()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--ssl-certfile", "cert.pem"], "--ssl-certfile and --ssl-keyfile go together"),
        (["--ssl-keyfile", "key.pem"], "--ssl-certfile and --ssl-keyfile go together"),
        (
            ["--ssl-certfile", "/nonexistent/cert.pem", "--ssl-keyfile", "/nonexistent/key.pem"],
            "not a readable file",
        ),
    ],
)
def test_a_half_given_or_unreadable_pair_is_refused(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", "--tiny", *flags]) == 2
    assert message in capsys.readouterr().err
