"""Text in and out of a checkpoint: `tokenizer.json` through the `tokenizers` library, chat templates
through a sandboxed jinja2, and the set of token ids that end a generation.

Chat templates are code shipped with a checkpoint; rendering them in jinja2's immutable sandbox keeps a
hostile template from touching the server.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from kvtune.engine_sidecar.checkpoint import read_json
from kvtune.engine_sidecar.config import token_ids
from kvtune.errors import KvtuneError

Message = Mapping[str, Any]


def _raise_exception(message: str) -> NoReturn:
    raise KvtuneError(f"chat template: {message}")


def _tojson(
    value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False
) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _token_text(value: Any) -> str | None:
    """Special tokens appear as plain strings or, in older files, as `{"content": ...}` objects."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a HF-style chat template: trimmed blocks, loop controls, `raise_exception`, `tojson`."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateError as err:
        raise KvtuneError(f"the chat template does not compile: {err}") from err


class TextTokenizer:
    """Encode, decode and chat-format text the way the checkpoint's own tokenizer files say."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        chat_template: str | None,
        bos_token: str | None,
        eos_token: str | None,
        eos_token_ids: Sequence[int],
    ) -> None:
        self.tokenizer = tokenizer
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.eos_token_ids = frozenset(eos_token_ids)
        self.chat_template = chat_template
        self._template = compile_chat_template(chat_template) if chat_template else None

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens (BOS) are added as the tokenizer's post-processor says.

        Through `encode_batch` because the library's `encode` holds the GIL for the whole call (seconds
        for a long prompt, freezing every other thread), while `encode_batch` releases it."""
        return list(self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def apply_chat_template(
        self, messages: Sequence[Message], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """Render a conversation to the prompt text the model was trained on."""
        if self._template is None:
            raise KvtuneError("this model has no chat template; use the completions API")
        context = {
            "messages": [dict(message) for message in messages],
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            **extra,
        }
        try:
            return self._template.render(**context)
        except jinja2.TemplateError as err:
            raise KvtuneError(f"the chat template failed: {err}") from err

    def encode_chat(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a conversation; the template writes any BOS itself, so none is added again."""
        return self.encode(
            self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False
        )


def _optional_json(path: Path) -> dict[str, Any]:
    return read_json(path) if path.is_file() else {}


def load_tokenizer(folder: str | Path) -> TextTokenizer:
    """The tokenizer of a checkpoint folder. EOS ids are every id the folder names as an end: config.json's
    and generation_config.json's `eos_token_id` and the tokenizer's `eos_token`."""
    path = Path(folder)
    tokenizer_file = path / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise KvtuneError(f"{tokenizer_file} is missing (kvtune reads fast tokenizers only)")
    try:
        tokenizer = Tokenizer.from_file(str(tokenizer_file))
    except Exception as err:  # the tokenizers library raises a bare Exception for a malformed file
        raise KvtuneError(f"{tokenizer_file} cannot be read: {err}") from err
    settings = _optional_json(path / "tokenizer_config.json")
    template_file = path / "chat_template.jinja"
    template = (
        template_file.read_text(encoding="utf-8")
        if template_file.is_file()
        else settings.get("chat_template")
    )
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = named.get("default")
    bos_token = _token_text(settings.get("bos_token"))
    eos_token = _token_text(settings.get("eos_token"))
    eos_ids = [
        *token_ids(_optional_json(path / "config.json").get("eos_token_id")),
        *token_ids(_optional_json(path / "generation_config.json").get("eos_token_id")),
    ]
    eos_token_id = tokenizer.token_to_id(eos_token) if eos_token is not None else None
    if eos_token_id is not None:
        eos_ids.append(eos_token_id)
    return TextTokenizer(
        tokenizer, template if isinstance(template, str) else None, bos_token, eos_token, eos_ids
    )
