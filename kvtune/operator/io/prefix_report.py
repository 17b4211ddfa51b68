"""Read a front's `GET /kvtune/prefix-report` (kvtune serve, or a kvtune proxy in front of vLLM / SGLang)
and turn it into one entry per defeat reason: how many prompts, the tokens lost, where the span lies and
the fix. The metrics say which reasons moved; only the report knows positions, so the doctor reads both.

A server without the route (vLLM, SGLang: 404), one that is down, or an answer that is not the report's
shape gives None: the report is extra evidence, never a reason to fail.
"""

from __future__ import annotations

from typing import Any, cast

import httpx

from kvtune.contract.prefix_report import PrefixReport
from kvtune.operator.decide.prefix_fixes import fix_text, where_text
from kvtune.operator.io.http import shared_client


def fetch_report(url: str, timeout: float = 5.0) -> PrefixReport | None:
    """The report's JSON, or None when the server has none to give."""
    try:
        response = shared_client().get(url, timeout=timeout)
        data = response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, httpx.InvalidURL, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("reasons"), dict):
        return None
    return cast(PrefixReport, data)


def _number(value: object) -> float:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0


def defeat_entries(report: PrefixReport) -> list[dict[str, Any]]:
    """One entry per reason with defeats, most tokens lost first: prompts, tokens lost, where the span lies
    (from the newest example), and the fix (the report's own wording when it has one)."""
    block = report.get("block_size") if isinstance(report.get("block_size"), int) else None
    given = report.get("fixes")
    fixes: dict[str, Any] = given if isinstance(given, dict) else {}
    entries: list[dict[str, Any]] = []
    for reason, found in report["reasons"].items():
        if not isinstance(found, dict) or _number(found.get("defeats")) <= 0:
            continue
        defeats, lost = _number(found.get("defeats")), _number(found.get("tokens_lost"))
        examples = [e for e in found.get("examples") or [] if isinstance(e, dict)]
        example = examples[-1] if examples else {}
        fix = fixes.get(reason)
        if not isinstance(fix, str) or not fix:
            fix = fix_text(reason, shared=lost / defeats, block=block)
        entries.append({
            "reason": reason,
            "defeats": int(defeats),
            "tokens_lost": int(lost),
            "where": where_text(reason, example, block),
            "fix": fix,
            "example": example or None,
        })  # fmt: skip
    entries.sort(key=lambda e: (-e["tokens_lost"], -e["defeats"], e["reason"]))
    return entries


def entry_line(entry: dict[str, Any]) -> str:
    """`varying_head: tokens 0-11 vary (...), then 2,000 shared tokens; 64 requests, 120,000 tokens lost: fix`"""
    where = f"{entry['where']}; " if entry["where"] else ""
    return (
        f"{entry['reason']}: {where}{entry['defeats']:,} requests, {entry['tokens_lost']:,} tokens lost: "
        f"{entry['fix']}"
    )
