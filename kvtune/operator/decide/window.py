"""A window of samples in time order, and what it says over its span: counter increases and rates, gauge
statistics, and histogram deltas.

Growth is only ever taken inside one process. Between two samples that name different processes (their
identities, see `sample.identity_of`) nothing is counted: a rate across them would be a flip between
sources, not work. Inside one process a counter never falls, so a sample below the highest value seen
(a stale replica, a replayed scrape) counts nothing, and neither does the climb back to that value. Only
where a source exports no start time does a counter that falls count from zero again, as Prometheus'
`increase()` does across a restart."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from itertools import pairwise

from kvtune.operator.decide.sample import Histogram, Sample, identity_of


def same_process(before: Sample, after: Sample) -> bool | None:
    """True when both samples name the same processes (or `after` a part of them), False when they name
    different ones, None when either names none."""
    first, then = identity_of(before), identity_of(after)
    if not first or not then:
        return None
    known = dict(first)
    return all(known.get(who) == start for who, start in then)


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
        """Restarts seen between consecutive samples: another process's identity, or, where the source
        exports no start time, counters that fell (an engine restart resets every counter). A counter that
        falls inside one identity is no restart: `continuity` calls that source an alternating one."""
        resets = 0
        for before, after in pairwise(self.samples):
            same = same_process(before, after)
            fell = any(after.counters.get(name, value) < value for name, value in before.counters.items())
            if same is False or (same is None and fell):
                resets += 1
        return resets

    def increase(self, name: str) -> float | None:
        """How much counter `name` grew over the window, inside one process at a time (see the module's
        docstring); None when fewer than two samples hold it."""
        held = [s for s in self.samples if name in s.counters]
        if len(held) < 2:
            return None
        grown, mark = 0.0, held[0].counters[name]
        for before, after in pairwise(held):
            value, previous = after.counters[name], before.counters[name]
            same = same_process(before, after)
            if same is None:
                grown += value - previous if value >= previous else value
                mark = value
            elif same:
                grown += max(0.0, value - mark)
                mark = max(mark, value)
            else:
                mark = value
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

    def histogram_delta(self, name: str) -> Histogram | None:
        """Observations that landed in histogram `name` during the window, bucket-wise, inside one process
        at a time as `increase` counts them."""
        held = [s for s in self.samples if name in s.histograms]
        if len(held) < 2:
            return None
        counts: dict[float, float] = {}
        count = total = 0.0
        base = held[0].histograms[name]  # what the next sample's growth is measured from
        for before, after in pairwise(held):
            histogram = after.histograms[name]
            same = same_process(before, after)
            if same is False or (same and histogram.count < base.count):
                base = histogram if same is False else base  # another process, or one below its marks
                continue
            if same is None:
                base = before.histograms[name]
            restarted = same is None and histogram.count < base.count
            previous = dict(base.buckets)
            for bound, value in histogram.buckets:
                grown = value if restarted else value - previous.get(bound, 0.0)
                counts[bound] = counts.get(bound, 0.0) + max(grown, 0.0)
            count += histogram.count if restarted else histogram.count - base.count
            total += histogram.total if restarted else histogram.total - base.total
            base = histogram
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
