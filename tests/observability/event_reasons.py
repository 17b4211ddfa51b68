"""The Event reasons the operator's code posts, read from its source: the runbooks' table and the Apply
safety page are both checked against this one set."""

from __future__ import annotations

import re
from pathlib import Path

OPERATOR = Path(__file__).resolve().parents[2] / "kvtune" / "operator"


def event_reasons_in_code() -> set[tuple[str, str]]:
    """(reason, type) of every Event the operator's code posts: EventSpec("Type", "Reason", ...), the
    findings' table (Posting("Type", "Reason", ..., ended=("Type", "Reason"))) and the history kinds'
    reasons (EVENT_REASONS)."""
    found: set[tuple[str, str]] = set()
    for path in OPERATOR.rglob("*.py"):  # every room
        text = path.read_text()
        found |= {
            (reason, kind)
            for kind, reason in re.findall(r'EventSpec\(\s*"(Normal|Warning)",\s*"(\w+)"', text)
        }
        found |= {
            (reason, kind) for kind, reason in re.findall(r'"\w+": \("(Normal|Warning)", "(\w+)"\)', text)
        }
        found |= {
            (reason, kind)
            for kind, reason in re.findall(r'(?:Posting\(|ended=\()\s*"(Normal|Warning)",\s*"(\w+)"', text)
        }
    return found
