"""Incremental detokenization with stop strings: the text a stream sends, one step at a time.

Decoding only the newest id breaks multi-byte characters and tokenizers that merge spaces; decoding the whole
output every step costs O(length) per token (a quarter of a decode step at 1,500 tokens). So each step
decodes a short window: the ids since the last emitted text plus the ids before them that give the
tokenizer its context, and emits what that window adds. A window whose text ends in a replacement character
(a character whose bytes are not all there yet) waits for more ids, and any tail that could still grow into
a stop string is held back until it cannot.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

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
