"""`GET /kvtune/prefix-report`, which kvtune serve and a kvtune proxy answer and `kvtune doctor` reads: its
path and the shape of its JSON.

The detector (`core.prefix_defeats`) writes the counts, examples and fixes; the front adds whether it runs,
what prompts are grouped by and, on opt-in, each example's span as text. A reader must still check each
field: the report comes over the wire, from any version.
"""

from __future__ import annotations

from typing import Any, TypedDict

REPORT_PATH = "/kvtune/prefix-report"


class ReasonEntry(TypedDict):
    defeats: int  # prompts defeated for this reason
    tokens_lost: int  # prompt tokens that would have hit the cache
    examples: list[dict[str, Any]]  # the newest last: positions, lengths, hashes, `text` on opt-in


class PrefixReport(TypedDict, total=False):
    enabled: bool  # False: the server runs with --no-prefix-detector (then only `reason` says why)
    reason: str
    key: str  # `model`, or `header:<name>` with --prefix-key-header
    block_size: int
    observed: int
    observe_seconds: float
    keys: int
    limits: dict[str, Any]
    reasons: dict[str, ReasonEntry]
    fixes: dict[str, str]  # the fix for each reason, worded for its newest example


def report_url(url: str) -> str:
    """The report beside a /metrics URL (or a server's base URL)."""
    return url.rstrip("/").removesuffix("/metrics") + REPORT_PATH
