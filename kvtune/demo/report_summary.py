"""The demo's measured outcome in words and numbers: summary.json, the before/after rows with the issue's
goals checked against them, and a short label per action for the charts. Pure: values in, values out."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

from kvtune.demo.timeline import Action, Figures, Timeline

NOT_AVAILABLE = "n/a"
# The meta keys the report reads for the FP8 label (the others it only lists).
POOL_AUTO, POOL_FP8 = "kv_pool_tokens_auto", "kv_pool_tokens_fp8"
HIT_RATE_GOAL = 0.8
FLAG_WHERE = re.compile(r"^(\w+): tokens (\d+(?:-\d+)?)")


def summary_json(timeline: Timeline) -> dict[str, Any]:
    """The issue's summary.json: the measured before/after figures and the ladder's actions in the order
    they happened, each rung named as `kvtune doctor --json` names it."""
    return {
        "before": None if timeline.before is None else asdict(timeline.before),
        "after": None if timeline.after is None else asdict(timeline.after),
        "actions": [
            {
                "rung": action.rung,
                "time": action.t,
                "from": action.before,
                "to": action.after,
                "evidence": action.evidence,
                "kind": action.kind,
            }
            for action in sorted(timeline.actions, key=lambda a: a.t)
        ],
    }


def tokens_per_second(value: float | None) -> str:
    return NOT_AVAILABLE if value is None else f"{value:,.1f} tokens/s"


def count(value: float | None) -> str:
    return NOT_AVAILABLE if value is None else f"{value:,.0f}"


def seconds(value: float | None) -> str:
    return NOT_AVAILABLE if value is None else f"{value:,.2f} s"


def percent(value: float | None) -> str:
    return NOT_AVAILABLE if value is None else f"{100 * value:.1f}%"


@dataclass(frozen=True)
class OutcomeRow:
    """One line of the before/after table: the figure, both measurements, the goal and whether it was met
    ("met", "not met", or n/a when a measurement is missing)."""

    figure: str
    before: str
    after: str
    goal: str
    verdict: str


def _verdict(holds: bool | None) -> str:
    return NOT_AVAILABLE if holds is None else ("met" if holds else "not met")


def outcome_rows(before: Figures | None, after: Figures | None) -> list[OutcomeRow]:
    """The issue's three goals (no preemption in the last minute, hit rate above 80%, throughput at least the
    starting throughput) judged on the measured figures, plus the p95 latency for reference."""
    empty = Figures(None, None, None, None)
    b, a = before or empty, after or empty
    throughput_holds = None if a.throughput is None or b.throughput is None else a.throughput >= b.throughput
    preemptions_hold = None if a.preemptions_last_minute is None else a.preemptions_last_minute == 0
    hit_rate_holds = None if a.hit_rate is None else a.hit_rate > HIT_RATE_GOAL
    return [
        OutcomeRow(
            "generation throughput",
            tokens_per_second(b.throughput),
            tokens_per_second(a.throughput),
            "at least the starting throughput",
            _verdict(throughput_holds),
        ),
        OutcomeRow(
            "preemptions over the last minute",
            count(b.preemptions_last_minute),
            count(a.preemptions_last_minute),
            "0",
            _verdict(preemptions_hold),
        ),
        OutcomeRow(
            "p95 request latency", seconds(b.p95_latency_s), seconds(a.p95_latency_s), "(reference)", ""
        ),
        OutcomeRow(
            "prefix-cache hit rate",
            percent(b.hit_rate),
            percent(a.hit_rate),
            f"above {HIT_RATE_GOAL:.0%}",
            _verdict(hit_rate_holds),
        ),
    ]


def _change(action: Action) -> str:
    if action.before is None and action.after is None:
        return ""
    return f" {NOT_AVAILABLE if action.before is None else action.before}→{action.after}"


def _pool_ratio(action: Action, meta: dict[str, Any]) -> float | None:
    """The FP8 pool over the 16-bit one: from the action's own from/to when they are pool sizes, else from
    the run's meta."""
    for auto, fp8 in ((action.before, action.after), (meta.get(POOL_AUTO), meta.get(POOL_FP8))):
        if isinstance(auto, int | float) and isinstance(fp8, int | float) and auto > 0:
            return float(fp8) / float(auto)
    return None


def action_labels(actions: list[Action], meta: dict[str, Any]) -> list[str]:
    """Each action's label, in order, saying when it repeats an earlier one: the cap the operator puts back
    on a restarted engine is "cap max_tokens 360 re-applied", not a second decision; a second flag (requests
    queued before the prompt layout moved still carry the old one) is "flag again: ..."."""
    labels: list[str] = []
    seen: set[tuple[str, str, str]] = set()
    for action in actions:
        label = action_label(action, meta)
        key = (action.rung, action.kind, "" if action.kind == "flagged" else str(action.after))
        if key in seen and action.kind == "applied":
            label = f"{action.knob or action.rung} {action.after} re-applied"
        elif key in seen and action.kind == "flagged":
            label = f"flag again: {label.removeprefix('flag: ')}"
        seen.add(key)
        labels.append(label)
    return labels


def action_label(action: Action, meta: dict[str, Any]) -> str:
    """A few words a chart can carry beside the action's line: "cap max_tokens 2048→320", "max_num_seqs
    64→9", "flag: varying_head tokens 0-11", "timestamp moved", "FP8 KV: pool 2x"."""
    if action.kind == "user" and action.rung == "flag_prefix_defeat":
        return "timestamp moved"
    if action.kind == "user" and action.rung == "recommend_fp8_kv":
        ratio = _pool_ratio(action, meta)
        return "FP8 KV: restarted" if ratio is None else f"FP8 KV: pool {ratio:.3g}x"
    if action.kind == "flagged":
        where = FLAG_WHERE.match(action.evidence)
        return f"flag: {where.group(1)} tokens {where.group(2)}" if where else "flag: prefix defeat"
    if action.kind == "recommended":
        return "recommend FP8 KV" if action.rung == "recommend_fp8_kv" else f"recommend {action.rung}"
    if action.kind == "rolled_back":
        return f"roll back {action.knob or action.rung}{_change(action)}"
    if action.rung == "cap_max_tokens" and action.before is None:
        return f"cap max_tokens at {action.after}"
    if action.rung == "cap_max_tokens":
        return f"cap max_tokens{_change(action)}"
    return f"{action.knob or action.rung}{_change(action)}"
