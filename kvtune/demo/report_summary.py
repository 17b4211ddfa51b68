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
    """The issue's summary.json: the measured before/after figures (each with its window), failed requests
    by phase and cause, and the ladder's actions in the order they happened, each rung named as `kvtune
    doctor --json` names it."""
    return {
        "failures": {phase: dict(causes) for phase, causes in timeline.failures.items()},
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


def preemptions_in(figures: Figures | None) -> str:
    """ "12 in 24.0 s (30.0/min)": the count, the window it was counted over, and the rate per minute."""
    if figures is None or figures.preemptions is None or figures.preemptions_per_minute is None:
        return NOT_AVAILABLE
    return (
        f"{figures.preemptions:,.0f} in {figures.window_s:,.1f} s ({figures.preemptions_per_minute:,.1f}/min)"
    )


def figures_line(figures: Figures | None) -> str:
    """One line for the terminal: the window, then what was counted over it."""
    if figures is None:
        return NOT_AVAILABLE
    return (
        f"{figures.window} (t {figures.t_from:.0f}-{figures.t_to:.0f} s): preemptions {preemptions_in(figures)}, "
        f"{tokens_per_second(figures.throughput)}, p95 {seconds(figures.p95_latency_s)}, "
        f"hit rate {percent(figures.hit_rate)}"
    )


def outcome_rows(before: Figures | None, after: Figures | None) -> list[OutcomeRow]:
    """The issue's three goals (no preemption once settled, hit rate above 80%, throughput at least the
    starting throughput) judged on the measured figures, plus the p95 latency for reference."""
    throughput_holds = None
    if (
        after is not None
        and before is not None
        and after.throughput is not None
        and before.throughput is not None
    ):
        throughput_holds = after.throughput >= before.throughput
    preemptions_hold = None if after is None or after.preemptions is None else after.preemptions == 0
    hit_rate_holds = None if after is None or after.hit_rate is None else after.hit_rate > HIT_RATE_GOAL
    return [
        OutcomeRow(
            "window",
            NOT_AVAILABLE if before is None else before.window,
            NOT_AVAILABLE if after is None else after.window,
            "",
            "",
        ),
        OutcomeRow(
            "generation throughput",
            tokens_per_second(None if before is None else before.throughput),
            tokens_per_second(None if after is None else after.throughput),
            "at least the starting throughput",
            _verdict(throughput_holds),
        ),
        OutcomeRow(
            "preemptions",
            preemptions_in(before),
            preemptions_in(after),
            "0 once settled",
            _verdict(preemptions_hold),
        ),
        OutcomeRow(
            "p95 request latency",
            seconds(None if before is None else before.p95_latency_s),
            seconds(None if after is None else after.p95_latency_s),
            "(reference)",
            "",
        ),
        OutcomeRow(
            "prefix-cache hit rate",
            percent(None if before is None else before.hit_rate),
            percent(None if after is None else after.hit_rate),
            f"above {HIT_RATE_GOAL:.0%}",
            _verdict(hit_rate_holds),
        ),
    ]


def failure_rows(failures: dict[str, dict[str, int]]) -> list[list[str]]:
    """One row per (phase, cause) with its count, phases in the run's order, the biggest cause first."""
    return [
        [phase, cause, f"{number:,}"]
        for phase, causes in failures.items()
        for cause, number in sorted(causes.items(), key=lambda item: -item[1])
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
