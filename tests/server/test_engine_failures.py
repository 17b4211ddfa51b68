"""The engine thread survives anything a request provokes: the affected requests fail with a JSON 500
(internal_server_error: an engine fault is not overload, so clients must not read it as "retry") and the
server keeps serving with every block free."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import httpx
import pytest

from kvtune.cli import main
from kvtune.engine import command as serve
from kvtune.engine.loop.llm_engine import LLMEngine
from tests.server.live_server import LiveServer


def fail_next_step(engine: LLMEngine) -> None:
    """Make the engine's next step raise once (on the engine thread, between steps)."""
    original = engine.step

    def failing() -> list[object]:
        setattr(engine, "step", original)  # noqa: B010 (shadowing a method on purpose)
        raise RuntimeError("injected failure")

    setattr(engine, "step", failing)  # noqa: B010


def fail_next_add(engine: LLMEngine) -> None:
    original = engine.add_request

    def failing(*args: object, **kwargs: object) -> None:
        setattr(engine, "add_request", original)  # noqa: B010
        raise RuntimeError("injected add failure")

    setattr(engine, "add_request", failing)  # noqa: B010


def assert_serving(client: httpx.Client, server: LiveServer) -> None:
    ok = client.post("/v1/completions", json={"prompt": "fine", "max_tokens": 3, "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    server.wait_idle()
    assert server.blocks_held() == 0


def test_a_failing_step_fails_its_requests_and_the_engine_serves_on(
    client: httpx.Client, server: LiveServer
) -> None:
    server.wait_idle()
    server.on_engine(fail_next_step)
    response = client.post("/v1/completions", json={"prompt": "boom", "max_tokens": 5})
    assert response.status_code == 500
    assert "injected failure" in response.json()["error"]["message"]
    assert response.json()["error"]["type"] == "internal_server_error"
    assert_serving(client, server)


def test_a_failing_step_ends_a_stream_with_an_error_event(client: httpx.Client, server: LiveServer) -> None:
    server.wait_idle()
    server.on_engine(fail_next_step)
    with client.stream(
        "POST", "/v1/completions", json={"prompt": "boom", "max_tokens": 5, "stream": True}
    ) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "injected failure" in error["message"] and error["type"] == "internal_server_error"
    assert_serving(client, server)


def test_a_failing_add_fails_that_request_as_a_fault(client: httpx.Client, server: LiveServer) -> None:
    """An engine fault is a 500, never a 503 that clients would retry as overload (issue 11)."""
    server.on_engine(fail_next_add)
    response = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    error = response.json()["error"]
    assert response.status_code == 500 and error["type"] == "internal_server_error"
    assert "injected add failure" in error["message"]
    assert_serving(client, server)


def test_serve_reports_a_missing_model_folder_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--model", "/nonexistent/model"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "kvtune: error: --model /nonexistent/model: no such folder"


def test_serve_tiny_writes_the_checkpoint_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    config = serve.engine_config(parser.parse_args(["--tiny"]))
    assert Path(config.model) == tmp_path / "kvtune" / "tiny"
    assert (tmp_path / "kvtune" / "tiny" / "config.json").is_file()
    stamp = os.stat(tmp_path / "kvtune" / "tiny" / "model.safetensors").st_mtime_ns
    serve.engine_config(parser.parse_args(["--tiny"]))
    assert os.stat(tmp_path / "kvtune" / "tiny" / "model.safetensors").st_mtime_ns == stamp
