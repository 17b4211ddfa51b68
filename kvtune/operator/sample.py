"""One reading of an engine's metrics under canonical names, whatever engine or source it came from."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from kvtune.operator.metric_names import CACHE_CONFIG_LABELS, Kind, Merge, lookup


@dataclass(frozen=True)
class Histogram:
    """Cumulative bucket counts (upper bound -> count, `inf` included), as Prometheus exposes them."""

    buckets: tuple[tuple[float, float], ...]
    count: float
    total: float


@dataclass(frozen=True)
class Sample:
    """Every figure the operator reads at one instant: gauges and counters by canonical name (a split
    series as `name:label_value`), histograms, and the cache config labels."""

    timestamp: float
    gauges: Mapping[str, float] = field(default_factory=dict)
    counters: Mapping[str, float] = field(default_factory=dict)
    histograms: Mapping[str, Histogram] = field(default_factory=dict)
    cache_config: Mapping[str, str] = field(default_factory=dict)
    source: str = ""


@dataclass(frozen=True)
class NoData:
    """A source that could not be read, or held none of the series the operator reads: a finding only."""

    source: str
    reason: str
    timestamp: float


SampleResult = Sample | NoData
Series = tuple[str, Mapping[str, str], float]


def sample_from_series(series: Iterable[Series], timestamp: float, source: str) -> SampleResult:
    """Fold raw (name, labels, value) series into one Sample through the name map."""
    gauges: dict[str, float] = {}
    counters: dict[str, float] = {}
    buckets: dict[str, dict[float, float]] = {}
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    cache_config: dict[str, str] = {}
    for name, labels, value in series:
        found = lookup(name)
        if found is None or value != value:  # unknown series, or NaN
            continue
        entry, part = found
        key = entry.name
        if entry.split_label is not None:
            key = f"{key}:{labels.get(entry.split_label, '')}"
        if entry.kind is Kind.INFO:
            for label, label_value in labels.items():
                canonical = CACHE_CONFIG_LABELS.get(label)
                if canonical is not None:
                    cache_config.setdefault(canonical, label_value)
        elif entry.kind is Kind.HISTOGRAM:
            if part == "_bucket":
                bound = float(labels.get("le", "inf"))
                per = buckets.setdefault(key, {})
                per[bound] = per.get(bound, 0.0) + value
            elif part == "_sum":
                sums[key] = sums.get(key, 0.0) + value
            else:
                counts[key] = counts.get(key, 0.0) + value
        else:
            target = gauges if entry.kind is Kind.GAUGE else counters
            if key in target and entry.merge is Merge.MAX:
                target[key] = max(target[key], value)
            else:
                target[key] = target.get(key, 0.0) + value
    histograms = {
        key: Histogram(tuple(sorted(per.items())), counts.get(key, max(per.values(), default=0.0)),
                       sums.get(key, 0.0))
        for key, per in buckets.items()
    }  # fmt: skip
    if not (gauges or counters or histograms):
        return NoData(source, "none of the vLLM, SGLang or kvtune series the operator reads", timestamp)
    return Sample(timestamp, gauges, counters, histograms, cache_config, source)
