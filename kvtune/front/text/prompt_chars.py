"""How many characters a prompt may have before it certainly cannot fit `max_model_len` tokens.

A prompt far over the context length should be refused without tokenizing it: tokenizing megabytes costs
seconds of CPU. That needs a sound bound: one token stands for at most L characters, so a prompt of more
than max_model_len * L characters cannot fit. L is the longest vocabulary entry (in a byte-level vocabulary
a symbol is one byte, and a character at least one byte), times how much the tokenizer's normalizer can
shrink text. The bound holds only for tokenizers that turn every character into some token; one that can
drop characters (a whitespace-splitting pre-tokenizer, an unknown token that swallows a run, an added token
that strips the spaces around it) gets no bound, and its prompts are limited by the body size alone.
"""

from __future__ import annotations

import json
import sys
import unicodedata
from functools import cache
from typing import Any

from tokenizers import Tokenizer, pre_tokenizers

_KEEPS_LENGTH_NORMALIZERS = {"NFD", "NFKD", "Lowercase", "Prepend"}
_COMPOSING_NORMALIZERS = {"NFC", "NFKC"}
_KEEPS_EVERY_CHARACTER_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Split", "Digits", "Punctuation"}
_BYTE_FALLBACK_TOKENS = [f"<0x{byte:02X}>" for byte in range(256)]


@cache
def _longest_canonical_decomposition() -> int:
    """Composition (NFC, NFKC) merges at most this many characters into one: every composed character
    is the composition of its canonical decomposition."""
    return max(
        len(unicodedata.normalize("NFD", chr(code)))
        for code in range(sys.maxunicode + 1)
        if not 0xD800 <= code <= 0xDFFF
    )


def _normalizer_shrink(spec: dict[str, Any] | None) -> int | None:
    """How many input characters the normalizer can turn into one, or None when it can delete text."""
    if spec is None:
        return 1
    kind = spec.get("type")
    if kind == "Sequence":
        factor = 1
        for part in spec.get("normalizers", []):
            part_factor = _normalizer_shrink(part)
            if part_factor is None:
                return None
            factor *= part_factor
        return factor
    if kind in _KEEPS_LENGTH_NORMALIZERS:
        return 1
    if kind in _COMPOSING_NORMALIZERS:
        return _longest_canonical_decomposition()
    if kind == "Replace":
        pattern = spec.get("pattern", {}).get("String")
        content = spec.get("content", "")
        if isinstance(pattern, str) and pattern and len(content) >= len(pattern):
            return 1
    return None


def _pre_tokenizer_keeps_every_character(spec: dict[str, Any] | None) -> bool:
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_pre_tokenizer_keeps_every_character(part) for part in spec.get("pretokenizers", []))
    return kind in _KEEPS_EVERY_CHARACTER_PRE_TOKENIZERS and spec.get("behavior") != "Removed"


def _uses_byte_level(spec: dict[str, Any] | None) -> bool:
    if spec is None:
        return False
    if spec.get("type") == "Sequence":
        return any(_uses_byte_level(part) for part in spec.get("pretokenizers", []))
    return spec.get("type") == "ByteLevel"


def _every_character_gets_a_token(spec: dict[str, Any], vocab: dict[str, int]) -> bool:
    """A BPE model that has a token for every byte (byte-level, or byte fallback) or one unknown token per
    unknown character; other models can merge or drop text they do not know."""
    model = spec["model"]
    if model.get("type") != "BPE":
        return False
    if _uses_byte_level(spec.get("pre_tokenizer")):
        return all(symbol in vocab for symbol in pre_tokenizers.ByteLevel.alphabet())
    if model.get("byte_fallback"):
        return all(token in vocab for token in _BYTE_FALLBACK_TOKENS)
    return model.get("unk_token") in vocab and not model.get("fuse_unk")


def max_chars_per_token(tokenizer: Tokenizer) -> int | None:
    """The most characters of input one token can stand for, or None when no such bound holds."""
    spec = json.loads(tokenizer.to_str())
    if any(token.get("lstrip") or token.get("rstrip") for token in spec.get("added_tokens", [])):
        return None
    shrink = _normalizer_shrink(spec.get("normalizer"))
    if shrink is None or not _pre_tokenizer_keeps_every_character(spec.get("pre_tokenizer")):
        return None
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    if not vocab or not _every_character_gets_a_token(spec, vocab):
        return None
    return shrink * max(len(entry) for entry in vocab)


def prompt_char_limit(tokenizer: Tokenizer, max_model_len: int) -> int | None:
    """Prompts longer than this many characters cannot fit `max_model_len` tokens (None: no sound bound)."""
    per_token = max_chars_per_token(tokenizer)
    return None if per_token is None else max_model_len * per_token
