"""A window of samples in time order, and what it says over its span: counter increases and rates (a
counter that falls is an engine restart and counts from zero again, as Prometheus' `increase()` does),
gauge statistics, and histogram deltas."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from itertools import pairwise

from kvtune.operator.sample import Histogram, Sample


@dataclass(frozen=True)
class Window:
    samples: tuple[Sample, ...]

    @staticmethod
    def of(samples: Iterable[Sample]) -> Window:
        return Window(tuple(sorted(samples, key=lambda s: s.timestamp)))

    def since(self, start: float | None) -> Window:
        """The samples taken at or after `start` (all of them when `start` is None)."""
        if start is None:
            return self
        return Window(tuple(s for s in self.samples if s.timestamp >= start))

    def last(self, count: int) -> Window:
        return Window(self.samples[-count:]) if count > 0 else Window(())

    @property
    def latest(self) -> Sample | None:
        return self.samples[-1] if self.samples else None

    @property
    def duration(self) -> float:
        return self.samples[-1].timestamp - self.samples[0].timestamp if len(self.samples) > 1 else 0.0

    def restarts(self) -> int:
        """Counter resets seen between consecutive samples (an engine restart resets every counter)."""
        resets = 0
        for before, after in pairwise(self.samples):
            if any(after.counters.get(name, value) < value for name, value in before.counters.items()):
                resets += 1
        return resets

    def increase(self, name: str) -> float | None:
        """How much counter `name` grew over the window; None when fewer than two samples hold it."""
        values = [s.counters[name] for s in self.samples if name in s.counters]
        if len(values) < 2:
            return None
        grown = 0.0
        for before, after in pairwise(values):
            grown += after - before if after >= before else after
        return grown

    def rate(self, name: str) -> float | None:
        grown = self.increase(name)
        if grown is None or self.duration <= 0:
            return None
        return grown / self.duration

    def increases_with_prefix(self, prefix: str) -> dict[str, float]:
        """Increase of every split counter `prefix:<label value>` present in the window."""
        names = {name for s in self.samples for name in s.counters if name.startswith(prefix + ":")}
        found = {name[len(prefix) + 1 :]: self.increase(name) for name in names}
        return {label: grown for label, grown in found.items() if grown is not None}

    def gauge_values(self, name: str) -> list[float]:
        return [s.gauges[name] for s in self.samples if name in s.gauges]

    def gauge_mean(self, name: str) -> float | None:
        values = self.gauge_values(name)
        return sum(values) / len(values) if values else None

    def gauge_max(self, name: str) -> float | None:
        values = self.gauge_values(name)
        return max(values) if values else None

    def gauge_latest(self, name: str) -> float | None:
        values = self.gauge_values(name)
        return values[-1] if values else None

    def histogram_delta(self, name: str) -> Histogram | None:
        """Observations that landed in histogram `name` during the window (restart-aware, bucket-wise)."""
        series = [s.histograms[name] for s in self.samples if name in s.histograms]
        if len(series) < 2:
            return None
        counts: dict[float, float] = {}
        count = total = 0.0
        for before, after in pairwise(series):
            restarted = after.count < before.count
            previous = dict(before.buckets)
            for bound, value in after.buckets:
                grown = value if restarted else value - previous.get(bound, 0.0)
                counts[bound] = counts.get(bound, 0.0) + max(grown, 0.0)
            count += after.count if restarted else after.count - before.count
            total += after.total if restarted else after.total - before.total
        return Histogram(tuple(sorted(counts.items())), count, total)

    def histogram_latest(self, name: str) -> Histogram | None:
        """The cumulative histogram of the newest sample holding it (everything since the engine started)."""
        for sample in reversed(self.samples):
            if name in sample.histograms:
                return sample.histograms[name]
        return None


def since_boot(latest: Sample, started: float) -> Window:
    """The window from the engine's process start to `latest`: a first sample of zeros at `started` (every
    counter and histogram starts there), so the increases are the values since boot. Its gauges are
    dropped: they say what the engine holds now, not over that span."""
    zero = Sample(
        timestamp=started,
        counters=dict.fromkeys(latest.counters, 0.0),
        histograms={
            name: Histogram(tuple((bound, 0.0) for bound, _ in h.buckets), 0.0, 0.0)
            for name, h in latest.histograms.items()
        },
        cache_config=latest.cache_config,
        source=latest.source,
    )
    return Window((zero, replace(latest, gauges={})))


def histogram_quantile(q: float, histogram: Histogram) -> float | None:
    """Prometheus' estimate: linear inside the bucket holding rank q; the highest finite bound when the
    rank falls in the +Inf bucket. None for an empty histogram."""
    buckets = histogram.buckets
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return None
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return lower_bound
