"""`kvtune report`: the dashboards' panels drawn from a Prometheus with matplotlib, one PNG per panel and an
index.html, for people without Grafana (and for the demo). It reads the same `panels.py` as the dashboards,
with every variable at "All"."""

from __future__ import annotations

import argparse
import html
import math
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import matplotlib.dates as mdates
from matplotlib import patheffects
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from kvtune.dashboards import panels as p
from kvtune.dashboards.grafana import TITLES
from kvtune.errors import KvtuneError

# Axis labels for the panels' Grafana units.
AXIS_LABELS = {
    p.RATIO: "ratio (1 = 100%)",
    p.SECONDS: "seconds",
    p.PER_SECOND: "per second",
    p.COUNT: "count",
}
DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
SECONDS_PER = {"s": 1, "m": 60, "h": 3600, "d": 86400}
MAX_POINTS = 240
# Rough sizes, in pixels, to tell whether a band's name fits over it.
PLOT_WIDTH_PX = 750
BAND_LABEL_PX_PER_CHAR = 4.5


@dataclass(frozen=True)
class Series:
    legend: str
    unit: str
    times: list[float]
    values: list[float]


def parse_duration(text: str) -> float:
    """`30m`, `1h`, `2d` -> seconds."""
    match = DURATION.match(text.strip())
    if not match or float(match.group(1)) <= 0:
        raise KvtuneError(f"--since {text!r} is not a duration such as 30m, 1h or 2d")
    return float(match.group(1)) * SECONDS_PER[match.group(2)]


# Grafana's $__rate_interval for its default 15 s scrape: the larger of four scrapes and a step plus one.
SCRAPE_INTERVAL_S = 15


def rate_interval(step: float = 0.0) -> str:
    """What Grafana puts in `$__rate_interval` for a query at `step` seconds: a window that never skips a
    counter's step between two points."""
    return f"{math.ceil(max(4 * SCRAPE_INTERVAL_S, step + SCRAPE_INTERVAL_S))}s"


def all_variables(expr: str, step: float = 0.0) -> str:
    """The query with every dashboard variable at "All" (`.*`, which also matches a missing label), and
    Grafana's rate interval as Grafana would size it for `step`."""
    expr = expr.replace(p.RATE_INTERVAL, rate_interval(step))
    return re.sub(r"\$[a-z_]+", ".*", expr)


def legend_of(template: str, labels: dict[str, str]) -> str:
    """Grafana's `{{label}}` legend filled in from a series' labels (an absent label becomes empty)."""
    filled = re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template)
    return " ".join(filled.split()) or "value"


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.client = httpx.Client(timeout=30.0)

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, object]]:
        params: dict[str, str | float] = {"query": expr, "start": start, "end": end, "step": step}
        try:
            response = self.client.get(f"{self.url}/api/v1/query_range", params=params)
        except httpx.HTTPError as err:
            raise KvtuneError(f"cannot reach Prometheus at {self.url}: {err}") from err
        try:
            body = response.json()
        except ValueError:
            body = None
        if response.status_code == 404 or not isinstance(body, dict):
            raise KvtuneError(
                f"{self.url} is not a Prometheus API: /api/v1/query_range answered {response.status_code}"
            )
        if response.status_code != 200 or body.get("status") != "success":
            raise KvtuneError(f"Prometheus rejected {expr!r}: {body.get('error', response.status_code)}")
        result: list[dict[str, object]] = body["data"]["result"]
        return result


def fetch_panel(prom: Prometheus, spec: p.PanelSpec, start: float, end: float, step: float) -> list[Series]:
    series = []
    for target in spec.targets:
        for item in prom.query_range(all_variables(target.expr, step), start, end, step):
            labels = item.get("metric", {})
            points = [
                (float(t), float(v))
                for t, v in item.get("values", [])  # type: ignore[attr-defined]
                if math.isfinite(float(v))
            ]
            if points:
                series.append(
                    Series(
                        legend_of(target.legend, labels),  # type: ignore[arg-type]
                        target.unit,
                        [t for t, _ in points],
                        [v for _, v in points],
                    )
                )
    return series


def axis_label(unit: str) -> str:
    return unit.split(":", 1)[1].strip() if unit.startswith("suffix:") else AXIS_LABELS.get(unit, unit)


def _when(timestamps: list[float]) -> list[float]:
    """Unix seconds as matplotlib's date numbers (days since its 1970 epoch), drawn in UTC."""
    return [t / SECONDS_PER["d"] for t in timestamps]


def _seconds(values: list[float]) -> list[float]:
    """Plain seconds, drawn as they are."""
    return list(values)


@dataclass(frozen=True)
class Marker:
    """A moment worth a vertical line and a short label on a chart (an operator's action, say)."""

    at: float
    label: str


@dataclass(frozen=True)
class Band:
    """A stretch of time shaded and named at the top of a chart (a phase of the demo, say)."""

    start: float
    end: float
    label: str


def draw_panel(spec: p.PanelSpec, series: list[Series], window: tuple[float, float], path: Path) -> None:
    """One dashboard panel as a PNG, over a wall-clock window."""
    draw_chart(f"{spec.title}  ({TITLES[spec.dashboard_uid]})", spec.unit, series, window, path)


def draw_chart(
    title: str,
    unit: str,
    series: list[Series],
    window: tuple[float, float],
    path: Path,
    *,
    clock: bool = True,
    x_label: str = "time (UTC)",
    markers: Sequence[Marker] = (),
    bands: Sequence[Band] = (),
    y_max: float | None = None,
) -> None:
    """One PNG: the title, the unit on each axis, a legend per series beside the plot (never over it), and a
    second unit (preemptions over a latency) dashed on a right axis. `clock` draws x as UTC wall time (unix
    seconds); without it x is plain seconds (the demo's seconds since it started). Markers and bands name
    what happened when; a band too narrow for its name shows its first word. `y_max` fixes the left axis's
    top (a ratio's 1 = 100% in view)."""
    x = _when if clock else _seconds
    figure = Figure(figsize=(11, 4.5), dpi=100, layout="constrained")  # no pyplot: no global state
    left = figure.subplots()
    left.set_title(title, fontsize=11, pad=14 if bands else 6)  # room for the bands' names above the plot
    left.set_ylabel(axis_label(unit))
    span = (window[1] - window[0]) or 1.0
    for index, band in enumerate(bands):
        start, end = x([band.start, band.end])
        left.axvspan(start, end, color="0.5", alpha=0.12 if index % 2 else 0.04, linewidth=0)
        fits = len(band.label) * BAND_LABEL_PX_PER_CHAR <= PLOT_WIDTH_PX * (band.end - band.start) / span
        left.annotate(band.label if fits else band.label.split()[0], ((start + end) / 2, 1.0),
                      xycoords=("data", "axes fraction"), xytext=(0, 2), textcoords="offset points",
                      ha="center", va="bottom", fontsize=7, color="0.35")  # fmt: skip
    handles: list[Line2D] = []
    for s in series:
        if s.unit == unit:
            handles += left.plot(x(s.times), s.values, "-", color=f"C{len(handles) % 10}", label=s.legend)
    others = [s for s in series if s.unit != unit]
    if others:
        right = left.twinx()
        right.set_ylabel(axis_label(others[0].unit))
        for s in others:
            color = f"C{len(handles) % 10}"
            handles += right.plot(x(s.times), s.values, "--", color=color, label=s.legend)
        right.set_ylim(bottom=0)
    for marker in markers:
        (at,) = x([marker.at])
        left.axvline(at, color="black", linestyle=":", linewidth=1)
        left.annotate(marker.label, (at, 0.97), xycoords=("data", "axes fraction"), xytext=(-2, 0),
                      textcoords="offset points", rotation=90, ha="right", va="top", fontsize=8,
                      path_effects=[patheffects.withStroke(linewidth=3, foreground="white")])  # fmt: skip
    if handles:
        figure.legend(handles=handles, loc="outside right upper", fontsize=8)
    else:
        left.text(0.5, 0.5, "no data in this window", ha="center", va="center", transform=left.transAxes)
    left.set_xlim(*x(list(window)))
    left.set_ylim(bottom=0, top=y_max)
    if clock:
        left.xaxis_date()
        left.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M"))  # type: ignore[no-untyped-call]
    left.set_xlabel(x_label)
    left.grid(alpha=0.3)
    figure.savefig(path)


def file_name(spec: p.PanelSpec) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", spec.title.lower()).strip("-")
    return f"{spec.dashboard_uid}--{slug}.png"


def write_index(out: Path, drawn: list[tuple[p.PanelSpec, str, int]], prometheus: str, since: str) -> Path:
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>kvtune report</title></head><body>",
        f"<h1>kvtune report</h1><p>Prometheus {html.escape(prometheus)}, the last {html.escape(since)}, "
        f"generated {html.escape(time.strftime('%Y-%m-%d %H:%M:%S %Z'))}.</p>",
    ]
    dashboard = None
    for spec, name, count in drawn:
        if spec.dashboard_uid != dashboard:
            dashboard = spec.dashboard_uid
            parts.append(f"<h2>{html.escape(TITLES[dashboard])}</h2>")
        parts.append(
            f"<h3>{html.escape(spec.title)}</h3><p>{html.escape(spec.description)} ({count} series)</p>"
            f"<a href='{name}'><img src='{name}' alt='{html.escape(spec.title)}' width='900'></a>"
        )
    parts.append("</body></html>")
    index = out / "index.html"
    index.write_text("\n".join(parts) + "\n")
    return index


def report(prometheus: str, since: str, out: Path, end: float | None = None) -> Path:
    """Draws every panel over the last `since` and writes index.html; returns its path."""
    span = parse_duration(since)
    end = time.time() if end is None else end
    start = end - span
    step = max(1.0, math.ceil(span / MAX_POINTS))
    out.mkdir(parents=True, exist_ok=True)
    prom = Prometheus(prometheus)
    drawn = []
    for spec in p.all_panels():
        series = fetch_panel(prom, spec, start, end, step)
        name = file_name(spec)
        draw_panel(spec, series, (start, end), out / name)
        drawn.append((spec, name, len(series)))
    return write_index(out, drawn, prometheus, since)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prometheus", required=True, metavar="URL", help="a Prometheus server's base URL")
    parser.add_argument("--since", default="1h", help="how far back to draw: 30m, 1h, 2d (default 1h)")
    parser.add_argument("--out", type=Path, required=True, help="folder for the PNGs and index.html")


def run(args: argparse.Namespace) -> int:
    index = report(args.prometheus, args.since, args.out)
    print(f"wrote {index} and {len(p.all_panels())} panels")
    return 0
