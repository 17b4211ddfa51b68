"""Incremental detokenization with stop strings: the text a stream sends, one step at a time.

Decoding only the new ids breaks multi-byte characters and tokenizers that merge spaces, so each step decodes
the whole output and sends what was not sent yet, holding back a trailing replacement character (a
character whose bytes are not all there yet) and any tail that could still grow into a stop string.
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

    def update(self, token_ids: Sequence[int], final: bool = False) -> str:
        """New text to send after `token_ids` (the whole output so far). Sets `stopped_by` on a stop string."""
        text = self.decode(token_ids)
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
            if text.endswith("\ufffd"):
                end -= 1
            end = max(self.sent, end - self._hold)
        delta = text[self.sent : end]
        self.sent = end
        return delta
