"""Why a prompt missed the prefix cache, and what to change, in words a person can act on.

The reasons and their one-line fixes are the prefix-defeat detector's (`kvtune.core.prefix_defeats`, whose
`report()` carries them as `fixes`). The operator reads the detector only over HTTP, and when it reads
Prometheus it has no report at all, so it keeps this table beside the metrics it names;
tests/operator/test_prefix_fixes.py pins it to the detector's. Also here: the sentence that says where a
defeat's span lies in a prompt, from one of the report's examples.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# The `reason` label values of kvtune:prefix_defeats_total / kvtune:prefix_defeat_tokens_total.
REASONS: tuple[str, ...] = ("varying_head", "shorter_than_block", "misaligned", "salted", "evicted")

FIXES: dict[str, str] = {
    "varying_head": "move the varying span (timestamp, request id, user name) after the shared prompt",
    "shorter_than_block": (
        "the shared prefix is {shared} tokens, under one block of {block}: lengthen it or use a smaller block"
    ),
    "misaligned": "put the shared document before the variable-length preamble",
    "salted": "use one cache_salt per tenant, not per request",
    "evicted": (
        "the blocks were evicted {since} before reuse: more KV memory (FP8 KV, larger "
        "gpu_memory_utilization) or fewer concurrent sequences"
    ),
}


def fix_text(
    reason: str, *, shared: float | None = None, block: int | None = None, since_s: float | None = None
) -> str:
    """The fix for `reason`, with the figures filled in where they are known (and worded around them where
    they are not: metrics carry no eviction age, only a report's examples do)."""
    template = FIXES.get(reason)
    if template is None:
        return f"unknown reason {reason!r}: see the engine's /kvtune/prefix-report"
    shared_text = f"~{shared:,.0f}" if shared is not None else "a few"
    block_text = f"{block}" if block is not None else "B"
    since_text = f"{since_s:,.0f} s" if since_s is not None else "shortly"
    return template.format(shared=shared_text, block=block_text, since=since_text)


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
