"""The byte-level tokenizer of the tiny model: 256 byte tokens plus Llama-3-style special tokens.

Every string encodes (no unknown tokens) and every id sequence decodes, which is what a random-weight model
that emits arbitrary ids needs. It is built with the `tokenizers` library so the files are exactly what
Hugging Face tooling (transformers, vLLM) reads.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
EOT_TOKEN = "<|eot_id|>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, EOT_TOKEN)
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}" + EOT_TOKEN + "\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def byte_symbols() -> list[str]:
    """The printable character byte-level BPE writes for each byte value (GPT-2's convention): printable
    Latin-1 bytes stand for themselves, the rest are shifted past 255 in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)}
    symbols = []
    shifted = 0
    for byte in range(256):
        if byte in printable:
            symbols.append(chr(byte))
        else:
            symbols.append(chr(256 + shifted))
            shifted += 1
    return symbols


def build_byte_tokenizer() -> Tokenizer:
    """Byte-level BPE with no merges: id b is byte b (0..255), then BOS, EOS, EOT."""
    symbols = byte_symbols()
    if set(symbols) != set(pre_tokenizers.ByteLevel.alphabet()):
        raise AssertionError("byte symbols disagree with the tokenizers library's byte-level alphabet")
    vocab = {symbol: byte for byte, symbol in enumerate(symbols)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    bos_id = special_id(tokenizer, BOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B", special_tokens=[(BOS_TOKEN, bos_id)]
    )
    return tokenizer


def special_id(tokenizer: Tokenizer, token: str) -> int:
    """The id of a special token this module added (always present)."""
    token_id = tokenizer.token_to_id(token)
    assert token_id is not None, f"{token} is not in the tokenizer"
    return token_id


def tokenizer_config() -> dict[str, object]:
    """tokenizer_config.json: the class transformers should use, the special tokens and the chat template."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOT_TOKEN,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
    }
