"""Incremental detokenization with stop strings: the text a stream sends, one step at a time.

Decoding only the newest id breaks multi-byte characters and tokenizers that merge spaces; decoding the whole
output every step costs O(length) per token (a quarter of a decode step at 1,500 tokens). So each step
decodes a short window: the ids since the last emitted text plus the ids before them that give the
tokenizer its context, and emits what that window adds. A window whose text ends in a replacement character
(a character whose bytes are not all there yet) waits for more ids, and any tail that could still grow into
a stop string is held back until it cannot.

When an output ends (EOS, stop_token_ids, stop strings, max_tokens) is decided here too. The scheduler of
kvtune.core ends a request (and frees its blocks) on what it can count, in `update_from_output`: a stop
token (said here, `StopChecker.is_stop`) or max_tokens. Only the engine sees text, so stop strings are found
here, in the detokenized output, and they outrank max_tokens (vLLM checks them first): the finish reason is
"stop" either way. The checker only says so; the output processor ends the request.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvtune.engine.model.sampling import SamplingParams

Decoder = Callable[[Sequence[int]], str]


class IncrementalText:
    """The visible text of one output and the part of it already sent."""

    def __init__(self, decode: Decoder, stop: Sequence[str] = ()) -> None:
        self.decode = decode
        self.stop = tuple(stop)
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""
        self.sent = 0
        self.stopped_by: str | None = None
        self._prefix = 0  # first id of the decoding window
        self._read = 0  # ids before this are already in `text`

    def _advance(self, token_ids: Sequence[int], final: bool) -> None:
        if len(token_ids) <= self._read:
            return
        before = self.decode(token_ids[self._prefix : self._read])
        after = self.decode(token_ids[self._prefix :])
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            self.text += after[len(before) :]
            self._prefix, self._read = self._read, len(token_ids)

    def update(self, token_ids: Sequence[int], final: bool = False) -> str:
        """New text to send after `token_ids` (the whole output so far). Sets `stopped_by` on a stop string."""
        self._advance(token_ids, final)
        text = self.text
        cut = None
        for s in self.stop:
            i = text.find(s, max(0, self.sent - len(s)))
            if i != -1 and (cut is None or i < cut):
                cut, self.stopped_by = i, s
        if cut is not None:
            text, final = text[:cut], True
            self.text = text
        end = len(text)
        if not final:
            end = max(self.sent, end - self._hold)
        delta = text[self.sent : end]
        self.sent = end
        return delta


class StopChecker:
    """One output's stop conditions and its incrementally decoded text."""

    def __init__(self, params: SamplingParams, eos_token_ids: frozenset[int], decode: Decoder) -> None:
        # ignore_eos ignores the model's EOS only; stop_token_ids the client asked for still stop (as vLLM).
        self.stop_token_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else eos_token_ids
        )
        self.text = IncrementalText(decode, params.stop)

    def is_stop(self, token: int) -> bool:
        """EOS (unless ignored) or one of the request's stop_token_ids."""
        return token in self.stop_token_ids

    @property
    def stopped(self) -> bool:
        """A stop string showed up in the text: the output ends there."""
        return self.text.stopped_by is not None

    def text_after(self, output_token_ids: Sequence[int], stop_token: bool, done: bool) -> str:
        """The text the output's last token adds (`done`: the scheduler ended it; a stop token adds none)."""
        visible = output_token_ids[:-1] if stop_token else output_token_ids
        return self.text.update(visible, final=done)
