"""`kvtune proxy` as a user runs it: a process of its own that never loads torch, in front of a real
upstream; bad flags are one clear line and exit code 2."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kvtune.cli import main
from kvtune.harness.local_http import free_port
from tests.imports_seen import REPO, heavy_imports
from tests.server.live_server import LiveServer


def test_proxy_process_serves_without_torch(upstream: LiveServer, tiny_dir: Path) -> None:
    port = free_port()
    command = [sys.executable, "-X", "importtime", "-m", "kvtune.cli", "proxy", "--upstream", upstream.url,
               "--model-dir", str(tiny_dir), "--port", str(port), "--max-tokens-cap", "3"]  # fmt: skip
    process = subprocess.Popen(
        command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
                break
            except httpx.TransportError:
                assert process.poll() is None and time.monotonic() < deadline, "the proxy did not start"
                time.sleep(0.1)
        assert health.status_code == 200
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 30, "ignore_eos": True}
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=30)
        assert answer.json()["usage"]["completion_tokens"] == 3
    finally:
        process.terminate()
        _, stderr = process.communicate(timeout=30)
    assert heavy_imports(stderr) == {"fastapi", "uvicorn"}  # the web stack, and no torch


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--upstream", "localhost:8000"], "--upstream must be an http:// or https:// URL"),
        (["--model-dir", "/no/such/folder"], "--model-dir /no/such/folder: no such folder"),
        (["--max-tokens-cap", "0"], "--max-tokens-cap must be positive"),
        (["--cap-mode", "truncate"], "invalid choice: 'truncate'"),
        (["--admin-port", "9999"], "--admin-port needs --admin-token-file"),
    ],
)
def test_bad_flags_are_one_clear_line(
    tiny_dir: Path, flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    defaults = {"--upstream": "http://127.0.0.1:1", "--model-dir": str(tiny_dir)}
    for flag, value in zip(flags[::2], flags[1::2], strict=True):
        defaults[flag] = value
    words = ["proxy", *[word for pair in defaults.items() for word in pair], "--port", str(free_port())]
    try:
        code = main(words)
    except SystemExit as exit_:  # argparse's own refusals
        code = int(exit_.code or 0)
    assert code == 2
    shown = capsys.readouterr().err.strip()
    assert message in shown
    assert len(shown.splitlines()) == 1, shown
