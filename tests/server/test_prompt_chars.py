"""The characters-per-token bound that lets the server refuse an overlong prompt without tokenizing it:
sound (no text of more than tokens * bound characters) where it is given, absent where a tokenizer can
drop or merge characters."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers

from kvtune.front.text.prompt_chars import max_chars_per_token, prompt_char_limit
from kvtune.front.text.tiny_tokenizer import SPECIAL_TOKENS, build_byte_tokenizer

TINY = build_byte_tokenizer()


def byte_level(normalizer: normalizers.Normalizer | None = None) -> Tokenizer:
    tokenizer = build_byte_tokenizer()
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    return tokenizer


def byte_fallback() -> Tokenizer:
    vocab = {f"<0x{b:02X}>": b for b in range(256)} | {"▁hello": 256, "▁": 257, "<unk>": 258}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    return tokenizer


def test_tiny_tokenizer_bound_is_its_longest_special_token() -> None:
    assert max_chars_per_token(TINY) == max(len(token) for token in SPECIAL_TOKENS)
    assert prompt_char_limit(TINY, 1024) == 1024 * max(len(token) for token in SPECIAL_TOKENS)


@settings(max_examples=200)
@given(st.lists(st.one_of(st.text(min_size=1), st.sampled_from(SPECIAL_TOKENS))).map("".join))
def test_tiny_bound_is_sound(text: str) -> None:
    per_token = max_chars_per_token(TINY)
    assert per_token is not None
    assert len(text) <= per_token * len(TINY.encode(text, add_special_tokens=False).ids)


def test_composing_normalizer_multiplies_the_bound_and_stays_sound() -> None:
    tokenizer = byte_level(normalizers.NFC())
    per_token = max_chars_per_token(tokenizer)
    assert per_token == 4 * max_chars_per_token(TINY)  # NFC merges up to 4 characters (U+1F82) into one
    decomposed = "\u03b1\u0313\u0300\u0345" * 50  # 200 characters that NFC turns into 50
    assert len(decomposed) <= per_token * len(tokenizer.encode(decomposed, add_special_tokens=False).ids)
    assert (
        max_chars_per_token(byte_level(normalizers.Sequence([normalizers.NFD(), normalizers.Lowercase()])))
        == 17
    )


def test_byte_fallback_bpe_has_a_bound() -> None:
    tokenizer = byte_fallback()
    assert max_chars_per_token(tokenizer) == len("▁hello")
    text = "hello \u4e16\u754c hello"
    assert len(text) <= 6 * len(tokenizer.encode(text).ids)


def test_tokenizers_that_can_drop_characters_have_no_bound() -> None:
    assert max_chars_per_token(byte_level(normalizers.Strip())) is None
    assert max_chars_per_token(byte_level(normalizers.StripAccents())) is None
    whitespace = build_byte_tokenizer()
    whitespace.pre_tokenizer = pre_tokenizers.Whitespace()
    assert max_chars_per_token(whitespace) is None
    swallowing = build_byte_tokenizer()
    swallowing.add_special_tokens([AddedToken("<mask>", lstrip=True)])
    assert max_chars_per_token(swallowing) is None
    fused = Tokenizer(models.BPE(vocab={"a": 0, "<unk>": 1}, merges=[], unk_token="<unk>", fuse_unk=True))
    assert max_chars_per_token(fused) is None
    assert (
        max_chars_per_token(Tokenizer(models.WordLevel(vocab={"a": 0, "[UNK]": 1}, unk_token="[UNK]")))
        is None
    )
