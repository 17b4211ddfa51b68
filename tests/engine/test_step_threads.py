"""Each forward pass on the engine's compute cores or on every core, whichever its batch size timed faster."""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import threading
from pathlib import Path

import pytest
import torch
from engine_loop_driver import BLOCK_SIZE, generate, greedy, make_engine, random_prompt
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtune.engine import command as serve
from kvtune.engine.loop.compute_threads import allowed_cores
from kvtune.engine.model.step_threads import (
    RETRY_EVERY,
    RETRY_MOST,
    SHORT_TRIALS,
    TRIAL_SECONDS,
    TRIALS,
    StepThreads,
    Width,
    WidthChooser,
    size_class,
)


def run(chooser: WidthChooser, tokens: int, seconds_per_token: dict[int, float], steps: int) -> list[int]:
    """`steps` steps of `tokens` tokens, each timed at its width's per-token cost; the widths chosen."""
    chosen = []
    for _ in range(steps):
        threads = chooser.threads_for(tokens)
        chooser.record(tokens, threads, seconds_per_token[threads] * tokens)
        chosen.append(threads)
    return chosen


def test_both_widths_are_timed_first_then_the_faster_runs() -> None:
    chooser = WidthChooser(1, 2)
    chosen = run(chooser, 64, {1: 2e-4, 2: 1e-4}, 2 * TRIALS + 10)  # 6-13 ms steps: TRIALS each
    assert sorted(chosen[: 2 * TRIALS]) == [1] * TRIALS + [2] * TRIALS
    assert chosen[2 * TRIALS :] == [2] * 10
    assert chooser.verdicts() == {64: 2}


def test_long_steps_are_compared_after_two_each() -> None:
    chooser = WidthChooser(1, 2)
    tokens = 2000  # a prefill chunk: 2.4 s on one core, 1.4 s on two
    chosen = run(chooser, tokens, {1: 2.4 / tokens, 2: 1.4 / tokens}, 8)
    assert chosen == [1, 2, 1, 2, 2, 2, 2, 2]
    assert chooser.verdicts() == {1024: 2}


def test_one_slowed_long_step_does_not_decide() -> None:
    chooser = WidthChooser(1, 2)
    tokens = 2000
    # the wide width's first chunk is slowed fivefold (a new shape's setup, a neighbour); its second is not
    for threads, seconds in ((1, 2.4), (2, 7.0), (1, 2.4), (2, 1.4)):
        assert chooser.threads_for(tokens) == threads
        chooser.record(tokens, threads, seconds)
    assert chooser.verdicts() == {1024: 2}


def test_short_steps_need_every_trial_even_when_one_width_has_had_its_seconds() -> None:
    chooser = WidthChooser(1, 2)
    # narrow steps long enough to count as its trial (the machine stalled), then ordinary short steps
    for _ in range(SHORT_TRIALS):
        chooser.record(100, 1, TRIAL_SECONDS)
    chosen = [chooser.threads_for(100) for _ in range(TRIALS)]
    for threads in chosen:
        chooser.record(100, threads, 1e-3)
    assert chosen == [2] * TRIALS  # the wide width's trials, not more narrow ones
    assert chooser.verdicts() == {64: 2}


def test_the_slower_width_is_retried_so_a_change_in_load_is_seen() -> None:
    chooser = WidthChooser(1, 2)
    # a neighbour holds the second core: the wide width's steps take three times as long
    run(chooser, 1024, {1: 2e-4, 2: 6e-4}, 2 * TRIALS + RETRY_EVERY)
    assert chooser.verdicts() == {1024: 1}
    # the neighbour leaves; only the retries run wide, and they see it
    later = run(chooser, 1024, {1: 2e-4, 2: 1e-4}, 8 * RETRY_EVERY)
    assert later[-RETRY_EVERY:].count(1) <= 1  # wide from then on, the narrow width only retried
    assert chooser.verdicts() == {1024: 2}


def test_retries_back_off_while_they_confirm_and_return_when_one_contradicts() -> None:
    chooser = WidthChooser(1, 2)
    steady = run(chooser, 64, {1: 2e-4, 2: 1e-4}, 2 * TRIALS + 40 * RETRY_EVERY)[2 * TRIALS :]
    retries = [i for i, threads in enumerate(steady) if threads == 1]
    gaps = [b - a for a, b in zip([-1, *retries], retries, strict=False)]
    assert gaps[:4] == [RETRY_EVERY, 2 * RETRY_EVERY, 4 * RETRY_EVERY, RETRY_MOST]
    assert set(gaps[4:]) == {RETRY_MOST}
    # the load moves: the next retry runs faster than the favoured width, and retries come every
    # RETRY_EVERY steps again, so the verdict follows as quickly as before the back-off
    moved = run(chooser, 64, {1: 0.5e-4, 2: 1e-4}, RETRY_MOST + 3 * RETRY_EVERY)
    first = moved.index(1)
    assert moved[first + 1 : first + RETRY_EVERY + 1].count(1) == 1


def test_each_batch_size_class_has_its_own_verdict() -> None:
    chooser = WidthChooser(1, 2)
    run(chooser, 2000, {1: 2e-4, 2: 1e-4}, 40)  # a prefill chunk splits well
    run(chooser, 24, {1: 1e-4, 2: 3e-4}, 40)  # a small decode step does not
    assert chooser.verdicts() == {16: 1, 1024: 2}
    assert chooser.threads_for(1500) == 2 and chooser.threads_for(20) == 1


def test_steps_of_a_width_it_does_not_choose_between_and_untimed_steps_are_ignored() -> None:
    chooser = WidthChooser(1, 2)
    chooser.record(64, 3, 0.01)
    chooser.record(64, 1, 0.0)
    assert chooser.verdicts() == {}
    with pytest.raises(ValueError, match="narrow < wide"):
        WidthChooser(2, 2)


@pytest.mark.parametrize(("tokens", "cls"), [(0, 1), (1, 1), (2, 2), (3, 2), (4, 3), (2048, 12)])
def test_size_classes_are_powers_of_two(tokens: int, cls: int) -> None:
    assert size_class(tokens) == cls


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.integers(1, 8192),
    ratio=st.floats(1.3, 4.0),
    wide_faster=st.booleans(),
    noise=st.lists(st.floats(0.9, 1.1), min_size=200, max_size=200),
)
def test_a_consistently_slower_width_runs_only_in_its_trials_and_retries(
    tokens: int, ratio: float, wide_faster: bool, noise: list[float]
) -> None:
    chooser = WidthChooser(1, 2)
    fast, slow = (2, 1) if wide_faster else (1, 2)
    slow_steps = 0
    for factor in noise:
        threads = chooser.threads_for(tokens)
        cost = 1e-4 * (ratio if threads == slow else 1.0) * factor
        chooser.record(tokens, threads, cost * tokens)
        slow_steps += threads == slow
    assert slow_steps <= TRIALS + len(noise) // RETRY_EVERY
    assert chooser.verdicts() == {1 << (size_class(tokens) - 1): fast}


needs_two_cores = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or (os.cpu_count() or 1) < 2, reason="needs Linux and 2 cores"
)


def widest_cores() -> list[int]:
    """Every core the calling thread may be given, after widening its mask to them: threads inherit their
    starter's mask, and the suite's main thread may be left pinned by an earlier in-process engine."""
    with contextlib.suppress(OSError):
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    return sorted(os.sched_getaffinity(0))


def test_a_class_width_is_logged_when_decided_and_when_the_load_moves_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    step = StepThreads(Width(1), Width(2))
    before = torch.get_num_threads()

    def steps(count: int, seconds_per_token: dict[int, float]) -> None:
        for _ in range(count):
            threads = step.begin(100)
            step.end(100, threads, seconds_per_token[threads] * 100)

    try:
        with caplog.at_level("DEBUG", logger="kvtune.engine.model.step_threads"):
            steps(2 * TRIALS + RETRY_EVERY, {1: 2e-4, 2: 1e-4})
            steps(8 * RETRY_EVERY, {1: 1e-4, 2: 3e-4})  # a neighbour takes the second core
    finally:
        torch.set_num_threads(before)
    logged = [(record.levelname, record.getMessage()) for record in caplog.records]
    assert logged[0] == (
        "INFO",
        "Steps of 64-127 tokens compute on 2 thread(s) (medians: 1 thread(s) 200.0 us/token, "
        "2 thread(s) 100.0 us/token)",
    )
    assert len(logged) == 2  # once decided, then once moved: not at every step or retry
    assert logged[1][0] == "DEBUG" and "compute on 1 thread(s)" in logged[1][1]


@needs_two_cores
def test_a_step_sets_torch_threads_and_the_engine_threads_cores() -> None:
    seen: list[tuple[int, int, set[int]]] = []
    widths: list[Width] = []

    def engine_thread() -> None:
        cores = widest_cores()
        narrow, wide = Width(1, frozenset(cores[-1:])), Width(len(cores), frozenset(cores))
        widths.extend([narrow, wide])
        step = StepThreads(narrow, wide)
        for _ in range(2 * TRIALS):
            threads = step.begin(512)
            seen.append((threads, torch.get_num_threads(), os.sched_getaffinity(0)))
            step.end(512, threads, 0.01)

    before = (torch.get_num_threads(), os.sched_getaffinity(0))
    thread = threading.Thread(target=engine_thread)
    thread.start()
    thread.join()
    narrow, wide = widths
    assert {(t, n, frozenset(c)) for t, n, c in seen} == {
        (1, 1, narrow.cores),
        (wide.threads, wide.threads, wide.cores),
    }
    assert os.sched_getaffinity(0) == before[1]  # only the stepping thread moved
    torch.set_num_threads(before[0])


def test_serve_adapts_the_width_by_default_and_keeps_the_threads_it_is_given(tiny_dir: Path) -> None:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    before = torch.get_num_threads()
    try:
        default = serve.build_server(parser.parse_args(["--model", str(tiny_dir)]))
        given_threads = serve.build_server(parser.parse_args(["--model", str(tiny_dir), "--threads", "1"]))
    finally:
        torch.set_num_threads(before)
    adapts = default.async_engine.engine.runner.step_threads is not None
    assert adapts == (len(allowed_cores()) >= 2)
    assert given_threads.async_engine.engine.runner.step_threads is None


class _EveryOtherStepWide(WidthChooser):
    """Switches width at every step, so that a generation mixes both widths in every phase."""

    def __init__(self, narrow: int, wide: int) -> None:
        super().__init__(narrow, wide)
        self.steps = 0

    def threads_for(self, tokens: int) -> int:
        self.steps += 1
        return self.wide if self.steps % 2 else self.narrow


@needs_two_cores
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_tokens_do_not_depend_on_the_width_under_preemption(tiny_dir: Path, dtype: str) -> None:
    """The linears and the kernels split rows, sequences and heads across threads, never one sum, so the
    tokens are those of one thread exactly; the pool is small enough that requests preempt and recompute."""
    rng = random.Random(4)
    workload = {f"r{i}": random_prompt(rng, rng.randrange(40, 140)) for i in range(8)}

    def tokens(switching: bool) -> dict[str, list[int]]:
        cores = widest_cores()
        engine = make_engine(tiny_dir, dtype=dtype, kv_cache_tokens=40 * BLOCK_SIZE)
        if switching:
            engine.runner.adapt_threads(Width(1, frozenset(cores[-1:])), Width(len(cores), frozenset(cores)))
            assert engine.runner.step_threads is not None
            engine.runner.step_threads.chooser = _EveryOtherStepWide(1, len(cores))
        done = generate(engine, workload, lambda _: greedy(48, ignore_eos=True))
        assert engine.counters.num_preemptions > 0
        return {rid: done.tokens(rid) for rid in workload}

    result: dict[str, dict[str, list[int]]] = {}
    worker = threading.Thread(target=lambda: result.update(one=tokens(False), switching=tokens(True)))
    worker.start()
    worker.join()
    assert result["switching"] == result["one"]
