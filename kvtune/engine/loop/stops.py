"""When an output ends: EOS, stop_token_ids, stop strings and max_tokens, all decided here.

The scheduler of kvtune.core ends a request (and frees its blocks) on what it can count, in
`update_from_output`: a stop token (said here, `is_stop`) or max_tokens. Only the engine sees text, so stop
strings are found here, in the detokenized output, and they outrank max_tokens (vLLM checks them first):
the finish reason is "stop" either way.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtune.core import Request, Scheduler
from kvtune.core.request import FinishReason
from kvtune.engine.loop.detokenize import Decoder, IncrementalText
from kvtune.engine.model.sampling import SamplingParams


@dataclass(frozen=True)
class TokenOutcome:
    """What one sampled token did to its output."""

    finished: bool
    new_text: str
    stop_token: bool  # EOS or a stop_token_id: it ends the output but is neither text nor given logprobs


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

    def text_after(self, scheduler: Scheduler, req: Request, stop_token: bool, done: bool) -> TokenOutcome:
        """The text `req`'s last appended token adds (`done`: the scheduler ended it), ending `req` on a stop
        string."""
        visible = req.output_token_ids[:-1] if stop_token else req.output_token_ids
        new_text = self.text.update(visible, final=done)
        if self.text.stopped_by is not None:
            if done:
                req.finish_reason = FinishReason.STOP
            else:
                scheduler.finish(req, FinishReason.STOP)
                done = True
        return TokenOutcome(done, new_text, stop_token)
