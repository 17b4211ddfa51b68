"""The demo's report from a hand-built timeline shaped like a real run (all four rungs, the user's two moves):
the files, summary.json against the measured figures, the HTML's pictures and table, and missing figures
shown as n/a."""

from __future__ import annotations

import json
from dataclasses import asdict
from html.parser import HTMLParser
from pathlib import Path

import pytest
from matplotlib.image import imread

from kvtune.demo.report import MEMORY_MAP, SUMMARY, TIMELINE, write_report
from kvtune.demo.report_charts import CHARTS, action_markers, phase_bands, trailing_hit_rate
from kvtune.demo.report_summary import action_label, action_labels, outcome_rows
from kvtune.demo.timeline import RUNGS, Action, Figures, Point, Timeline

FLAG_EVIDENCE = (
    "varying_head: tokens 0-11 vary (a timestamp), then 320 shared tokens; 412 requests, 131,840 tokens lost: "
    "move the varying part after the shared prefix"
)
# (phase start, phase, kv usage, preemptions/s, tokens/s, hit rate, max_num_seqs, cap, running, waiting)
PHASES = [
    (0, "1 cap max_tokens", 0.98, 3.0, 180.0, 0.05, 64, None, 21, 11),
    (20, "2 lower max_num_seqs", 0.97, 2.0, 175.0, 0.05, 64, 320, 26, 6),
    (30, "2 lower max_num_seqs", 0.95, 1.0, 190.0, 0.05, 24, 320, 24, 8),
    (40, "2 lower max_num_seqs", 0.9, 0.4, 205.0, 0.05, 12, 320, 12, 20),
    (50, "2 lower max_num_seqs", 0.85, 0.0, 215.0, 0.05, 9, 320, 9, 23),
    (60, "3 prefix defeat", 0.8, 0.0, 230.0, 0.88, 9, 320, 9, 23),
    (90, "4 FP8 KV", 0.5, 0.0, 262.0, 0.89, 9, 320, 9, 23),
    (120, "settled", 0.5, 0.0, 265.0, 0.9, 9, 320, 9, 23),
]
ACTIONS = [
    Action(
        20.0,
        "cap_max_tokens",
        "applied",
        "max_tokens_cap",
        2048,
        320,
        "answers p99 251 tokens of 2,048 declared",
    ),
    Action(30.0, "lower_max_num_seqs", "applied", "max_num_seqs", 64, 24, "12 preemptions/min at 26 running"),
    Action(40.0, "lower_max_num_seqs", "applied", "max_num_seqs", 24, 12, "5 preemptions/min at 24 running"),
    Action(50.0, "lower_max_num_seqs", "applied", "max_num_seqs", 12, 9, "1 preemption/min at 12 running"),
    Action(60.0, "flag_prefix_defeat", "flagged", None, None, None, FLAG_EVIDENCE),
    Action(
        62.0,
        "flag_prefix_defeat",
        "user",
        "timestamp",
        "head",
        "after the shared prompt",
        "the demo moved it",
    ),
    Action(
        90.0, "recommend_fp8_kv", "recommended", "kv_cache_dtype", "auto", "fp8", "pool 4,096 tokens, 9 fit"
    ),
    Action(
        95.0, "recommend_fp8_kv", "user", "kv_cache_dtype", "auto", "fp8", "restarted with fp8: pool 8,192"
    ),
]
BEFORE = Figures(
    "in trouble", 0.0, 40.0, 40.0, 152.0, 228.0, throughput=180.4, p95_latency_s=38.2, hit_rate=0.048
)
AFTER = Figures("settled", 120.0, 149.0, 29.0, 0.0, 0.0, throughput=264.9, p95_latency_s=12.6, hit_rate=0.893)
FAILURES = {
    "1 cap max_tokens": {"HTTP 503": 2},
    "4 FP8 KV": {"connection refused (engine down or restarting)": 310},
}
META = {
    "kv_pool_tokens_auto": 4096,
    "kv_pool_tokens_fp8": 8192,
    "block_size": 16,
    "clients": 32,
    "max_tokens_declared": 2048,
    "max_tokens_answered": 256,
    "shared_prompt_tokens": 320,
    "quick": False,
    "started_at": 1_800_000_000.0,
    "duration_s": 150.0,
}


def sample_timeline() -> Timeline:
    """One point a second for 150 s, each phase's figures with a little wobble, as a real run would show."""
    points = []
    for t in range(150):
        row = [row for row in PHASES if row[0] <= t][-1]
        _, phase, kv, pre, tps, hit, seqs, cap, running, waiting = row
        wobble = ((t * 7) % 5 - 2) / 100
        points.append(
            Point(
                float(t),
                phase,
                min(1.0, kv + wobble),
                pre,
                tps * (1 + wobble),
                hit,
                seqs,
                cap,
                running,
                waiting,
                prefix_queries=100.0,
                prefix_hits=100.0 * hit,
            )
        )
    return Timeline(points, list(ACTIONS), BEFORE, AFTER, dict(META), dict(FAILURES))


class Images(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.sources: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "img":
            self.sources += [value or "" for name, value in attrs if name == "src"]


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_report(sample_timeline(), tmp_path_factory.mktemp("demo-report"))


def test_the_report_writes_every_file(report: Path) -> None:
    folder = report.parent
    assert report.name == "index.html"
    for name in [SUMMARY, TIMELINE, MEMORY_MAP, *(chart.file for chart in CHARTS)]:
        assert (folder / name).stat().st_size > 0, name


def test_summary_holds_the_measured_figures_and_the_ladder_in_order(report: Path) -> None:
    summary = json.loads((report.parent / SUMMARY).read_text())
    assert Figures(**summary["before"]) == BEFORE
    assert Figures(**summary["after"]) == AFTER
    assert [a["rung"] for a in summary["actions"]] == [a.rung for a in ACTIONS]
    assert all(set(a) == {"rung", "time", "from", "to", "evidence", "kind"} for a in summary["actions"])
    first_of_each = [next(a["rung"] for a in summary["actions"] if a["rung"] == rung) for rung in RUNGS]
    assert first_of_each == list(RUNGS)
    cap = summary["actions"][0]
    assert (cap["time"], cap["from"], cap["to"], cap["kind"]) == (20.0, 2048, 320, "applied")
    assert Timeline.from_json(json.loads((report.parent / TIMELINE).read_text())) == sample_timeline()


def test_the_html_shows_every_picture_and_the_before_after_table(report: Path) -> None:
    text = report.read_text()
    images = Images()
    images.feed(text)
    assert sorted(images.sources) == sorted([MEMORY_MAP, *(chart.file for chart in CHARTS)])
    assert all("/" not in source for source in images.sources)  # relative: the folder moves as a whole
    cells = ("180.4 tokens/s", "264.9 tokens/s", "152 in 40.0 s (228.0/min)", "0 in 29.0 s (0.0/min)", "38.20 s",
             "12.60 s", "4.8%", "89.3%", "met", "in trouble", "settled", "310")  # fmt: skip
    for cell in cells:
        assert f"<td>{cell}</td>" in text or f">{cell}</td>" in text, cell
    assert "not met" not in text
    assert "varying_head: tokens 0-11" in text
    assert "connection refused (engine down or restarting)" in text  # failures by phase and cause
    assert "paged, defaults: tokens per step" in text  # the seed figures' table


def test_every_png_is_a_picture_of_sane_size(report: Path) -> None:
    for name in [MEMORY_MAP, *(chart.file for chart in CHARTS)]:
        pixels = imread(report.parent / name)
        height, width = pixels.shape[:2]
        assert 300 <= height <= 1000 and 800 <= width <= 1800, (name, pixels.shape)
        assert pixels.std() > 0.01, f"{name} is blank"


def test_each_action_has_a_label_a_person_reads() -> None:
    labels = [action_label(action, META) for action in ACTIONS]
    assert labels == [
        "cap max_tokens 2048→320",
        "max_num_seqs 64→24",
        "max_num_seqs 24→12",
        "max_num_seqs 12→9",
        "flag: varying_head tokens 0-11",
        "timestamp moved",
        "recommend FP8 KV",
        "FP8 KV: pool 2x",
    ]
    markers = action_markers(sample_timeline(), 150.0)
    assert [m.at for m in markers] == [20.0, 30.0, 40.0, 50.0, 60.0, 90.0, 95.0]
    assert markers[4].label == "flag: varying_head tokens 0-11\ntimestamp moved"  # 2 s apart: one marker


def test_phases_become_consecutive_bands() -> None:
    bands = phase_bands(sample_timeline().points, 150.0)
    assert [(b.start, b.end, b.label) for b in bands] == [
        (0.0, 20.0, "1 cap max_tokens"),
        (20.0, 60.0, "2 lower max_num_seqs"),
        (60.0, 90.0, "3 prefix defeat"),
        (90.0, 120.0, "4 FP8 KV"),
        (120.0, 150.0, "settled"),
    ]


def test_missing_figures_read_n_a_and_nothing_crashes(tmp_path: Path) -> None:
    points = [
        Point(float(t), "1 cap max_tokens", None, None, None, None, None, None, None, None) for t in range(5)
    ]
    unmeasured = Figures("settled", 0.0, 4.0, 4.0, None, None, None, None, None)
    timeline = Timeline(points, [], None, unmeasured, {"clients": None})
    index = write_report(timeline, tmp_path, with_simulation=False)
    text = index.read_text()
    assert text.count("<td>n/a</td>") >= 8  # both columns of the four figures
    assert "No action was taken." in text and "Failed requests</h2><p>None" in text
    summary = json.loads((tmp_path / SUMMARY).read_text())
    assert summary == {"failures": {}, "before": None, "after": asdict(unmeasured), "actions": []}
    for chart in CHARTS:
        assert imread(tmp_path / chart.file).shape[1] >= 800
    empty = write_report(Timeline([], [], None, None, {}), tmp_path / "empty", with_simulation=False)
    assert "n/a" in empty.read_text()
    assert [row.verdict for row in outcome_rows(None, None)] == ["", "n/a", "n/a", "", "n/a"]


def test_a_goal_missed_is_said_plainly() -> None:
    worse = Figures(
        "settled", 120.0, 180.0, 60.0, 3.0, 3.0, throughput=150.0, p95_latency_s=40.0, hit_rate=0.5
    )
    assert [row.verdict for row in outcome_rows(BEFORE, worse)] == ["", "not met", "not met", "", "not met"]


def test_a_repeated_action_says_so() -> None:
    """The cap the operator puts back on the restarted engine is not a second decision, and a second flag
    (prompts queued before the layout moved) is a flag again."""
    again = [
        *ACTIONS,
        Action(
            96.0, "cap_max_tokens", "applied", "max_tokens_cap", None, 320, "put back on the restarted engine"
        ),
        Action(97.0, "flag_prefix_defeat", "flagged", None, None, None, FLAG_EVIDENCE),
    ]
    assert action_labels(again, META)[-2:] == [
        "max_tokens_cap 320 re-applied",
        "flag again: varying_head tokens 0-11",
    ]
    assert action_labels(ACTIONS, META) == [action_label(action, META) for action in ACTIONS]


def test_hit_rate_is_drawn_over_a_trailing_window_of_tokens() -> None:
    def point(t: float, queries: float | None, hits: float | None) -> Point:
        return Point(t, "3 prefix defeat", None, None, None, None, None, None, None, None, queries, hits)

    points = [
        point(0, 100, 0),
        point(1, None, None),
        point(5, 300, 300),
        point(11, 0, 0),
        point(20, None, None),
    ]
    # at 11 s the window (1, 11] holds only the 300 hits of 300; at 20 s nothing was looked up in (10, 20]
    assert trailing_hit_rate(points) == [0.0, 0.0, 0.75, 1.0, None]


def test_summary_json_carries_failures_by_phase_and_cause(report: Path) -> None:
    assert json.loads((report.parent / SUMMARY).read_text())["failures"] == FAILURES
