"""The report `kvtune demo` leaves behind: index.html, the PNGs it shows and summary.json, all in one folder
with relative paths so the folder can be moved, zipped or opened from a CI artifact as it is."""

from __future__ import annotations

import html
import json
import time
from pathlib import Path
from typing import Any

from kvtune.demo.report_charts import draw_charts
from kvtune.demo.report_summary import NOT_AVAILABLE, failure_rows, outcome_rows, summary_json
from kvtune.demo.timeline import Timeline
from kvtune.sim.plot import plot_memory_maps
from kvtune.sim.scenarios import seed_config
from kvtune.sim.seed_table import format_table, seed_figures

MEMORY_MAP = "memory-map.png"
SUMMARY = "summary.json"
TIMELINE = "timeline.json"
# How the run's meta keys read in the HTML; a key not listed here is shown under its own name.
META_NAMES = {
    "kv_pool_tokens_auto": "KV pool, 16-bit (tokens)",
    "kv_pool_tokens_fp8": "KV pool, FP8 (tokens)",
    "block_size": "block size (tokens)",
    "clients": "concurrent clients",
    "max_tokens_declared": "max_tokens the clients declare",
    "max_tokens_answered": "tokens the answers actually take (about)",
    "shared_prompt_tokens": "shared system prompt (tokens)",
    "quick": "quick (shortened) run",
    "started_at": "started",
    "duration_s": "duration (s)",
}
VERDICT_CLASSES = {"met": "met", "not met": "not-met"}
STYLE = (
    "body{font-family:sans-serif;max-width:1000px;margin:2em auto;line-height:1.4}"
    "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:.25em .6em;text-align:left}"
    "td.met{color:#16722b}td.not-met{color:#b3261e}pre{background:#f6f6f6;padding:1em;overflow-x:auto}"
)


def _meta_value(key: str, value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if key == "started_at" and isinstance(value, int | float):
        return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(value))
    if isinstance(value, float):
        return f"{value:,.1f}"
    if isinstance(value, int):
        return f"{value:,}"
    return NOT_AVAILABLE if value is None else str(value)


def _table(header: list[str], rows: list[list[str]], classes: list[str] | None = None) -> str:
    head = "".join(f"<th>{html.escape(cell)}</th>" for cell in header)
    body = []
    for index, row in enumerate(rows):
        css = classes[index] if classes else ""
        cells = "".join(
            f"<td class='{css}'>{html.escape(cell)}</td>"
            if i == len(row) - 1 and css
            else f"<td>{html.escape(cell)}</td>"
            for i, cell in enumerate(row)
        )
        body.append(f"<tr>{cells}</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def _figure(name: str, title: str, caption: str) -> str:
    return (
        f"<h3>{html.escape(title)}</h3><p>{html.escape(caption)}</p>"
        f"<a href='{name}'><img src='{name}' alt='{html.escape(title)}' width='960'></a>"
    )


def _failures_section(failures: dict[str, dict[str, int]]) -> str:
    if not failures:
        return "<h2>Failed requests</h2><p>None: every request the clients sent was answered in full.</p>"
    return (
        "<h2>Failed requests, by phase and cause</h2><p>What the clients saw when a request was not answered in "
        "full. While the engine restarts for FP8 its port refuses connections, and the clients retry with a "
        "backoff (0.2 s, doubling to 2 s), as real clients do.</p>"
        + _table(["phase", "cause", "requests"], failure_rows(failures))
    )


def _seed_section(seeds: int) -> str:
    started = time.perf_counter()
    table = format_table(seed_figures(seeds=seeds))
    took = time.perf_counter() - started
    return (
        "<h2>The seed document's figures, simulated</h2>"
        f"<p>The figures of the seed document next to the same runs on kvtune's memory model "
        f"({seeds} random seed{'s' if seeds != 1 else ''}, computed in {took:.1f} s; "
        "<code>kvtune sim --table seed</code> prints it with more seeds).</p>"
        f"<pre>{html.escape(table)}</pre>"
    )


def _memory_map_section(out_dir: Path) -> str:
    plot_memory_maps(seed_config(policy="paged"), str(out_dir / MEMORY_MAP), ("contiguous", "paged"))
    return "<h2>Why paging: the memory map</h2>" + _figure(
        MEMORY_MAP,
        "KV pool over time, contiguous reservations against paged blocks (simulated, the seed's model)",
        "Each column is a moment and each row a stretch of the pool: reserving max_tokens up front (left) leaves "
        "most of the pool held but empty (orange), while paging (right) fills it with tokens (blue).",
    )


def write_index(timeline: Timeline, out_dir: Path, seeds: int, with_simulation: bool) -> Path:
    rows = outcome_rows(timeline.before, timeline.after)
    actions = sorted(timeline.actions, key=lambda a: a.t)
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>kvtune demo report</title>"
        f"<style>{STYLE}</style></head><body>",
        "<h1>kvtune demo report</h1>",
        "<p>A tiny kvtune engine was started with too small a KV pool and too many clients; the operator then "
        "walked its ladder of remedies: cap max_tokens, lower max_num_seqs, flag the prefix-cache defeat, "
        "recommend FP8 KV. Every figure of the run below was measured during it; only the last two sections "
        "(the memory map and the seed's figures) come from the simulator.</p>",
        _table(
            ["setting", "value"],
            [[META_NAMES.get(k, k), _meta_value(k, v)] for k, v in timeline.meta.items()],
        ),
        "<h2>Before and after</h2>",
        '<p>Measured over two named windows: "before", the engine in trouble, observed before the operator '
        'may act; "after", once the operator has held still. Each figure is counted over its window, whose '
        "length the first row gives, and checked against the goals.</p>",
        _table(
            ["figure", "before", "after", "goal", "verdict"],
            [[r.figure, r.before, r.after, r.goal, r.verdict] for r in rows],
            [VERDICT_CLASSES.get(r.verdict, "") for r in rows],
        ),
        _failures_section(timeline.failures),
        "<h2>The ladder, in order</h2>",
        _table(
            ["time (s)", "rung", "what", "knob", "from → to", "evidence"],
            [
                [
                    f"{a.t:.1f}",
                    a.rung,
                    a.kind,
                    a.knob or "",
                    "" if a.before is None and a.after is None else f"{a.before} → {a.after}",
                    a.evidence,
                ]
                for a in actions
            ],
        )
        if actions
        else "<p>No action was taken.</p>",
        "<h2>Over time</h2>",
        "<p>Each dotted line is an action, labelled with what changed; the shaded bands are the demo's phases.</p>",
    ]
    parts += [_figure(chart.file, chart.title, chart.caption) for chart in draw_charts(timeline, out_dir)]
    if with_simulation:
        parts += [_memory_map_section(out_dir), _seed_section(seeds)]
    parts.append(
        f"<p>Machine-readable: <a href='{SUMMARY}'>{SUMMARY}</a> (before, after, actions) and "
        f"<a href='{TIMELINE}'>{TIMELINE}</a> (every point).</p></body></html>"
    )
    index = out_dir / "index.html"
    index.write_text("\n".join(parts) + "\n")
    return index


def write_report(timeline: Timeline, out_dir: Path, *, seeds: int = 1, with_simulation: bool = True) -> Path:
    """Writes summary.json, timeline.json, the PNGs and index.html into `out_dir`; returns index.html's path.
    `seeds` random seeds per simulated seed figure: one keeps the report to a few seconds. Without
    `with_simulation` the memory map and the seed figures (the same for every run) are left out, to redraw
    a saved timeline in a moment."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / SUMMARY).write_text(json.dumps(summary_json(timeline), indent=1) + "\n")
    (out_dir / TIMELINE).write_text(json.dumps(timeline.to_json(), indent=1) + "\n")
    return write_index(timeline, out_dir, seeds, with_simulation)
