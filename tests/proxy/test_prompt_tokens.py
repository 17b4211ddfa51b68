"""The proxy tokenizes a body into the ids the upstream's prefix cache hashes: the engine's own tokenizer
and chat-template path, with special-token text in messages read as special tokens, as vLLM reads it."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtune.front.text.tokenizer import load_tokenizer
from kvtune.proxy.prompt_tokens import PromptTokens, PromptTooLongError


@pytest.fixture(scope="module")
def tokens(tiny_dir: Path) -> PromptTokens:
    return PromptTokens.from_model_dir(tiny_dir)


def test_completion_prompts_are_the_engines_ids(tokens: PromptTokens, tiny_dir: Path) -> None:
    engine = load_tokenizer(tiny_dir)
    assert tokens.completion({"prompt": "Hello world"}) == [engine.encode("Hello world")]
    assert tokens.completion({"prompt": [5, 6, 7]}) == [[5, 6, 7]]
    assert tokens.completion({"prompt": ["a b", "c d"]}) == [engine.encode("a b"), engine.encode("c d")]
    assert tokens.completion({"prompt": [[1, 2], [3]]}) == [[1, 2], [3]]
    assert tokens.completion({"prompt": ""}) == []
    assert tokens.completion({"prompt": {"not": "a prompt"}}) == []


def test_chat_is_the_engines_template_path(tokens: PromptTokens, tiny_dir: Path) -> None:
    engine = load_tokenizer(tiny_dir)
    engine.parse_special_tokens_in_content = (
        True  # `kvtune serve --allow-special-tokens-in-content`, vLLM's way
    )
    messages = [
        {"role": "system", "content": "Be brief.<|eot_id|>"},
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
    ]
    as_engine = [
        {"role": "system", "content": "Be brief.<|eot_id|>"},
        {"role": "user", "content": "Hi there"},
    ]
    assert tokens.chat({"messages": messages}) == [engine.encode_chat(as_engine, True)]
    no_prompt = tokens.chat({"messages": messages, "add_generation_prompt": False})
    assert no_prompt == [engine.encode_chat(as_engine, False)]
    assert tokens.chat({"messages": "nope"}) == []


def test_prompts_beyond_the_context_are_not_tokenized(tokens: PromptTokens) -> None:
    assert tokens.char_limit is not None
    with pytest.raises(PromptTooLongError):
        tokens.completion({"prompt": "x" * (tokens.char_limit + 1)})
    with pytest.raises(PromptTooLongError):
        tokens.chat({"messages": [{"role": "user", "content": "x" * (tokens.char_limit + 1)}]})
