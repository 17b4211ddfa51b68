"""The request-size histograms' buckets are fine enough for the operator's p95 footprint."""

from __future__ import annotations

import bisect
import itertools
import random

from kvtune.engine.http.metrics import size_buckets
from kvtune.operator.decide.sample import Histogram
from kvtune.operator.decide.window import histogram_quantile


def test_series_rises_in_steps_of_about_an_eighth() -> None:
    buckets = size_buckets(4096)
    assert buckets[0] == 1 and buckets[-1] == 3981 and len(buckets) < 80
    assert all(a < b for a, b in itertools.pairwise(buckets))
    assert all(
        b / a <= 1.15 for a, b in itertools.pairwise(buckets) if a >= 100
    )  # 12.2% apart, a little more where whole tokens round


def test_interpolated_p95_of_uniform_sizes_is_within_five_percent() -> None:
    rng = random.Random(0)
    bounds = size_buckets(4096)
    for low, high in ((200, 400), (100, 200), (300, 700), (500, 1500)):
        sizes = sorted(rng.randint(low, high) for _ in range(2000))
        cumulative = [(bound, float(bisect.bisect_right(sizes, bound))) for bound in bounds]
        histogram = Histogram((*cumulative, (float("inf"), float(len(sizes)))), len(sizes), float(sum(sizes)))
        true_p95 = sizes[int(0.95 * len(sizes))]
        estimate = histogram_quantile(0.95, histogram)
        assert estimate is not None and abs(estimate - true_p95) <= 0.05 * true_p95, (low, high, estimate)
