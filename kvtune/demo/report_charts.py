"""The demo's four charts over time (KV usage, preemptions, throughput, prefix hit rate), drawn exactly as
`kvtune report` draws a dashboard panel, with every action of the ladder marked and the phases shaded."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from kvtune.dashboards import panels as p
from kvtune.dashboards.report import Band, Marker, Series, draw_chart
from kvtune.demo.report_summary import HIT_RATE_GOAL, action_labels
from kvtune.demo.timeline import Point, Timeline, span_hit_rate

X_LABEL = "seconds since the demo started"
REQUESTS = "suffix: requests"
PREEMPTIONS = "suffix: preemptions/s"
RATIO_TOP = 1.05  # 1 = 100% stays in view, with the line at 100% off the frame
# Actions closer than this share of the run share one marker, so their labels do not print over each other.
CROWDED = 0.015
# Points further apart than this (s) have a gap between them (the engine restarting): a line across it
# would draw values nobody measured (max_num_seqs ramping 6 -> 256 over a restart).
GAP_S = 3.0
# The hit rate is drawn over a trailing window: a second in which no prompt was admitted looked nothing up.
HIT_RATE_WINDOW_S = 10.0


@dataclass(frozen=True)
class Chart:
    """One PNG: its file, its title, its one-sentence caption for the HTML, and how to read its series."""

    file: str
    title: str
    caption: str
    unit: str
    series: Callable[[list[Point]], list[Series]]
    y_max: float | None = None


def _series(points: list[Point], legend: str, unit: str, value: Callable[[Point], float | None]) -> Series:
    """A missing value becomes NaN, which matplotlib draws as a gap rather than a fake zero; so does the
    time between two points further apart than GAP_S."""
    times: list[float] = []
    values: list[float] = []
    for index, point in enumerate(points):
        if index and point.t - points[index - 1].t > GAP_S:
            times.append((point.t + points[index - 1].t) / 2)
            values.append(math.nan)
        found = value(point)
        times.append(point.t)
        values.append(math.nan if found is None else float(found))
    return Series(legend, unit, times, values)


def _kv_usage(points: list[Point]) -> list[Series]:
    return [
        _series(points, "KV cache usage (left axis)", p.RATIO, lambda q: q.kv_usage),
        _series(points, "max_num_seqs, the limit (right axis)", REQUESTS, lambda q: q.max_num_seqs),
        _series(points, "requests running (right axis)", REQUESTS, lambda q: q.running),
        _series(points, "requests waiting (right axis)", REQUESTS, lambda q: q.waiting),
    ]


def _preemptions(points: list[Point]) -> list[Series]:
    return [_series(points, "preemptions per second", PREEMPTIONS, lambda q: q.preemptions_per_s)]


def _throughput(points: list[Point]) -> list[Series]:
    return [_series(points, "generation throughput", "suffix: generated tokens/s", lambda q: q.throughput)]


def trailing_hit_rate(points: list[Point], window_s: float = HIT_RATE_WINDOW_S) -> list[float | None]:
    """At each point, hit tokens over looked-up tokens across the points of the trailing window (None when
    nothing was looked up in it): how `rate(hits[10s]) / rate(queries[10s])` reads on a dashboard."""
    return [
        span_hit_rate([q for q in points[: i + 1] if point.t - q.t < window_s])
        for i, point in enumerate(points)
    ]


def _hit_rate(points: list[Point]) -> list[Series]:
    ends = [points[0].t, points[-1].t] if points else []
    smoothed = [replace(q, hit_rate=rate) for q, rate in zip(points, trailing_hit_rate(points), strict=True)]
    return [
        _series(
            smoothed, f"prefix-cache hit rate, last {HIT_RATE_WINDOW_S:.0f} s", p.RATIO, lambda q: q.hit_rate
        ),
        Series(f"goal: above {HIT_RATE_GOAL:.0%}", p.RATIO, ends, [HIT_RATE_GOAL] * len(ends)),
    ]


CHARTS = (
    Chart(
        "kv-usage.png",
        "KV cache usage, with the requests running and waiting",
        "How full the engine's KV pool was (left axis, 1 = every block held) and how many requests ran and "
        "waited against the max_num_seqs limit (right axis, dashed; where running meets the limit, the limit "
        "is what holds requests back).",
        p.RATIO,
        _kv_usage,
        RATIO_TOP,
    ),
    Chart(
        "preemptions.png",
        "Preemptions per second (a request evicted from the KV pool to be recomputed later)",
        "How often the engine had to evict a running request because the pool was full; the ladder's goal is "
        "zero.",
        PREEMPTIONS,
        _preemptions,
    ),
    Chart(
        "throughput.png",
        "Generation throughput (tokens generated per second, all clients together)",
        "How much useful work the engine did each second; the remedies must not cost throughput.",
        "suffix: generated tokens/s",
        _throughput,
    ),
    Chart(
        "hit-rate.png",
        "Prefix-cache hit rate (share of prompt tokens served from the cache)",
        "How much of each prompt the engine found already cached; it rises once the timestamp no longer sits at "
        "the head of the shared system prompt; the goal is above 80%.",
        p.RATIO,
        _hit_rate,
        RATIO_TOP,
    ),
)


def phase_bands(points: list[Point], end: float) -> list[Band]:
    """Consecutive points in one phase make one band, from its first point to the next phase's first."""
    bands: list[Band] = []
    for index, point in enumerate(points):
        if index == 0 or point.phase != points[index - 1].phase:
            if bands:
                bands[-1] = Band(bands[-1].start, point.t, bands[-1].label)
            bands.append(Band(point.t, end, point.phase))
    return bands


def action_markers(timeline: Timeline, span: float) -> list[Marker]:
    """One marker per action; actions within a moment of each other share one, a line of label each (drawn side
    by side), so no label prints over another."""
    markers: list[Marker] = []
    actions = sorted(timeline.actions, key=lambda a: a.t)
    for action, label in zip(actions, action_labels(actions, timeline.meta), strict=True):
        if markers and action.t - markers[-1].at <= CROWDED * span:
            markers[-1] = Marker(markers[-1].at, f"{markers[-1].label}\n{label}")
        else:
            markers.append(Marker(action.t, label))
    return markers


def time_window(timeline: Timeline) -> tuple[float, float]:
    """From the start to the last point, action or the run's recorded duration, whichever is latest."""
    ends = [point.t for point in timeline.points] + [action.t for action in timeline.actions]
    duration = timeline.meta.get("duration_s")
    if isinstance(duration, int | float):
        ends.append(float(duration))
    return 0.0, max([*ends, 1.0])


def draw_charts(timeline: Timeline, out_dir: Path) -> list[Chart]:
    """Writes every chart's PNG into `out_dir` and returns the charts drawn."""
    window = time_window(timeline)
    markers = action_markers(timeline, window[1] - window[0])
    bands = phase_bands(timeline.points, window[1])
    for chart in CHARTS:
        draw_chart(
            chart.title,
            chart.unit,
            chart.series(timeline.points),
            window,
            out_dir / chart.file,
            clock=False,
            x_label=X_LABEL,
            markers=markers,
            bands=bands,
            y_max=chart.y_max,
        )
    return list(CHARTS)
