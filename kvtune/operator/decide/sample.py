"""One reading of an engine's metrics under canonical names, whatever engine or source it came from.

Impossible values (NaN, infinities, negative counts, a ratio outside [0, 1], histogram buckets that fall
as `le` rises) are never figures: every series of that canonical name is dropped from the sample and the
sample names it in `corrupt`, so diagnosis can report it and nothing acts on it.

Every sample names the processes that produced it (`identity`: each `process_start_time_seconds`, by the
pod or instance its series carries where the source has one), because a counter only grows inside one
process: `continuity` and `window` never take a rate across two identities.

What the operator knows of an engine's configuration (`EngineView`): its live knobs, its KV pool, and which knobs an
actuator can change on it. Built from the metrics (`cache_config_info`, kvtune's live gauges) plus what the
caller knows (a Deployment's args, the admin API)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from kvtune.contract.metrics import (
    CACHE_CONFIG_LABELS,
    MAX_NUM_SEQS,
    MAX_TOKENS_CAP,
    PROCESS_START,
    RATIO_GAUGES,
    Canonical,
    Kind,
    Merge,
    lookup,
)


@dataclass(frozen=True)
class Histogram:
    """Cumulative bucket counts (upper bound -> count, `inf` included), as Prometheus exposes them."""

    buckets: tuple[tuple[float, float], ...]
    count: float
    total: float


# One process behind a sample: who (`pod=...`, `instance=...`, `proxy`, or '' for the one process a URL
# answers from) and its process_start_time_seconds. A sample's identity is the sorted tuple of them.
Identity = tuple[tuple[str, float], ...]
IDENTITY_LABELS = ("namespace", "pod", "instance")  # the labels that tell one process's series from another's


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
    corrupt: tuple[tuple[str, str], ...] = ()  # dropped series: (exposed name, what is wrong with it)
    identity: Identity = ()  # the processes behind it; () when the source exports no start time


def identity_of(sample: Sample) -> Identity:
    """The processes behind `sample`: its identity, or its one start time when only the gauge says it."""
    if sample.identity:
        return sample.identity
    started = sample.gauges.get(PROCESS_START)
    return (("", started),) if started is not None else ()


def who(labels: Mapping[str, str]) -> str:
    """Which process a series comes from, by the labels that tell processes apart ('' when none does)."""
    return ",".join(f"{label}={labels[label]}" for label in IDENTITY_LABELS if labels.get(label))


@dataclass(frozen=True)
class NoData:
    """A source that could not be read, or held none of the series the operator reads: a finding only."""

    source: str
    reason: str
    timestamp: float


SampleResult = Sample | NoData
Series = tuple[str, Mapping[str, str], float]


def value_problem(entry: Canonical, part: str, value: float) -> str | None:
    """What makes one exposed value impossible for its kind, or None when it is a usable figure."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return f"{'+' if value > 0 else '-'}Inf"
    if entry.kind is Kind.INFO:
        return None
    if entry.kind is Kind.CONFIG:
        return None if value >= 0 else f"negative ({value:g})"
    if value < 0 and (entry.kind is not Kind.HISTOGRAM or part != "_sum"):
        return f"negative ({value:g})"
    if entry.kind is Kind.GAUGE and entry.name in RATIO_GAUGES and value > 1:
        return f"{value:g} is outside [0, 1]"
    return None


def bucket_problem(per_bound: Mapping[float, float]) -> str | None:
    """Cumulative buckets must not fall as `le` rises."""
    previous_bound, previous = None, 0.0
    for bound, count in sorted(per_bound.items()):
        if count < previous:
            return f"bucket le={bound:g} holds {count:g}, less than le={previous_bound:g} ({previous:g})"
        previous_bound, previous = bound, count
    return None


def sample_from_series(series: Iterable[Series], timestamp: float, source: str) -> SampleResult:
    """Fold raw (name, labels, value) series into one Sample through the name map; a canonical name with
    any impossible series is dropped whole (a partial sum over pods would read as a counter reset)."""
    gauges: dict[str, float] = {}
    counters: dict[str, float] = {}
    buckets: dict[str, dict[float, float]] = {}
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    cache_config: dict[str, str] = {}
    corrupt: dict[str, tuple[str, str]] = {}  # canonical key -> (exposed name, what is wrong)
    exposed: dict[str, str] = {}  # canonical histogram key -> an exposed name, for messages
    identity: set[tuple[str, float]] = set()
    for name, labels, value in series:
        found = lookup(name)
        if found is None:
            continue
        entry, part = found
        key = entry.name
        if entry.split_label is not None:
            key = f"{key}:{labels.get(entry.split_label, '')}"
        problem = value_problem(entry, part, value)
        if problem is not None:
            corrupt.setdefault(key, (name, problem))
            continue
        if key == PROCESS_START:
            identity.add((who(labels), value))
        if entry.kind is Kind.INFO:
            for label, label_value in labels.items():
                canonical = CACHE_CONFIG_LABELS.get(label)
                if canonical is not None:
                    cache_config.setdefault(canonical, label_value)
        elif entry.kind is Kind.CONFIG:
            cache_config.setdefault(entry.name, f"{value:g}" if value != int(value) else str(int(value)))
        elif entry.kind is Kind.HISTOGRAM:
            exposed.setdefault(key, name.removesuffix(part))
            if part == "_bucket":
                try:
                    bound = float(labels.get("le", "inf"))
                except ValueError:
                    corrupt.setdefault(key, (name, f"le={labels.get('le')!r} is not a number"))
                    continue
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
    for key, per in buckets.items():
        problem = bucket_problem(per)
        if problem is not None:
            corrupt.setdefault(key, (f"{exposed[key]}_bucket", problem))
    for key in corrupt:
        for figures in (gauges, counters, buckets, sums, counts):
            figures.pop(key, None)
    histograms = {
        key: Histogram(tuple(sorted(per.items())), counts.get(key, max(per.values(), default=0.0)),
                       sums.get(key, 0.0))
        for key, per in buckets.items()
    }  # fmt: skip
    found_corrupt = tuple(sorted(corrupt.values()))
    if PROCESS_START in corrupt:
        identity.clear()  # a start time that is not a number names no process
    if not (gauges or counters or histograms):
        if found_corrupt:
            listed = "; ".join(f"{name}: {problem}" for name, problem in found_corrupt)
            reason = f"corrupt metrics: every series the operator reads is impossible ({listed})"
            return NoData(source, reason, timestamp)
        return NoData(source, "none of the vLLM, SGLang or kvtune series the operator reads", timestamp)
    return Sample(timestamp, gauges, counters, histograms, cache_config, source, found_corrupt,
                  tuple(sorted(identity)))  # fmt: skip


@dataclass(frozen=True)
class EngineView:
    max_num_seqs: int | None = None
    max_tokens_cap: int | None = None
    pool_tokens: int | None = None
    block_size: int | None = None
    cache_dtype: str | None = None
    max_model_len: int | None = None
    knobs: frozenset[str] = frozenset()  # what an actuator can change on this engine


def _int(text: str | None) -> int | None:
    try:
        return int(float(text)) if text is not None else None
    except ValueError:
        return None


def _float(text: str | None) -> float | None:
    try:
        return float(text) if text is not None else None
    except ValueError:
        return None


def engine_view_from_sample(sample: Sample | None, known: EngineView | None = None) -> EngineView:
    """Fill an EngineView from one sample; values in `known` (from the caller) win over the metrics."""
    view = EngineView()
    if sample is not None:
        config = sample.cache_config
        block_size = _int(config.get("block_size"))
        pool = _int(config.get("kv_cache_size_tokens"))
        blocks = _int(config.get("num_blocks"))
        if pool is None and blocks is not None and block_size is not None:
            pool = blocks * block_size
        max_model_len = _int(config.get("max_model_len"))
        concurrency = _float(config.get("kv_cache_max_concurrency"))
        if max_model_len is None and pool and concurrency:
            max_model_len = round(pool / concurrency)
        seqs = sample.gauges.get(MAX_NUM_SEQS)
        cap = sample.gauges.get(MAX_TOKENS_CAP)
        view = EngineView(
            max_num_seqs=int(seqs) if seqs else None,
            max_tokens_cap=int(cap) if cap else None,
            pool_tokens=pool,
            block_size=block_size,
            cache_dtype=config.get("cache_dtype"),
            max_model_len=max_model_len,
        )
    if known is None:
        return view
    overrides = {key: value for key, value in known.__dict__.items() if value not in (None, frozenset())}
    return replace(view, **overrides)
