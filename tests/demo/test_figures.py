"""The demo's measured windows and its failures: counted over what the window holds and named for it, so a
figure never claims a minute it did not span (a fast CPU once showed "1.2 preemptions in the last minute"
for 12 s of 5 a second)."""

from __future__ import annotations

from kvtune.demo.report_summary import figures_line, preemptions_in
from kvtune.demo.run import failures_by_phase, figures
from kvtune.demo.timeline import Point
from kvtune.harness.load import Failure, failure_cause


def _point(t: float, phase: str, preemptions: float | None, throughput: float = 100.0) -> Point:
    return Point(t, phase, 0.9, None, throughput, None, 8, None, 8.0, 2.0, 10.0, 5.0, preemptions)


POINTS = [
    _point(float(t), "0 in trouble" if t < 10 else "settled", 5.0 if t < 10 else 0.0) for t in range(20)
]


def test_a_window_counts_its_own_preemptions_and_says_how_long_it_is() -> None:
    latencies = [(1000.0 + t, 2.0 + t / 10) for t in range(20)]
    before = figures("in trouble", POINTS, latencies, 1000.0, 2.0, 8.0)
    # points 3..8 each carry the 5 preemptions of the interval that ends at them
    assert (before.preemptions, before.window_s, before.preemptions_per_minute) == (30.0, 6.0, 300.0)
    assert before.window == "in trouble" and before.hit_rate == 0.5 and before.throughput == 100.0
    assert before.p95_latency_s == round(2.0 + 7.75 / 10, 2)  # finished in (2, 8]: 2.3 .. 2.8
    after = figures("settled", POINTS, latencies, 1000.0, 12.0, 19.0)
    assert (after.preemptions, after.window_s, after.preemptions_per_minute) == (0.0, 7.0, 0.0)
    assert preemptions_in(before) == "30 in 6.0 s (300.0/min)"
    assert "in trouble (t 2-8 s): preemptions 30 in 6.0 s (300.0/min)" in figures_line(before)


def test_a_window_across_an_unreadable_interval_is_not_counted_as_zero() -> None:
    points = [*POINTS[:5], _point(5.0, "0 in trouble", None), *POINTS[6:]]
    assert figures("in trouble", points, [], 1000.0, 2.0, 8.0).preemptions is None
    assert figures("nothing", points, [], 1000.0, 30.0, 40.0).preemptions is None  # no point in it


def test_failures_fall_in_their_phase_by_cause() -> None:
    failures = [
        Failure(1003.5, "HTTP 503: the engine is draining"),
        Failure(1012.0, "ConnectError: [Errno 111] Connection refused"),
        Failure(1012.5, "ConnectError: [Errno 111] Connection refused"),
        Failure(1013.0, "RemoteProtocolError: peer closed connection"),
        Failure(999.0, "ReadTimeout: "),
    ]
    phases = [(0.0, "0 in trouble"), (9.5, "1 cap max_tokens"), (11.0, "settled")]
    assert failures_by_phase(failures, phases, 1000.0) == {
        "0 in trouble": {"timed out": 1, "HTTP 503": 1},
        "settled": {"connection refused (engine down or restarting)": 2, "connection closed mid-answer": 1},
    }
    assert failure_cause("120 of 250 tokens generated") == "answer shorter than asked"
