"""The official `openai` client works against kvtune unchanged: completions, chat, streaming, n=2."""

from __future__ import annotations

from typing import Any

import pytest

from tests.server.live_server import LiveServer

openai = pytest.importorskip("openai", reason="the openai client (dev dependency) is not installed")


@pytest.fixture()
def oai(server: LiveServer) -> Any:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_models_lists_the_served_name(oai: Any) -> None:
    assert [m.id for m in oai.models.list().data] == ["tiny"]


def test_completion_with_usage(oai: Any) -> None:
    out = oai.completions.create(
        model="tiny", prompt="Hello", max_tokens=7, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.object == "text_completion"
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None and out.usage.completion_tokens == 7
    assert out.usage.prompt_tokens == 6  # BOS + five bytes


def test_greedy_is_deterministic_and_token_prompts_work(oai: Any) -> None:
    ids = [256, 72, 101, 108, 108, 111]  # BOS + "Hello" in the byte-level tokenizer
    text = oai.completions.create(model="tiny", prompt="Hello", max_tokens=8, temperature=0).choices[0].text
    again = oai.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0).choices[0].text
    assert text == again


def test_chat_completion(oai: Any) -> None:
    out = oai.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_completion_tokens=5, temperature=0
    )
    assert out.choices[0].message.role == "assistant"
    assert out.usage is not None and out.usage.completion_tokens <= 5
    assert out.choices[0].finish_reason in ("stop", "length")


def test_streamed_completion_matches_the_plain_one_and_ends_with_usage(oai: Any) -> None:
    plain = oai.completions.create(
        model="tiny", prompt="abc", max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    chunks = list(
        oai.completions.create(
            model="tiny", prompt="abc", max_tokens=12, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 12
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_streamed_chat(oai: Any) -> None:
    stream = oai.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "tell me"}], max_tokens=6, temperature=0,
        stream=True, extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)  # usage only when stream_options asks for it


def test_n_equals_two_plain_and_streamed(oai: Any) -> None:
    out = oai.completions.create(
        model="tiny",
        prompt="fork",
        max_tokens=6,
        temperature=1.0,
        seed=5,
        n=2,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert out.usage is not None and out.usage.completion_tokens == 12
    chunks = list(
        oai.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=4, n=2, stream=True,
            extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    finished = {c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason}
    assert finished == {0, 1}


def test_client_errors_are_openai_errors(oai: Any) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        oai.completions.create(model="not-served", prompt="x", max_tokens=1)
    assert "not-served" in str(missing.value)
    with pytest.raises(openai.BadRequestError) as bad:
        oai.completions.create(model="tiny", prompt="x", max_tokens=-3)
    assert "max_tokens" in str(bad.value)
