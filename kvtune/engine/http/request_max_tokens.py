"""The max_tokens one request runs with: what the client asked, under the live cap, within the context.

The cap itself is decided by `core.max_tokens_cap.apply_max_tokens_cap`, the one function the proxy uses
too; this adds what only the engine knows, the room the context leaves after the prompt. `requested` None
means the client left it unbounded ("up to the context length", as in vLLM: chat without max_tokens, or an
explicit null): without a cap that is the context's room, with a cap it is the cap (never above the room).
Completions default max_tokens to 16 (OpenAI's legacy default), so a cap never lengthens them.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtune.contract.admin import CAP_HEADER
from kvtune.contract.knobs import CapMode
from kvtune.front.max_tokens_cap import apply_max_tokens_cap


@dataclass(frozen=True)
class CapDecision:
    """What to run with, how to count it, and the header that tells the client (empty when untouched)."""

    max_tokens: int
    counted_as: str | None
    headers: dict[str, str]


class MaxTokensOverCapError(Exception):
    """The cap is in `reject` mode and the request asked for more: the client's 400."""

    def __init__(self, message: str, counted_as: str) -> None:
        super().__init__(message)
        self.message = message
        self.counted_as = counted_as


def choose_max_tokens(
    requested: int | None, prompt_len: int, max_model_len: int, cap: int | None, mode: CapMode
) -> CapDecision:
    """The request's max_tokens under the cap; raises MaxTokensOverCapError when the cap refuses it."""
    decision = apply_max_tokens_cap(requested, cap, mode)
    if decision.error is not None:
        raise MaxTokensOverCapError(decision.error, decision.counted_as or "reject")
    room = max(1, max_model_len - prompt_len)
    if requested is None:
        max_tokens = room if decision.max_tokens is None else min(decision.max_tokens, room)
    else:
        max_tokens = requested if decision.max_tokens is None else decision.max_tokens
    headers = {CAP_HEADER: decision.header} if decision.header is not None else {}
    return CapDecision(max_tokens, decision.counted_as, headers)
