"""The tuner benchmark's bookkeeping: how two sweep windows combine, and how convergence is counted."""

from __future__ import annotations

from kvtune.bench.tuner import Measured, combine, intervals_to_converge


def test_a_value_is_clean_only_if_both_windows_were() -> None:
    rising = Measured(9, goodput=1200, delivered=1100, preemptions=0, per_cpu_s=1180)
    falling = Measured(9, goodput=1000, delivered=1000, preemptions=2, per_cpu_s=980)
    both = combine(rising, falling)
    assert (both.goodput, both.delivered, both.per_cpu_s) == (1100, 1050, 1080)
    assert both.preemptions == 2


def test_intervals_count_windows_up_to_the_last_change() -> None:
    assert intervals_to_converge([], began=100.0, window=3.0) == 0
    assert intervals_to_converge([101.0], began=100.0, window=3.0) == 1
    assert intervals_to_converge([101.0, 104.5], began=100.0, window=3.0) == 2
    assert intervals_to_converge([101.0, 118.0, 129.0], began=100.0, window=3.0) == 10
