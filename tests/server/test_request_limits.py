"""Limits at the door that only `kvtune serve` has: a body limit flag that must be positive, and prompts too
long to tokenize refused by their length alone (an OpenAI-style 400, on a connection that serves on). The
door both fronts share (body size, JSON, Unicode) is tested in tests/front/test_request_bodies.py."""

from __future__ import annotations

import argparse
from pathlib import Path

import httpx
import pytest

from kvtune.engine import command as serve
from kvtune.errors import KvtuneError
from tests.front.refusals import assert_refused_then_served
from tests.server.live_server import LiveServer

TINY_CHARS_PER_TOKEN = len("<|begin_of_text|>")  # the tiny tokenizer's longest entry


def test_max_request_body_bytes_must_be_positive(tiny_dir: Path) -> None:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(["--model", str(tiny_dir), "--max-request-body-bytes", "0"])
    with pytest.raises(KvtuneError, match="--max-request-body-bytes must be positive"):
        serve.build_server(args)


# --- prompt length before tokenizing ----------------------------------------------------------------------
def test_prompt_longer_than_any_fitting_text_is_refused_untokenized(
    client: httpx.Client, server: LiveServer
) -> None:
    max_model_len = server.built.engine.max_model_len
    limit = max_model_len * TINY_CHARS_PER_TOKEN
    over = client.post("/v1/completions", json={"prompt": "y" * (limit + 1), "max_tokens": 1})
    assert_refused_then_served(client, over, 400)
    assert over.json()["error"]["param"] == "prompt"
    assert f"{limit + 1} characters" in over.json()["error"]["message"]
    # Just under the bound it is tokenized, and the engine counts the tokens (a different refusal).
    under = client.post("/v1/completions", json={"prompt": "y" * limit, "max_tokens": 1})
    assert_refused_then_served(client, under, 400)
    assert f"the prompt has {limit + 1} tokens" in under.json()["error"]["message"]


def test_chat_longer_than_any_fitting_text_is_refused_untokenized(
    client: httpx.Client, server: LiveServer
) -> None:
    limit = server.built.engine.max_model_len * TINY_CHARS_PER_TOKEN
    half = "z" * (limit // 2)
    body = {"messages": [{"role": "user", "content": half}, {"role": "assistant", "content": half}]}
    response = client.post("/v1/chat/completions", json={**body, "max_tokens": 1})
    assert_refused_then_served(client, response, 400)
    assert response.json()["error"]["param"] == "messages"
    assert "characters" in response.json()["error"]["message"]
