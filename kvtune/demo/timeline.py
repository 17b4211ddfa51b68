"""The demo's timeline: what the live view showed and what the operator did, second by second.

The contract between the demo's run (`kvtune.demo.run_demo`) and its report (`kvtune.demo.report`): pure
dataclasses and JSON, so a report can be drawn again from a saved run without starting an engine.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

# the ladder's rungs, named as `kvtune doctor --json` names them
RUNGS = ("cap_max_tokens", "lower_max_num_seqs", "flag_prefix_defeat", "recommend_fp8_kv")


@dataclass(frozen=True)
class Point:
    """One operator interval (about 1 s): the engine's figures over it and the knobs it held."""

    t: float  # seconds since the demo started
    phase: str  # e.g. "1 cap max_tokens", "2 lower max_num_seqs", "3 prefix defeat", "4 FP8 KV", "settled"
    kv_usage: float | None  # 0..1, vllm:kv_cache_usage_perc
    preemptions_per_s: float | None  # from vllm:num_preemptions_total over the interval
    throughput: float | None  # generation tokens/s over the interval
    hit_rate: float | None  # prefix-cache hits / queries (tokens) over the interval, 0..1
    max_num_seqs: int | None
    max_tokens_cap: int | None  # None: no cap
    running: float | None
    waiting: float | None
    prefix_queries: float | None = None  # prompt tokens looked up in the prefix cache over the interval
    prefix_hits: float | None = None  # of those, the tokens found: a span's hit rate is hits / queries
    preemptions: float | None = None  # vllm:num_preemptions_total's increase over the interval


@dataclass(frozen=True)
class Action:
    """One thing done to the engine or its workload, by the operator or by the demo acting as the user."""

    t: float
    rung: str  # one of RUNGS
    kind: str  # applied | recommended | flagged | rolled_back | user
    knob: str | None
    before: int | str | None
    after: int | str | None
    evidence: str  # one line


@dataclass(frozen=True)
class Figures:
    """A "before" or "after" window's figures, measured over the points in (t_from, t_to]: each says what it
    counts and over how long, so "12 preemptions in 24 s" is never read as a minute's worth. Not the
    operator's `JudgedFigures` (what one tuning action is judged by): these are the demo's report of a phase
    of its own run, as its client and the engine's metrics saw it."""

    window: str  # what the window is, in words
    t_from: float  # seconds since the demo started
    t_to: float
    window_s: float
    preemptions: float | None  # the preemption counter's increase over the window
    preemptions_per_minute: float | None  # preemptions / window_s x 60
    throughput: float | None  # generation tokens/s, the mean of the window's intervals
    p95_latency_s: float | None  # end-to-end request latency of the requests finished in the window, p95
    hit_rate: float | None


def _figures(data: dict[str, Any] | None) -> Figures | None:
    return None if data is None else Figures(**data)


@dataclass
class Timeline:
    points: list[Point] = field(default_factory=list)
    actions: list[Action] = field(default_factory=list)
    before: Figures | None = None
    after: Figures | None = None
    # kv pool tokens (auto and fp8), block size, clients, max_tokens declared/answered, shared prompt
    # tokens, quick flag, started_at (epoch), duration_s
    meta: dict[str, Any] = field(default_factory=dict)
    # failed requests: phase -> cause -> count (an engine restarting refuses connections, say)
    failures: dict[str, dict[str, int]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "points": [asdict(p) for p in self.points],
            "actions": [asdict(a) for a in self.actions],
            "before": None if self.before is None else asdict(self.before),
            "after": None if self.after is None else asdict(self.after),
            "meta": dict(self.meta),
            "failures": {phase: dict(causes) for phase, causes in self.failures.items()},
        }

    @staticmethod
    def from_json(data: dict[str, Any]) -> Timeline:
        return Timeline(
            points=[Point(**p) for p in data.get("points", [])],
            actions=[Action(**a) for a in data.get("actions", [])],
            before=_figures(data.get("before")),
            after=_figures(data.get("after")),
            meta=dict(data.get("meta", {})),
            failures={phase: dict(causes) for phase, causes in data.get("failures", {}).items()},
        )


def span_hit_rate(points: list[Point]) -> float | None:
    """Prefix-cache hit tokens over looked-up tokens across the points; None when nothing was looked up."""
    counted = [p for p in points if p.prefix_queries is not None and p.prefix_hits is not None]
    queries = sum(p.prefix_queries or 0.0 for p in counted)
    return round(sum(p.prefix_hits or 0.0 for p in counted) / queries, 3) if queries > 0 else None
