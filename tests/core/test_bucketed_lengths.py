"""The length distribution fitted to a histogram keeps what the histogram knows: every bucket's share and
the exact mean; inside a bucket it only places lengths the bucket allows."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtune.core.bucketed_lengths import BucketedLengths, Buckets
from tests.core.workloads import VLLM_BOUNDS, histogram, kvtune_bounds

KVTUNE_BOUNDS = kvtune_bounds()
lengths = st.lists(st.integers(1, 3000), min_size=1, max_size=300)


@settings(max_examples=60, deadline=None)
@given(values=lengths, coarse=st.booleans())
def test_the_fit_reproduces_every_bucket_count_it_came_from(values: list[int], coarse: bool) -> None:
    bounds = VLLM_BOUNDS if coarse else KVTUNE_BOUNDS
    hist = histogram(values, bounds)
    fit = BucketedLengths.fit(hist, upper_limit=4096)
    assert fit is not None
    for bound, cumulative in hist.cumulative:
        if math.isfinite(bound):
            # the bucket (.., bound] holds the whole numbers up to floor(bound): up to floor(bound) + 0.5
            assert fit.cdf(math.floor(bound) + 0.5) == pytest.approx(cumulative / len(values), abs=1e-9)
    assert fit.mean_matched
    assert fit.mean == pytest.approx(sum(values) / len(values), rel=1e-6)


@settings(max_examples=30, deadline=None)
@given(values=lengths, seed=st.integers(0, 1000))
def test_a_sampled_length_lies_in_a_bucket_that_held_observations(values: list[int], seed: int) -> None:
    hist = histogram(values, VLLM_BOUNDS)
    fit = BucketedLengths.fit(hist, upper_limit=4096)
    assert fit is not None
    occupied = []
    previous_bound, previous = 0.0, 0.0
    for bound, cumulative in hist.cumulative:
        if cumulative > previous:
            occupied.append((previous_bound, bound))
        previous_bound, previous = bound, cumulative
    rng = random.Random(seed)
    for _ in range(50):
        drawn = fit.sample(rng)
        assert drawn >= 1 and any(low < drawn <= high for low, high in occupied), drawn


def test_samples_rebinned_give_back_the_bucket_shares_and_the_mean() -> None:
    rng = random.Random(3)
    values = [rng.randint(600, 1400) for _ in range(400)]
    hist = histogram(values, VLLM_BOUNDS)
    fit = BucketedLengths.fit(hist, upper_limit=4096)
    assert fit is not None
    draws = [fit.sample(rng) for _ in range(20_000)]
    for bound, cumulative in hist.cumulative:
        share = sum(1 for d in draws if d <= bound) / len(draws)
        assert share == pytest.approx(cumulative / len(values), abs=0.015)
    assert sum(draws) / len(draws) == pytest.approx(sum(values) / len(values), rel=0.01)


def test_the_tilt_reads_coarse_buckets_by_their_mean_not_their_middle() -> None:
    """1,000-1,400-token prompts in vLLM's (1000, 2000] bucket are not 1,500 on average."""
    values = list(range(600, 1401))
    fine = BucketedLengths.fit(histogram(values, KVTUNE_BOUNDS), upper_limit=4096)
    coarse = BucketedLengths.fit(histogram(values, VLLM_BOUNDS), upper_limit=4096)
    assert fine is not None and coarse is not None
    assert coarse.theta < 0  # mass pulled to the low ends of (500, 1000] and (1000, 2000]
    assert coarse.mean == pytest.approx(1000, rel=1e-6)
    assert fine.resolution < 0.15 < 0.5 < coarse.resolution
    assert fine.quantile(0.95) == pytest.approx(1360, rel=0.03)
    assert coarse.quantile(0.95) > fine.quantile(0.95)  # coarse buckets read the tail long: the safe side


def test_an_empty_histogram_fits_nothing() -> None:
    assert BucketedLengths.fit(Buckets(((10.0, 0.0), (math.inf, 0.0)), 0.0, 0.0)) is None


def test_the_open_top_bucket_is_closed_by_the_limit_and_said_to_be_assumed() -> None:
    hist = histogram([5000, 6000, 100], [10.0, 100.0, 1000.0])
    fit = BucketedLengths.fit(hist, upper_limit=8192)
    assert fit is not None and fit.open_top and fit.maximum == 8192
    assert fit.mean == pytest.approx(11100 / 3, rel=1e-6)


def test_a_sum_the_buckets_cannot_hold_is_reported_not_hidden() -> None:
    hist = Buckets(((10.0, 0.0), (20.0, 5.0), (math.inf, 5.0)), 5.0, 5 * 500.0)  # mean 500 in (10, 20]
    fit = BucketedLengths.fit(hist)
    assert fit is not None and not fit.mean_matched
    assert fit.mean <= 20.5
