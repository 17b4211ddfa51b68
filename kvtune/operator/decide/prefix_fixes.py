"""Why a prompt missed the prefix cache, and what to change, in words a person can act on.

The reasons and their one-line fixes are the prefix-defeat detector's (`kvtune.core.prefix_defeats`, which
the operator may import: it is pure core). Its report carries them filled with an example's figures; from
metrics alone (Prometheus, no report) the operator fills in what the series say: the block size, and for
`shorter_than_block` the shared prefix's length (tokens lost per defeat). Also here: the sentence that says
where a defeat's span lies in a prompt, from one of the report's examples.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvtune.core.prefix_defeats import REASONS, DefeatFinding, fix_for

__all__ = ["REASONS", "fix_text", "where_text"]


def fix_text(reason: str, *, shared: float | None = None, block: int | None = None) -> str:
    """The detector's fix for `reason`, with the figures the metrics give (`shared`: tokens lost per
    defeat, which for `shorter_than_block` is the shared prefix's length)."""
    if reason not in REASONS:
        return f"unknown reason {reason!r}: see the server's /kvtune/prefix-report"
    if block is None:
        if reason == "shorter_than_block":
            return "the shared prefix is under one block: lengthen it or use a smaller block"
        block = 0  # only shorter_than_block's wording uses it
    finding = None
    if reason == "shorter_than_block" and shared:
        length = round(shared)
        finding = DefeatFinding(reason, length, 0, length, 0, length, block_size=block)
    return fix_for(reason, block, finding)


def _int(example: Mapping[str, Any], key: str) -> int | None:
    value = example.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def where_text(reason: str, example: Mapping[str, Any], block: int | None) -> str | None:
    """Where the defeat lies in the prompt, from one report example (positions and lengths, never text);
    None when the example lacks the fields this reason needs."""
    span_start, span_length = _int(example, "span_start"), _int(example, "span_length")
    shared_start, shared_length = _int(example, "shared_start"), _int(example, "shared_length")
    if reason == "varying_head" and span_start is not None and span_length and shared_length:
        end = span_start + span_length - 1
        return f"tokens {span_start}-{end} vary (a timestamp or id?), then {shared_length:,} shared tokens"
    if reason == "shorter_than_block" and span_length is not None:
        under = f", under one block of {block}" if block else ""
        return f"the shared prefix is {span_length:,} tokens{under}"
    if reason == "misaligned" and shared_start is not None and shared_length:
        shift = _int(example, "offset_shift")
        off_grid = f" ({shift % block} off the block grid)" if shift is not None and block else ""
        moved = f", shifted {shift:,} tokens against an earlier prompt{off_grid}" if shift is not None else ""
        return f"{shared_length:,} shared tokens start at token {shared_start:,}{moved}"
    if reason == "salted" and span_length:
        return f"{span_length:,} identical tokens missed under a per-request cache_salt"
    if reason == "evicted" and span_length:
        since = example.get("since_last_use_s")
        ago = f", last used {since:,.1f} s earlier" if isinstance(since, int | float) else ""
        return f"{span_length:,} tokens' blocks were evicted before reuse{ago}"
    return None
