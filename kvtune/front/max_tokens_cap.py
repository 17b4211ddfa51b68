"""The server-side max_tokens cap (rung 1 of the remedy ladder), decided the same way by every front.

A request's `max_tokens` bounds how many blocks it may grow into; a client that asks for far more than it
needs (or leaves it unset, which means "up to the context length") lets the scheduler admit work it cannot
finish, and that is what preempts. The cap applies in the engine and in the proxy in front of vLLM or
SGLang (vLLM has no server-side ceiling since vLLM #34063), so both call this one function.

- no cap: the request runs as asked;
- no `max_tokens` asked: the cap is the default (counted as `default`);
- more than the cap: `clamp` lowers it (and the front says so in a response header), `reject` refuses it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtune.contract.knobs import CAP_MODES, CapMode
from kvtune.contract.metrics import CAPPED_DEFAULT

OVER_CAP_CODE = "max_tokens_over_cap"  # the `code` of the 400 a rejected request gets, from either server


@dataclass(frozen=True)
class CapDecision:
    """What to run with. `max_tokens` None: leave the request's own (absent) value alone."""

    max_tokens: int | None
    # The label this request is counted under in kvtune:capped_requests_total (`CAPPED_LABELS`), or None if
    # the cap did nothing.
    counted_as: str | None = None
    # The 400 message when the cap rejects the request.
    error: str | None = None
    # The value of CAP_HEADER when the cap changed max_tokens.
    header: str | None = None


def apply_max_tokens_cap(requested: int | None, cap: int | None, mode: CapMode) -> CapDecision:
    """Decide one request's max_tokens under the cap (pure; the caller counts, sets headers, replies)."""
    if mode not in CAP_MODES:
        raise ValueError(f"cap mode must be one of {', '.join(CAP_MODES)}, got {mode!r}")
    if cap is None:
        return CapDecision(requested)
    if requested is None:
        return CapDecision(cap, CAPPED_DEFAULT, header=f"defaulted to {cap}")
    if requested <= cap:
        return CapDecision(requested)
    if mode == "reject":
        message = (
            f"max_tokens {requested} exceeds this server's cap of {cap} (--max-tokens-cap); "
            f"ask for at most {cap}"
        )
        return CapDecision(None, "reject", error=message)
    return CapDecision(cap, "clamp", header=f"capped from {requested} to {cap}")
