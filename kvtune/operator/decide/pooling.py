"""Many pods' samples -> one pooled Sample, pure (no I/O): what the diagnosis and tuner read for a workload
of N replicas, unchanged.

Counters and histograms are pooled from each pod's *delta* since its previous sample, added to a pooled
total that only grows: a pod first seen after the first sample brings its whole counter as new work, a pod
whose counter fell (or whose process start time moved) restarted and brings its new value, a pod that is
gone is dropped. So pods that come, go or restart never make the pooled counters fall, which the window
would read as an engine restart, and never make a rate negative.

Gauges pool by what the diagnosis compares them to (`GAUGE_POOLING`). The cache config is per pod: pods
must agree; when they do not, the smallest pool is used (its pod preempts first) and the disagreement is a
finding. The worst pod (most preemptions in the window, then the highest KV usage) is named.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kvtune.contract import metrics as m
from kvtune.operator.decide.sample import Histogram, Sample

Pooling = str  # "max", "sum" or "mean"

# How each gauge pools across pods, and why:
GAUGE_POOLING: dict[str, Pooling] = {
    m.KV_USAGE: "max",  # the fullest pod is the one that preempts
    m.KV_EFFECTIVE: "max",  # as KV usage: a per-pod ratio, the fullest pod is the one to watch
    m.RUNNING: "max",  # compared to max_num_seqs, which is per pod: the busiest pod says whether it binds
    m.WAITING: "sum",  # demand: the workload's whole queue
    m.RETRACTED_NOW: "sum",  # requests being retracted anywhere in the workload
    m.CACHE_HIT_RATE_GAUGE: "mean",  # a per-pod ratio with no weights: the workload's typical pod
    m.MAX_NUM_SEQS: "max",  # a knob: pods agree once the operator set it (the actuator reads it per pod)
    m.MAX_TOKENS_CAP: "max",  # a knob, likewise
}
SPLIT_GAUGE_POOLING: dict[str, Pooling] = {m.WAITING_BY_REASON: "sum"}  # `name:label` gauges, as WAITING
NOT_POOLED = frozenset({m.PROCESS_START})  # per pod: a pod's restart is absorbed here, not the workload's


def gauge_pooling(name: str) -> Pooling:
    if name in GAUGE_POOLING:
        return GAUGE_POOLING[name]
    return SPLIT_GAUGE_POOLING.get(name.split(":", 1)[0], "max")


@dataclass(frozen=True)
class PodMark:
    """One pod at one sample: what its status line is built from."""

    at: float
    preemptions: float  # preemptions since the pod's previous sample (0 at its first)
    kv_usage: float | None
    running: float | None
    max_num_seqs: float | None


@dataclass(frozen=True)
class PodMemory:
    """The last figures of one pod: counters and histograms as it last exposed them (a series missing from
    one scrape keeps its last value, so its return is not counted twice), its start time, its recent marks."""

    counters: Mapping[str, float]
    histograms: Mapping[str, Histogram]
    started: float | None
    marks: tuple[PodMark, ...]


@dataclass(frozen=True)
class PoolState:
    """What pooling keeps between samples: each pod's memory and the pooled totals so far."""

    at: float | None = None
    pods: Mapping[str, PodMemory] = field(default_factory=dict)
    counters: Mapping[str, float] = field(default_factory=dict)
    histograms: Mapping[str, Histogram] = field(default_factory=dict)
    histograms_at: float | None = None  # the last sample that carried histograms


def histograms_due(state: PoolState, now: float, period_s: float, interval_s: float) -> bool:
    """Whether this read should carry the pods' histograms: at the first, then once per `period_s`,
    stretched by up to half of it by the last read's own time (so a fleet's policies, started together,
    do not all read them at the same tick), to the nearest interval. Most of an engine's series are
    histogram buckets, and the window reads them as deltas over many seconds; between two reads each pod
    keeps its last ones."""
    if state.histograms_at is None:
        return True
    spread = 1.0 + (int(state.histograms_at * 1000) % 500) / 1000
    return now - state.histograms_at + interval_s / 2 >= period_s * spread


@dataclass(frozen=True)
class PodEvidence:
    """One pod over a window, for status."""

    name: str
    preemptions: float
    kv_usage_max: float | None
    running_max: float | None
    max_num_seqs: int | None
    last_seen: float


@dataclass(frozen=True)
class Pooled:
    sample: Sample
    state: PoolState
    findings: tuple[str, ...] = ()  # disagreements between pods (cache config, histogram buckets)
    restarted: tuple[str, ...] = ()  # pods whose counters or start time say they restarted since last seen
    new: tuple[str, ...] = ()  # pods first seen at this sample (after the first)
    gone: tuple[str, ...] = ()  # pods dropped at this sample


def process_restarted(before: PodMemory, after: Sample) -> bool:
    """The engine's process start time moved: every counter of the pod starts again from zero."""
    started = after.gauges.get(m.PROCESS_START)
    return before.started is not None and started is not None and started != before.started


def pod_restarted(before: PodMemory, after: Sample) -> bool:
    if process_restarted(before, after):
        return True
    fell = any(after.counters[k] < v for k, v in before.counters.items() if k in after.counters)
    return fell or any(
        after.histograms[k].count < h.count for k, h in before.histograms.items() if k in after.histograms
    )


def counter_deltas(before: PodMemory | None, after: Sample, restarted: bool) -> dict[str, float]:
    """What each counter of one pod counted since its previous sample; all of it when the pod is new or its
    process `restarted`. A counter that fell on its own was reset on its own (a proxy sidecar's container
    restarted while the engine ran on): its new value is its delta, and the engine's counters keep theirs,
    so a sidecar's restart never counts the engine's preemptions twice."""
    if before is None or restarted:
        return dict(after.counters)
    deltas: dict[str, float] = {}
    for key, value in after.counters.items():
        previous = before.counters.get(key, 0.0)
        deltas[key] = value if value < previous else value - previous
    return deltas


def histogram_delta(before: Histogram | None, after: Histogram) -> Histogram:
    """What one histogram counted since `before`; all of it when there is none or it was reset since."""
    if before is None or after.count < before.count:
        return after
    previous = dict(before.buckets)
    buckets = tuple((bound, count - previous.get(bound, 0.0)) for bound, count in after.buckets)
    return Histogram(buckets, after.count - before.count, after.total - before.total)


def add_histogram(total: Histogram | None, delta: Histogram) -> Histogram:
    if total is None:
        return delta
    grown = dict(delta.buckets)
    buckets = tuple((bound, count + grown[bound]) for bound, count in total.buckets)
    return Histogram(buckets, total.count + delta.count, total.total + delta.total)


def bounds(histogram: Histogram) -> tuple[float, ...]:
    return tuple(bound for bound, _ in histogram.buckets)


def pool_gauges(samples: Mapping[str, Sample]) -> dict[str, float]:
    values: dict[str, list[float]] = {}
    for sample in samples.values():
        for name, value in sample.gauges.items():
            if name not in NOT_POOLED:
                values.setdefault(name, []).append(value)
    pooled: dict[str, float] = {}
    for name, found in values.items():
        how = gauge_pooling(name)
        pooled[name] = sum(found) if how == "sum" else max(found) if how == "max" else sum(found) / len(found)
    return pooled


def pool_size(config: Mapping[str, str]) -> float:
    """A pod's KV pool in tokens from its cache config (infinite when it does not say)."""
    try:
        if "kv_cache_size_tokens" in config:
            return float(config["kv_cache_size_tokens"])
        return float(config["num_blocks"]) * float(config["block_size"])
    except (KeyError, ValueError):
        return float("inf")


def pool_cache_config(samples: Mapping[str, Sample]) -> tuple[dict[str, str], tuple[str, ...]]:
    """The pods' common cache config; when they disagree, the smallest pool's, and the disagreement."""
    configs = {name: dict(s.cache_config) for name, s in sorted(samples.items()) if s.cache_config}
    if not configs:
        return {}, ()
    distinct = {tuple(sorted(c.items())) for c in configs.values()}
    smallest = min(configs, key=lambda name: (pool_size(configs[name]), name))
    if len(distinct) == 1:
        return configs[smallest], ()
    keys = sorted({k for c in configs.values() for k in c if len({c.get(k) for c in configs.values()}) > 1})
    detail = "; ".join(
        f"{k}: " + ", ".join(f"{n}={c.get(k, 'n/a')}" for n, c in configs.items()) for k in keys
    )
    return configs[smallest], (
        f"pods disagree on their cache config ({detail}); sized from {smallest}'s pool",
    )


def pool(
    state: PoolState,
    readings: Mapping[str, Sample],
    present: frozenset[str] | set[str],
    now: float,
    horizon: float,
    source: str = "",
) -> Pooled:
    """Fold this instant's per-pod samples into the pooled totals. `readings` are the pods read now;
    `present` every pod that still exists (a listed pod whose scrape failed keeps its memory, so its next
    sample is a delta again); any other pod in `state` is gone and dropped. Marks older than `horizon`
    seconds are forgotten."""
    first = state.at is None
    counters = dict(state.counters)
    histograms = dict(state.histograms)
    pods: dict[str, PodMemory] = {}
    findings: list[str] = []
    restarted: list[str] = []
    new: list[str] = []
    for name in sorted(readings):
        sample = readings[name]
        before = state.pods.get(name)
        started = sample.gauges.get(m.PROCESS_START)
        was_restarted = before is not None and pod_restarted(before, sample)
        # a pod first seen now whose process predates the last sample was there unseen (a failed read, a
        # slow endpoint): its counters are a baseline, not new work that cannot be placed in time
        predates = started is not None and state.at is not None and started < state.at
        baseline = before is None and (first or predates)
        if was_restarted:
            restarted.append(name)
        if before is None and not first:
            new.append(name)
        moved = before is not None and process_restarted(before, sample)
        deltas = {} if baseline else counter_deltas(before, sample, moved)
        for key, delta in deltas.items():
            counters[key] = counters.get(key, 0.0) + delta
        if first:
            for key, value in sample.counters.items():
                counters[key] = counters.get(key, 0.0) + value
        for key, histogram in sample.histograms.items():
            pooled = histograms.get(key)
            if pooled is not None and bounds(pooled) != bounds(histogram):
                findings.append(f"{name}: buckets of {key} differ from the other pods'; left out of the pool")
                continue
            grown: Histogram | None = None
            if before is not None and not moved:
                grown = histogram_delta(before.histograms.get(key), histogram)
            elif first or not baseline:
                grown = histogram  # since boot at the first sample; all new work for a new or restarted pod
            if grown is not None:
                histograms[key] = add_histogram(pooled, grown)
            elif pooled is None:
                histograms[key] = Histogram(tuple((b, 0.0) for b in bounds(histogram)), 0.0, 0.0)
        preempted = deltas.get(m.PREEMPTIONS, 0.0)
        mark = PodMark(now, preempted, sample.gauges.get(m.KV_USAGE), sample.gauges.get(m.RUNNING),
                       sample.gauges.get(m.MAX_NUM_SEQS))  # fmt: skip
        kept = tuple(old for old in (before.marks if before else ()) if old.at >= now - horizon)
        # a series missing from this read (a histogram between two reads of them) keeps its last value
        earlier = before if before is not None and not was_restarted else None
        remembered = {**(earlier.counters if earlier else {}), **sample.counters}
        remembered_histograms = {**(earlier.histograms if earlier else {}), **sample.histograms}
        pods[name] = PodMemory(remembered, remembered_histograms, started, (*kept, mark))
    for name in present:
        if name not in pods and name in state.pods:
            pods[name] = state.pods[name]
    gone = tuple(sorted(name for name in state.pods if name not in pods))
    config, disagreements = pool_cache_config(readings)
    corrupt = tuple(sorted({(f"{pod}: {series}", problem) for pod, s in readings.items()
                            for series, problem in s.corrupt}))  # fmt: skip
    running_all = sum(s.gauges.get(m.RUNNING, 0.0) for s in readings.values())
    gauges = {**pool_gauges(readings), m.POOLED_PODS: float(len(readings)), m.RUNNING_ALL_PODS: running_all}
    sample = Sample(now, gauges, counters, histograms, config, source, corrupt)
    carried = any(s.histograms for s in readings.values())
    new_state = PoolState(now, pods, counters, histograms, now if carried else state.histograms_at)
    return Pooled(sample, new_state, (*disagreements, *findings), tuple(restarted), tuple(new), gone)


def evidence(state: PoolState, since: float | None) -> list[PodEvidence]:
    """Each pod over the window from `since` (a preemption counts when it was counted after `since`), the
    worst first: most preemptions, then the highest KV usage, then by name."""
    found: list[PodEvidence] = []
    for name, memory in state.pods.items():
        marks = [mark for mark in memory.marks if since is None or mark.at >= since]
        if not marks:
            continue
        kv = [mark.kv_usage for mark in marks if mark.kv_usage is not None]
        running = [mark.running for mark in marks if mark.running is not None]
        seqs = marks[-1].max_num_seqs
        found.append(
            PodEvidence(
                name,
                sum(mark.preemptions for mark in marks if since is None or mark.at > since),
                max(kv) if kv else None,
                max(running) if running else None,
                int(seqs) if seqs else None,
                marks[-1].at,
            )
        )
    return sorted(found, key=lambda e: (-e.preemptions, -(e.kv_usage_max or 0.0), e.name))


def worst_pod_line(worst: PodEvidence) -> str:
    kv = "n/a" if worst.kv_usage_max is None else f"{worst.kv_usage_max:.0%}"
    return f"worst pod {worst.name}: {worst.preemptions:.0f} preemptions in the window, KV usage max {kv}"
