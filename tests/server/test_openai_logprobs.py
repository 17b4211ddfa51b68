"""`logprobs` (completions), `logprobs` + `top_logprobs` (chat) and `echo`, plain and streamed, in OpenAI's
shapes as the official client parses them."""

from __future__ import annotations

import itertools
import json
from typing import Any

import httpx
import pytest

from tests.server.live_server import LiveServer

openai = pytest.importorskip("openai", reason="the openai client (dev dependency) is not installed")

GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
MESSAGES = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture()
def oai(server: LiveServer) -> Any:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _offsets(tokens: list[str], start: int) -> list[int]:
    """Each token advances the offset by its decoded text; a `bytes:` token (part of a character) by one
    U+FFFD, since the tiny tokenizer's tokens are single bytes."""
    lengths = (1 if t.startswith("bytes:") else len(t) for t in tokens[:-1])
    return list(itertools.accumulate(lengths, initial=start))


def test_completion_logprobs_shape_and_greedy_maximum(oai: Any) -> None:
    out = oai.completions.create(model="tiny", prompt="Hello", max_tokens=8, logprobs=3, **GREEDY)
    choice = out.choices[0]
    lp = choice.logprobs
    assert lp is not None and out.usage is not None
    assert (
        len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == out.usage.completion_tokens == 8
    )
    assert lp.text_offset == _offsets(lp.tokens, 0)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob <= 0.0
        assert token in top and top[token] == logprob  # the sampled token is listed with its own logprob
        assert 1 <= len(top) <= 4  # three alternatives, plus the sampled token when it is not among them
        assert logprob == pytest.approx(max(top.values()))  # greedy picks the most likely token


def test_no_logprobs_unless_asked(oai: Any) -> None:
    out = oai.completions.create(model="tiny", prompt="Hello", max_tokens=3, **GREEDY)
    assert out.choices[0].logprobs is None
    chat = oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3, **GREEDY)
    assert chat.choices[0].logprobs is None


def test_logprobs_zero_lists_only_the_sampled_token(oai: Any) -> None:
    lp = (
        oai.completions.create(model="tiny", prompt="abc", max_tokens=4, logprobs=0, **GREEDY)
        .choices[0]
        .logprobs
    )
    assert lp is not None
    assert [list(top) for top in lp.top_logprobs] == [[t] for t in lp.tokens]


def test_streamed_completion_logprobs_match_the_plain_ones(oai: Any) -> None:
    plain = oai.completions.create(model="tiny", prompt="abc", max_tokens=10, logprobs=2, **GREEDY)
    chunks = list(
        oai.completions.create(model="tiny", prompt="abc", max_tokens=10, logprobs=2, stream=True, **GREEDY)
    )
    parts = [c.choices[0].logprobs for c in chunks if c.choices]
    assert all(p is not None for p in parts)
    expected = plain.choices[0].logprobs
    assert [t for p in parts for t in p.tokens] == expected.tokens
    assert [v for p in parts for v in p.token_logprobs] == pytest.approx(expected.token_logprobs)
    assert [o for p in parts for o in p.text_offset] == expected.text_offset


def test_chat_logprobs_with_top_alternatives(oai: Any) -> None:
    out = oai.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=8, logprobs=True, top_logprobs=3, **GREEDY
    )
    choice = out.choices[0]
    content = choice.logprobs.content
    assert out.usage is not None and len(content) == out.usage.completion_tokens == 8
    for entry in content:
        assert len(entry.top_logprobs) == 3
        best = entry.top_logprobs[0]
        assert (entry.token, entry.bytes) == (best.token, best.bytes)  # greedy: the sampled token is the best
        assert entry.logprob == pytest.approx(best.logprob)
        assert [t.logprob for t in entry.top_logprobs] == sorted(
            (t.logprob for t in entry.top_logprobs), reverse=True
        )
    # The byte-level tokenizer's bytes are exact, so together they spell the answer even mid-character.
    spelled = bytes(b for entry in content for b in entry.bytes).decode("utf-8", errors="replace")
    assert spelled == choice.message.content


def test_chat_logprobs_without_top_logprobs(oai: Any) -> None:
    out = oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, logprobs=True, **GREEDY)
    assert [entry.top_logprobs for entry in out.choices[0].logprobs.content] == [[]] * 4


def test_streamed_chat_logprobs_match_the_plain_ones(oai: Any) -> None:
    args: dict[str, Any] = {
        "model": "tiny",
        "messages": MESSAGES,
        "max_tokens": 6,
        "logprobs": True,
        "top_logprobs": 2,
    }
    plain = oai.chat.completions.create(**args, **GREEDY).choices[0].logprobs.content
    chunks = list(oai.chat.completions.create(**args, stream=True, **GREEDY))
    streamed = [
        e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    assert [(e.token, e.bytes) for e in streamed] == [(e.token, e.bytes) for e in plain]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in plain])


def test_each_choice_has_its_own_logprobs(oai: Any) -> None:
    out = oai.completions.create(
        model="tiny", prompt="fork", max_tokens=5, n=2, seed=3, temperature=1.0, logprobs=1,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    per_choice = {c.index: c.logprobs.tokens for c in out.choices}
    assert sorted(per_choice) == [0, 1] and all(len(tokens) == 5 for tokens in per_choice.values())
    assert per_choice[0] != per_choice[1], "two seeded choices sampled the same tokens"


def test_echo_prepends_the_prompt(oai: Any) -> None:
    plain = oai.completions.create(model="tiny", prompt="Hello", max_tokens=5, **GREEDY).choices[0].text
    echoed = oai.completions.create(model="tiny", prompt="Hello", max_tokens=5, echo=True, **GREEDY)
    assert echoed.choices[0].text == "Hello" + plain
    assert (
        echoed.usage is not None and echoed.usage.prompt_tokens == 6
    )  # echo changes the text, not the usage
    ids = [256, *b"Hello"]  # token prompts echo their decoded text, BOS left out
    assert oai.completions.create(model="tiny", prompt=ids, max_tokens=5, echo=True, **GREEDY).choices[
        0
    ].text == ("Hello" + plain)


def test_streamed_echo_sends_the_prompt_first_for_each_choice(client: httpx.Client) -> None:
    body = {"prompt": "Hi there", "max_tokens": 4, "n": 2, "echo": True, "stream": True, "ignore_eos": True}
    texts: dict[int, list[str]] = {0: [], 1: []}
    with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[len("data: ") :])["choices"]:
                    texts[choice["index"]].append(choice["text"])
    assert texts[0][0] == texts[1][0] == "Hi there"
    assert all(len(parts) > 1 for parts in texts.values())
