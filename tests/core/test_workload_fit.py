"""The workload fit reads what a window shows and says what it could not see."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtune.core.bucketed_lengths import Buckets
from kvtune.core.step_time import OperatingPoint
from kvtune.core.workload_fit import (
    FitLimits,
    FittedWorkload,
    Insufficient,
    MetricsWindow,
    _steady,
    _stepped_level,
    fit_workload,
)
from tests.core.workloads import VLLM_BOUNDS, fitted, uniform_lengths, window


def _window(count: int = 300, **kwargs: object) -> MetricsWindow:
    return window(uniform_lengths(1, count, (200, 400)), uniform_lengths(2, count, (100, 200)), **kwargs)  # type: ignore[arg-type]


def test_a_steady_window_fits_its_lengths_pool_and_closed_loop() -> None:
    fit = fit_workload(_window())
    assert isinstance(fit, FittedWorkload)
    assert fit.arrival.closed and fit.arrival.clients == 16
    assert fit.prompt_len.observed_mean == pytest.approx(300, rel=0.05)
    assert fit.output_len.observed_mean == pytest.approx(150, rel=0.05)
    assert fit.settings.pool_tokens == 4096 and fit.settings.block_size == 16
    assert fit.prefix_hit_share == 0.0
    # the counters say 10 running at 20 ms a step: the operating point and the observed figures agree
    assert fit.operating_point.batch == pytest.approx(10)
    assert fit.operating_point.step_seconds == pytest.approx(0.02)
    assert fit.observed.goodput == pytest.approx(500)
    assert fit.step_time.at(fit.operating_point) == pytest.approx(0.02)
    assert fit.footprint_relative_error < 0.02
    assert "closed loop, 16 clients" in fit.summary() and "÷ mean footprint 9.1" in fit.summary()


def test_too_few_requests_too_short_a_window_and_a_restart_are_insufficient() -> None:
    few = fit_workload(_window(count=12))
    assert isinstance(few, Insufficient) and "12 requests finished" in str(few)
    short = fit_workload(_window(seconds=3.0))
    assert isinstance(short, Insufficient) and "spans 3.0 s" in str(short)
    base = _window()
    scrapes = list(base.scrapes)
    scrapes[5] = replace(scrapes[5], generated_tokens=10.0)  # a counter that falls: a new process
    restarted = fit_workload(replace(base, scrapes=tuple(scrapes)))
    assert isinstance(restarted, Insufficient) and "restarted" in str(restarted)
    unknown_pool = fit_workload(replace(base, settings=None))
    assert isinstance(unknown_pool, Insufficient) and "pool size" in str(unknown_pool)
    nothing = fit_workload(replace(base, prompt_len=None, output_len=Buckets(((1.0, 0.0),), 0.0, 0.0)))
    assert isinstance(nothing, Insufficient)
    assert len(nothing.reasons) == 2  # both histograms named, not just the first missing one


def test_coarse_buckets_and_a_small_sample_lower_the_confidence_and_say_why() -> None:
    fine = fit_workload(_window(count=300))
    coarse = fit_workload(_window(count=300, bounds=VLLM_BOUNDS))
    small = fit_workload(_window(count=40))
    assert isinstance(fine, FittedWorkload) and isinstance(coarse, FittedWorkload)
    assert isinstance(small, FittedWorkload)
    assert not any("coarse" in n for n in fine.notes)
    assert any("prompt buckets coarse" in n for n in coarse.notes) and coarse.confidence == "low"
    assert any("only 40 finished" in n for n in small.notes)
    assert small.footprint_relative_error > fine.footprint_relative_error


def test_a_swinging_request_count_is_an_open_loop_at_the_arrival_rate() -> None:
    swinging = (3, 11, 6, 0, 14, 4, 9, 1, 12, 5, 2, 10, 3)
    idle = _window(in_system=swinging)
    untimed = fit_workload(idle)  # the engine sat idle at a scrape: its span is no count of steps
    assert isinstance(untimed, Insufficient) and "no step could be timed" in str(untimed)
    itl = Buckets(((0.025, 1000.0), (float("inf"), 1000.0)), 1000.0, 1000 * 0.02)
    fit = fit_workload(replace(idle, inter_token_latency=itl))
    assert isinstance(fit, FittedWorkload)
    assert not fit.arrival.closed
    # 300 finished in 12 s, the count back where it started: 25 arrivals per second
    assert fit.arrival.rate_per_s == pytest.approx(25.0)
    assert fit.operating_point.step_seconds == pytest.approx(0.02)  # the latency histogram's mean


def test_a_second_operating_point_replaces_the_prior_split() -> None:
    one = fitted()
    other = OperatingPoint(batch=4.0, prefill_per_step=8.0, step_seconds=0.016)
    two = fit_workload(_window(), earlier_points=[other])
    assert isinstance(two, FittedWorkload)
    assert "prior" in one.step_time.basis and "prior" not in two.step_time.basis
    assert not any("prior" in n for n in two.notes)
    same_batch = OperatingPoint(
        batch=10.0, prefill_per_step=one.operating_point.prefill_per_step, step_seconds=0.021
    )
    again = fit_workload(_window(), earlier_points=[same_batch])
    assert isinstance(again, FittedWorkload) and any("prior" in n for n in again.notes)
    assert two.step_time.at(other) == pytest.approx(0.016, rel=0.05)
    assert two.step_time.at(two.operating_point) == pytest.approx(0.02, rel=0.05)


@settings(max_examples=25, deadline=None)
@given(
    prompt=st.tuples(st.integers(1, 2000), st.integers(0, 2000)),
    output=st.tuples(st.integers(1, 1000), st.integers(0, 1000)),
    count=st.integers(20, 400),
    clients=st.integers(1, 64),
    seed=st.integers(0, 1000),
)
def test_any_steady_window_with_enough_requests_fits_its_means_clients_and_pool(
    prompt: tuple[int, int], output: tuple[int, int], count: int, clients: int, seed: int
) -> None:
    prompts = uniform_lengths(seed, count, (prompt[0], prompt[0] + prompt[1]))
    outputs = uniform_lengths(seed + 1, count, (output[0], output[0] + output[1]))
    fit = fit_workload(window(prompts, outputs, in_system=(clients,) * 13, running=min(clients, 10)))
    assert isinstance(fit, FittedWorkload), fit
    # the histogram's sum is exact, so the fitted means are the window's means whatever the buckets
    assert fit.prompt_len.observed_mean == pytest.approx(sum(prompts) / count)
    assert fit.output_len.observed_mean == pytest.approx(sum(outputs) / count)
    assert fit.arrival.clients == clients
    assert fit.settings.pool_tokens == 4096 and fit.settings.block_size == 16
    assert 0 <= fit.footprint_relative_error < 1
    # fewer than `few_finished` requests is said, never silently trusted
    assert (fit.confidence == "low") and any("step-time split" in n for n in fit.notes)
    assert (count < 100) == any("finished requests" in n for n in fit.notes)


@settings(max_examples=15, deadline=None)
@given(count=st.integers(0, 19), seed=st.integers(0, 1000))
def test_any_window_with_too_few_requests_is_insufficient_and_says_how_many(count: int, seed: int) -> None:
    prompts = uniform_lengths(seed, count, (10, 500))
    outputs = uniform_lengths(seed + 1, count, (10, 500))
    fit = fit_workload(window(prompts, outputs))
    assert isinstance(fit, Insufficient)
    assert any(f"{count} requests finished" in reason for reason in fit.reasons)


def test_a_closed_loop_that_changed_its_clients_in_the_window_is_read_at_its_new_level() -> None:
    itl = Buckets(((0.025, 1000.0), (float("inf"), 1000.0)), 1000.0, 1000 * 0.02)

    def arrival(in_system: tuple[int, ...]) -> str:
        fit = fit_workload(replace(_window(in_system=in_system), inter_token_latency=itl))
        assert isinstance(fit, FittedWorkload)
        return fit.arrival.describe()

    # a step down from 3 clients to 1 (one scrape caught mid-way), and up from 1 to 3: the level it holds now
    assert arrival((3, 3, 3, 3, 3, 3, 2, 1, 1, 1, 1, 1, 1)) == "closed loop, 1 clients"
    assert arrival((1, 1, 1, 1, 1, 2, 3, 3, 3, 3, 3, 3, 3)) == "closed loop, 3 clients"
    # a change seen at the last two scrapes only: the level the window held, the next window reads the new one
    assert arrival((3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 1, 1)) == "closed loop, 3 clients"
    # an open loop's swing has no two steady stretches
    assert arrival((3, 11, 6, 0, 14, 4, 9, 1, 12, 5, 2, 10, 3)).startswith("open loop")


def test_a_poisson_count_is_seldom_read_as_a_closed_loop_that_changed() -> None:
    """An open loop's in-system count (Poisson around its mean) swings within any stretch: over 1,000 windows
    of 15 scrapes at means 2 to 40, fewer than 2% find two steady stretches (about as often as a whole window
    of a Poisson count looks steady)."""
    rng = np.random.default_rng(36)
    limits = FitLimits()
    misread = 0
    for _ in range(1000):
        counts = [float(n) for n in rng.poisson(rng.uniform(2.0, 40.0), size=15)]
        misread += not _steady(counts, limits) and _stepped_level(counts, limits) is not None
    assert misread < 20, misread
