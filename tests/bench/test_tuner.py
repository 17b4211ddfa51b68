"""The tuner benchmark's bookkeeping: how two sweep windows combine, how convergence is counted, a method
text written from what was run, and a workload given by flags named for what it is."""

from __future__ import annotations

import argparse

from kvtune.bench.sweep import Window, combined, measure_sweep, time_weighted
from kvtune.bench.tuner import (
    TunerRun,
    add_arguments,
    chosen_workload,
    command_text,
    intervals_to_converge,
    method_text,
    reference,
    section,
    section_name,
)
from kvtune.bench.workloads import NAMED, TUNER_FIRST


def _parsed(*words: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(words))


def _window(value: int, goodput: float, preemptions: float, per_cpu_s: float, seconds: float = 6.0) -> Window:
    return Window(value, seconds, goodput, per_cpu_s, preemptions, delivered=goodput)


def test_a_value_is_clean_only_if_both_windows_were() -> None:
    rising = Window(9, 6.0, goodput=1200, per_cpu_s=1180, preemptions=0, delivered=1100)
    falling = Window(9, 6.0, goodput=1000, per_cpu_s=980, preemptions=2, delivered=1000)
    both = combined([rising, falling])
    assert (both.goodput, both.delivered, both.per_cpu_s) == (1100, 1050, 1080)
    assert (both.preemptions, both.seconds) == (2, 12.0)


def test_a_long_window_outweighs_short_rounds_by_its_span() -> None:
    confirm = _window(12, 2949, 0, per_cpu_s=2907, seconds=300)
    rounds = [_window(12, g, 0, per_cpu_s=g) for g in (2053, 3081)]
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
    args = _parsed("--start", "32", "--kv-cache-tokens", "8192", "--clients", "4")
    text = method_text(args, chosen_workload(args))
    assert "{" not in text and "max_num_seqs 32, then" in text and "KV pool 8,192 tokens" in text
    assert "holds about 18 such requests" in text and "4 clients do not over-subscribe it" in text
    assert "prompts 200:400, outputs 100:200 tokens" in text
    default = _parsed()
    text = method_text(default, chosen_workload(default))
    assert "holds about 9 such requests" in text and "16 clients over-subscribe it" in text
    assert "max_num_seqs 64, then" in text and "to 1 if need be" in text


def test_a_named_workload_fills_the_flags_left_unset_and_records_its_own_section() -> None:
    wide = chosen_workload(_parsed("--workload", "wide-prompts", "--start", "40", "--sweep", "9,11,13"))
    assert (wide.kv_cache_tokens, wide.load.prompt_len, wide.load.output_len, wide.load.clients) == (
        6144,
        (150, 450),
        (80, 240),
        24,
    )
    assert (wide.start, wide.sweep) == (40, (9, 11, 13))  # given explicitly: the flags win over the preset
    assert wide.name == "wide-prompts"  # the same pool and load: the same workload, measured from elsewhere
    assert section_name("default") == "tuner" and section_name("wide-prompts") == "tuner-wide-prompts"
    assert chosen_workload(_parsed()) == NAMED["default"]


def test_a_workload_given_by_flags_is_named_for_what_it_is() -> None:
    """The review's new-user run: `kvtune bench tuner` with its own pool and load was labelled "workload
    default", which it was not."""
    words = ("--kv-cache-tokens", "6144", "--clients", "24", "--prompt-len", "100:2400", "--output-len",
             "20:1200", "--start", "128", "--sweep", "2,3,4,5,6,7,8,9,10")  # fmt: skip
    args = _parsed(*words)
    workload = chosen_workload(args)
    assert workload.name == "pool-6144-clients-24-prompts-100-2400-outputs-20-1200"
    assert "default" not in workload.name and "default" not in workload.why
    assert workload.why.startswith(
        "given by flags: pool 6,144, 24 clients, prompts 100:2400, outputs 20:1200"
    )
    assert (workload.start, workload.sweep) == (128, tuple(range(2, 11)))
    assert section_name(workload.name) == f"tuner-{workload.name}"  # never the default's section
    assert command_text(args) == "kvtune bench tuner " + " ".join(
        f"{flag} {value}" for flag, value in zip(words[::2], words[1::2], strict=True)
    )
    assert command_text(_parsed("--workload", "long-outputs")) == "kvtune bench tuner --workload long-outputs"
    assert command_text(_parsed()) == "kvtune bench tuner --workload default"  # as BENCHMARKS.md records it
    # one flag that changes the load is enough to make it another workload
    assert (
        chosen_workload(_parsed("--clients", "30")).name
        == "pool-4096-clients-30-prompts-200-400-outputs-100-200"
    )


def test_the_three_workloads_have_different_pool_to_footprint_ratios() -> None:
    ratios = sorted(round(NAMED[name].ratio, 1) for name in TUNER_FIRST)
    assert ratios == [4.6, 9.1, 13.4]
    for name in TUNER_FIRST:  # every sweep reaches below and above the pool's mean-footprint count
        w = NAMED[name]
        assert min(w.sweep) < w.kv_cache_tokens / 460 < max(w.sweep) < w.start


class Engine:
    """A made-up engine under the review's load: every value from `edge` up preempts over a long window (300 s)
    and none in 6 s; below `edge` none preempts. Goodput grows with the value."""

    def __init__(self, edge: int) -> None:
        self.edge = edge

    def __call__(self, value: int, seconds: float, label: str) -> Window:
        preempted = 3.0 if value >= self.edge and seconds > 6.0 else 0.0
        return Window(value, seconds, 100.0 * value, 100.0 * value, preempted, delivered=100.0 * value)


def _review_run(edge: int) -> str:
    """The review's new-user run, test-sized: its flags, a tuner that converged on 1, and the section written."""
    args = _parsed("--kv-cache-tokens", "6144", "--clients", "24", "--prompt-len", "100:2400", "--output-len",
                   "20:1200", "--start", "128", "--sweep", "2,3,4,5,6,7,8,9,10")  # fmt: skip
    workload = chosen_workload(args)
    measure = Engine(edge)
    sweep = measure_sweep(workload.sweep, measure, args.measure)
    start_row = measure(workload.start, args.measure, "start")
    best, pairs = reference(sweep, measure, 1, args)
    sweep.confirmed.setdefault(1, measure(1, args.confirm, "confirm"))
    steady = measure(1, 2 * args.measure, "steady")
    run = TunerRun(sweep, start_row, [], 0.0, steady, 1, 1, best, pairs, 100, 0, (1.0, 1.0, 1.0),
                   (1.0, 1.0, 1.0), 1.0)  # fmt: skip
    return section(run, workload, args)


def test_the_review_run_whose_whole_sweep_preempted_finds_the_clean_value_below_it() -> None:
    """`kvtune bench tuner` with its own flags printed "sweep-best none", "nan%" and "NOT met", labelled
    "workload default": every swept value preempted in its 300 s confirming window, and the tuner's pick, 1,
    stayed clean below the sweep, where the rule never measured."""
    text = _review_run(edge=2)
    assert "nan" not in text and "sweep-best none" not in text and "NOT met" not in text
    assert "workload default" not in text and "Workload default" not in text
    assert (
        "## Tuner, workload pool-6144-clients-24-prompts-100-2400-outputs-20-1200 (`kvtune bench tuner"
        in text
    )
    assert "| 1 (below the sweep) | 100 | 100 | 100 | 0 |" in text
    assert (
        "| sweep-best (zero preemptions) | 1; none of the sweep stayed clean: it went on below it (1); 10 dropped"
        in text
    )
    assert "converged 1, sweep-best 1; goodput ÷ sweep-best 100% (the sweep-best value itself" in text
    assert text.rstrip().endswith("(goal 0): met |")


def test_a_run_where_even_1_preempts_says_so_and_prints_no_ratio_of_nothing() -> None:
    text = _review_run(edge=1)
    assert "nan" not in text
    assert (
        "| sweep-best (zero preemptions) | none: every value of the sweep and below it, down to 1, preempted"
        in text
    )
    assert "| goodput ÷ sweep-best | not measured: there is no clean value to compare with |" in text
    assert "sweep-best none" not in text and "no clean sweep-best; goodput ÷ sweep-best not measured" in text
    assert text.rstrip().endswith("NOT met |")
