"""The max_tokens cap as the proxy applies it to a request body it forwards (rung 1 in front of vLLM, which
has no server-side ceiling since vLLM #34063).

The decision itself is `kvtune.front.max_tokens_cap`, shared with the engine; this module only finds the
fields a body asks with, rewrites them when the decision changed them, and holds the live setting the admin
API changes. A body the cap leaves alone is forwarded as the very bytes the client sent.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvtune.contract.admin import CapSetting
from kvtune.front.max_tokens_cap import apply_max_tokens_cap

# Chat requests may ask with either field (OpenAI deprecated max_tokens for max_completion_tokens); vLLM
# reads max_completion_tokens first, as the engine does.
CHAT_FIELDS = ("max_completion_tokens", "max_tokens")
COMPLETION_FIELDS = ("max_tokens",)


@dataclass(frozen=True)
class CappedBody:
    """What to forward: `content` None means the client's bytes unchanged; `error` a 400 instead."""

    content: bytes | None = None
    counted_as: str | None = None
    header: str | None = None
    error: str | None = None
    param: str | None = None


def _requested(body: dict[str, Any], fields: tuple[str, ...]) -> tuple[str | None, int | None, str | None]:
    """(field, value, problem): the first field the client set to a number, or the problem with it."""
    for field in fields:
        value = body.get(field)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            return field, None, f"{field} must be an integer, got {json.dumps(value)}"
        return field, value, None
    return None, None, None


def cap_body(body: dict[str, Any], fields: tuple[str, ...], setting: CapSetting) -> CappedBody:
    """Apply `setting` to a parsed request body whose max-tokens fields are `fields`."""
    if setting.cap is None:
        return CappedBody()
    field, requested, problem = _requested(body, fields)
    if problem is not None:
        return CappedBody(error=problem, param=field)
    decision = apply_max_tokens_cap(requested, setting.cap, setting.mode)
    if decision.error is not None:
        return CappedBody(counted_as=decision.counted_as, error=decision.error, param=field)
    if decision.max_tokens == requested:
        return CappedBody()
    rewritten = dict(body)
    # Every field the client set is lowered, so the upstream reads the cap whichever one it prefers.
    for name in fields:
        if rewritten.get(name) is not None:
            rewritten[name] = decision.max_tokens
    if field is None:
        rewritten[fields[-1]] = decision.max_tokens
    content = json.dumps(rewritten, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    return CappedBody(content=content, counted_as=decision.counted_as, header=decision.header)
