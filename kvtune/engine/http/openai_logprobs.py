"""The engine's token logprobs in OpenAI's two shapes: the legacy completions object (parallel lists, top
alternatives as {token text: logprob} dicts, character offsets) and chat's per-token content list (text,
UTF-8 bytes, top alternatives as a list).

A token that is only part of a UTF-8 character is written `bytes:\\xe2\\x80` as OpenAI writes it, so
distinct byte tokens stay distinct keys instead of all reading U+FFFD."""

from __future__ import annotations

from collections.abc import Sequence

from kvtune.engine.http.protocol import ChatLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob
from kvtune.engine.model.logprobs import TokenLogprobs
from kvtune.front.text.tokenizer import TextTokenizer


class LogprobsFormatter:
    """Turns TokenLogprobs into response objects with one tokenizer's token texts."""

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self.tokenizer = tokenizer

    def completion(
        self, entries: Sequence[TokenLogprobs], text_offset: int
    ) -> tuple[CompletionLogprobs, int]:
        """The logprobs object and the offset after its last token. `text_offset` is where the first token
        starts in the choice's text (after any echo); each token advances it by its decoded text."""
        out = CompletionLogprobs()
        for entry in entries:
            token = self.token_string(entry.token_id)
            top = {self.token_string(token_id): logprob for token_id, logprob in entry.top}
            top[token] = entry.logprob  # the sampled token is always listed, as OpenAI does
            out.tokens.append(token)
            out.token_logprobs.append(entry.logprob)
            out.top_logprobs.append(top)
            out.text_offset.append(text_offset)
            text_offset += len(self.tokenizer.token_text(entry.token_id))
        return out, text_offset

    def chat(self, entries: Sequence[TokenLogprobs]) -> ChatLogprobs:
        return ChatLogprobs(
            content=[
                TokenLogprob(
                    **self._top(entry.token_id, entry.logprob).model_dump(),
                    top_logprobs=[self._top(token_id, logprob) for token_id, logprob in entry.top],
                )
                for entry in entries
            ]
        )

    def token_string(self, token_id: int) -> str:
        """The token's text, or `bytes:` and its escaped bytes when they are not whole UTF-8 characters."""
        raw = bytes(self.tokenizer.token_bytes(token_id))
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{byte:02x}" for byte in raw)
        return self.tokenizer.token_text(token_id)

    def _top(self, token_id: int, logprob: float) -> TopLogprob:
        return TopLogprob(
            token=self.token_string(token_id), logprob=logprob, bytes=self.tokenizer.token_bytes(token_id)
        )
