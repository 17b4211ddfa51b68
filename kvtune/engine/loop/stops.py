"""When an output ends: EOS, stop_token_ids, stop strings and max_tokens, all decided here.

The scheduler of kvtune.core ends a request (and frees its blocks) on what it can count, in
`update_from_output`: a stop token (said here, `is_stop`) or max_tokens. Only the engine sees text, so stop
strings are found here, in the detokenized output, and they outrank max_tokens (vLLM checks them first):
the finish reason is "stop" either way. The checker only says so; the output processor ends the request.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtune.engine.loop.detokenize import Decoder, IncrementalText
from kvtune.engine.model.sampling import SamplingParams


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
