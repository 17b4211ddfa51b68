"""The tuner benchmark's bookkeeping: how two sweep windows combine, how convergence is counted, and a method
text written from what was run."""

from __future__ import annotations

import argparse

from kvtune.bench.load import LoadShape
from kvtune.bench.tuner import Measured, add_arguments, combine, intervals_to_converge, method_text


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


def test_the_method_text_is_written_from_the_run_arguments() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--start", "32", "--kv-cache-tokens", "8192", "--clients", "4"])
    text = method_text(args, LoadShape(4, (200, 400), (100, 200)))
    assert "{" not in text and "max_num_seqs 32, then" in text and "KV pool 8,192 tokens" in text
    assert "holds about 18 such requests" in text and "4 clients do not over-subscribe it" in text
    default = parser.parse_args([])
    text = method_text(default, LoadShape(16, (200, 400), (100, 200)))
    assert "holds about 9 such requests" in text and "16 clients over-subscribe it" in text
