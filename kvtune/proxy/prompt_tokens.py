"""The token ids the upstream will see for a request body, computed the way the engine computes them.

Completions: the prompt text through the checkpoint's tokenizer (BOS as its post-processor says), or the
client's own token ids; vLLM also takes a batch of prompts, each a prompt of its own. Chat: the messages
through the checkpoint's chat template (`TextTokenizer.encode_chat`, the engine's path). The detector needs
the ids the upstream's prefix cache hashes, so the proxy reads special-token text inside messages as
special tokens, as vLLM and SGLang do.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvtune.front.text.hf_files import read_json
from kvtune.front.text.prompt_chars import prompt_char_limit
from kvtune.front.text.tokenizer import TextTokenizer, load_tokenizer


class PromptTooLongError(Exception):
    """More characters than the model's context can hold: not worth tokenizing (the upstream refuses it)."""


def _message_text(content: Any) -> str:
    """A message's content as one string: text, or the text parts of a multi-part content joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part["text"] for part in content if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return ""


def context_length(model_dir: str | Path) -> int | None:
    """The checkpoint's context length from config.json, if it names one."""
    config_file = Path(model_dir) / "config.json"
    if not config_file.is_file():
        return None
    value = read_json(config_file).get("max_position_embeddings")
    return value if isinstance(value, int) and value > 0 else None


class PromptTokens:
    """Token ids of completion and chat bodies, for the prefix-defeat detector (never for the reply)."""

    def __init__(self, tokenizer: TextTokenizer, max_model_len: int | None) -> None:
        self.tokenizer = tokenizer
        self.tokenizer.parse_special_tokens_in_content = True
        self.char_limit = (
            prompt_char_limit(tokenizer.tokenizer, max_model_len) if max_model_len is not None else None
        )

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> PromptTokens:
        return cls(load_tokenizer(model_dir), context_length(model_dir))

    def _check_length(self, chars: int) -> None:
        if self.char_limit is not None and chars > self.char_limit:
            raise PromptTooLongError(f"{chars} characters, over the bound of {self.char_limit}")

    def _completion_one(self, prompt: Any) -> list[int] | None:
        if isinstance(prompt, str):
            self._check_length(len(prompt))
            return self.tokenizer.encode(prompt) if prompt else None
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        return None

    def completion(self, body: dict[str, Any]) -> list[list[int]]:
        """One id list per prompt of a /v1/completions body (shapes the upstream refuses give none)."""
        prompt = body.get("prompt")
        batch = (
            prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list) else [prompt]
        )
        prompts = [self._completion_one(one) for one in batch]
        return [ids for ids in prompts if ids]

    def chat(self, body: dict[str, Any]) -> list[list[int]]:
        """The id list of a /v1/chat/completions body's conversation (none for a malformed one)."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return []
        conversation = [
            {"role": str(message.get("role", "")), "content": _message_text(message.get("content"))}
            for message in messages
            if isinstance(message, dict)
        ]
        add_generation_prompt = body.get("add_generation_prompt", True) is not False
        # The messages' own text bounds the rendered prompt from below: no render of a hopeless prompt.
        self._check_length(sum(len(message["content"]) for message in conversation))
        ids = self.tokenizer.encode_chat(conversation, add_generation_prompt)
        return [ids] if ids else []
