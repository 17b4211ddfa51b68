"""The demo's view when stdout is not a terminal: plain progress lines, in time order, one per action."""

from __future__ import annotations

import io

from kvtune.demo.timeline import Action, Point
from kvtune.demo.view import LiveView, usage_bar


def test_plain_lines_come_in_time_order_when_a_point_waited_out_a_restart() -> None:
    out = io.StringIO()
    view = LiveView(out)
    assert view.live is None  # not a terminal: no rich panel
    point = Point(70.0, "3 prefix defeat", 0.32, 0.0, 332.0, 0.92, 6, 360, 6.0, 18.0)
    restart = Action(78.1, "recommend_fp8_kv", "user", "kv_cache_dtype", "auto", "fp8", "restarted with fp8")
    view.update(point, [restart])
    view.update(point, [restart])  # nothing new: no line repeated
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith(
        "[ 70.0 s] 3 prefix defeat: KV 32%, preemptions 0.00/s, 332 tokens/s, hit rate 92%"
    )
    assert lines[1] == "[ 78.1 s] recommend_fp8_kv user: kv_cache_dtype: auto -> fp8; restarted with fp8"


def test_usage_bar_is_bounded_and_says_its_figure() -> None:
    assert usage_bar(None) == "n/a"
    assert usage_bar(0.5).endswith(" 50%") and usage_bar(0.5).count("█") == 15
    assert usage_bar(1.7).count("█") == 30  # a reading past 100% never draws past the bar
