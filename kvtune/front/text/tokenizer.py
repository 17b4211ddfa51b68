"""Text in and out of a checkpoint: `tokenizer.json` through the `tokenizers` library, chat templates
through a sandboxed jinja2, and the set of token ids that end a generation.

Chat templates are code shipped with a checkpoint; rendering them in jinja2's immutable sandbox keeps a
hostile template from touching the server. Messages are data: special-token text a client writes inside
a message (`<|eot_id|>`) is tokenized as plain text, so it cannot end a turn or forge another role; only
the template's own special tokens become special ids (unless the server allows otherwise, as vLLM does).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Encoding, Tokenizer, decoders

from kvtune.errors import KvtuneError
from kvtune.front.text.hf_files import read_json, token_ids
from kvtune.front.text.tiny_tokenizer import byte_symbols

Message = Mapping[str, Any]
# Placeholder characters for special-token text in messages: the BMP's and plane 15's private-use areas.
_PRIVATE_USE = (*range(0xE000, 0xF900), *range(0xF0000, 0xFFFFE))


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
        # vLLM parses special-token text inside messages; kvtune does only when the server says so.
        self.parse_special_tokens_in_content = False
        self._special_ids = frozenset(
            token_id for token_id, added in tokenizer.get_added_tokens_decoder().items() if added.special
        )
        # A second instance that reads special-token text as plain text: no shared flag is toggled per call.
        self._plain = Tokenizer.from_str(tokenizer.to_str())
        self._plain.encode_special_tokens = True
        self._byte_of_symbol = (
            {symbol: byte for byte, symbol in enumerate(byte_symbols())}
            if isinstance(tokenizer.decoder, decoders.ByteLevel)
            else None
        )

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

    def token_text(self, token_id: int) -> str:
        """One token as text, special tokens included (a piece of a multi-byte character reads as U+FFFD)."""
        return str(self.tokenizer.decode([token_id], skip_special_tokens=False))

    def token_bytes(self, token_id: int) -> list[int]:
        """The bytes one token stands for: exact for byte-level BPE (where a token can be part of a
        character), else the UTF-8 of its text."""
        symbol = self.tokenizer.id_to_token(token_id)
        if (
            self._byte_of_symbol is not None
            and symbol is not None
            and token_id not in self._special_ids
            and all(ch in self._byte_of_symbol for ch in symbol)
        ):
            return [self._byte_of_symbol[ch] for ch in symbol]
        return list(self.token_text(token_id).encode("utf-8"))

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
        """Token ids of a conversation; the template writes any BOS itself, so none is added again.

        Special-token text inside the messages stays plain text unless `parse_special_tokens_in_content`;
        a conversation without any is encoded exactly as its rendered text always was."""
        if self.parse_special_tokens_in_content or not any(
            self._special_spans(value) for message in messages for value in message.values()
        ):
            return self.encode(
                self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False
            )
        return self._encode_chat_as_data(messages, add_generation_prompt)

    def _special_spans(self, value: Any) -> list[tuple[int, int]]:
        """Where the tokenizer would read a special token in a message field (char offsets)."""
        if not isinstance(value, str) or not value:
            return []
        encoding: Encoding = self.tokenizer.encode_batch([value], add_special_tokens=False)[0]
        return [
            span
            for token_id, span in zip(encoding.ids, encoding.offsets, strict=True)
            if token_id in self._special_ids
        ]

    def _encode_chat_as_data(self, messages: Sequence[Message], add_generation_prompt: bool) -> list[int]:
        """Render with each special-token text in the messages swapped for a placeholder, so the only special
        tokens left in the rendered text are the template's own; keep those as special ids and encode the
        text between them (placeholders put back) with special-token parsing off.

        Splitting at the template's special tokens changes nothing else: the tokenizer itself splits there
        before it normalizes and pre-tokenizes."""
        used = {
            *"".join(str(v) for message in messages for v in message.values()),
            *(self.chat_template or ""),
        }
        mark = next((chr(c) for c in _PRIVATE_USE if chr(c) not in used), None)
        if mark is None:
            raise KvtuneError("the messages use every private-use character; kvtune cannot mark them")
        originals: list[str] = []

        def escape(value: Any) -> Any:
            spans = self._special_spans(value)
            if not spans:
                return value
            pieces, last = [], 0
            for start, end in spans:
                pieces += [value[last:start], f"{mark}{len(originals)}{mark}"]
                originals.append(value[start:end])
                last = end
            return "".join([*pieces, value[last:]])

        escaped = [{key: escape(value) for key, value in message.items()} for message in messages]
        rendered = self.apply_chat_template(escaped, add_generation_prompt)
        placeholder = re.compile(f"{mark}(\\d+){mark}")

        def plain_ids(text: str) -> list[int]:
            text = placeholder.sub(lambda match: originals[int(match.group(1))], text)
            return list(self._plain.encode_batch([text], add_special_tokens=False)[0].ids) if text else []

        ids: list[int] = []
        last = 0
        template_tokens = self.tokenizer.encode_batch([rendered], add_special_tokens=False)[0]
        for token_id, (start, end) in zip(template_tokens.ids, template_tokens.offsets, strict=True):
            if token_id in self._special_ids:
                ids += [*plain_ids(rendered[last:start]), token_id]
                last = end
        return ids + plain_ids(rendered[last:])


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
