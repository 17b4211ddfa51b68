"""The tuner benchmark's bookkeeping: how two sweep windows combine, how convergence is counted, and a method
text written from what was run."""

from __future__ import annotations

import argparse

from kvtune.bench.tuner import (
    WORKLOADS,
    Measured,
    add_arguments,
    apply_workload,
    combine,
    intervals_to_converge,
    method_text,
    section_name,
    time_weighted,
)
from kvtune.harness.load import LoadShape


def test_a_value_is_clean_only_if_both_windows_were() -> None:
    rising = Measured(9, goodput=1200, delivered=1100, preemptions=0, per_cpu_s=1180)
    falling = Measured(9, goodput=1000, delivered=1000, preemptions=2, per_cpu_s=980)
    both = combine(rising, falling)
    assert (both.goodput, both.delivered, both.per_cpu_s) == (1100, 1050, 1080)
    assert both.preemptions == 2


def test_a_long_window_outweighs_short_rounds_by_its_span() -> None:
    confirm = Measured(12, goodput=2949, delivered=2949, preemptions=0, per_cpu_s=2907, seconds=300)
    rounds = [
        Measured(12, goodput=g, delivered=g, preemptions=0, per_cpu_s=g, seconds=6) for g in (2053, 3081)
    ]
    goodput, per_cpu, span = time_weighted([confirm, *rounds])
    assert span == 312
    assert goodput == (2949 * 300 + (2053 + 3081) * 6) / 312
    assert per_cpu == (2907 * 300 + (2053 + 3081) * 6) / 312
    assert time_weighted([])[2] == 0


def test_intervals_count_windows_up_to_the_last_change() -> None:
    assert intervals_to_converge([], began=100.0, window=3.0) == 0
    assert intervals_to_converge([101.0], began=100.0, window=3.0) == 1
    assert intervals_to_converge([101.0, 104.5], began=100.0, window=3.0) == 2
    assert intervals_to_converge([101.0, 118.0, 129.0], began=100.0, window=3.0) == 10


def test_the_method_text_is_written_from_the_run_arguments() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = apply_workload(parser.parse_args(["--start", "32", "--kv-cache-tokens", "8192", "--clients", "4"]))
    text = method_text(args, LoadShape(4, (200, 400), (100, 200)))
    assert "{" not in text and "max_num_seqs 32, then" in text and "KV pool 8,192 tokens" in text
    assert "holds about 18 such requests" in text and "4 clients do not over-subscribe it" in text
    default = apply_workload(parser.parse_args([]))
    text = method_text(default, LoadShape(16, (200, 400), (100, 200)))
    assert "holds about 9 such requests" in text and "16 clients over-subscribe it" in text


def test_a_named_workload_fills_the_flags_left_unset_and_records_its_own_section() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    wide = apply_workload(parser.parse_args(["--workload", "wide-prompts", "--clients", "30"]))
    assert (wide.kv_cache_tokens, wide.prompt_len, wide.output_len, wide.start) == (
        6144,
        "150:450",
        "80:240",
        48,
    )
    assert wide.clients == 30  # given explicitly: the flag wins over the preset
    assert section_name("default") == "tuner" and section_name("wide-prompts") == "tuner-wide-prompts"


def test_the_three_workloads_have_different_pool_to_footprint_ratios() -> None:
    def ratio(name: str) -> float:
        w = WORKLOADS[name]
        prompt, output = (sum(int(v) for v in span.split(":")) / 2 for span in (w.prompt_len, w.output_len))
        return w.kv_cache_tokens / (prompt + output)

    ratios = sorted(round(ratio(name), 1) for name in WORKLOADS)
    assert ratios == [4.6, 9.1, 13.4]
    for w in WORKLOADS.values():  # every sweep reaches below and above the pool's mean-footprint count
        values = [int(v) for v in w.sweep.split(",")]
        assert min(values) < w.kv_cache_tokens / 460 < max(values) < w.start
