"""Pure diagnosis: a window of samples and the engine's config in, measured figures and findings out.

Every figure comes with the evidence a person needs to trust it; a figure the window cannot support is
None, never a guess.

Preemption detail, from what newer vLLMs add to the count: how the preemptions spread over requests (one request
preempted five times is not five requests preempted once) and why they happened (only KV pressure is
what fewer residents relieve); None where the engine does not say (older vLLMs, SGLang), so their diagnosis stays what it was. See kvtune.contract.preemptions."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvtune.contract import metrics as m
from kvtune.contract.preemptions import KV_PRESSURE_REASONS, NOT_KV_PRESSURE_REASONS
from kvtune.operator.decide.continuity import ALTERNATING_HINT, anomalies
from kvtune.operator.decide.sample import EngineView, Histogram
from kvtune.operator.decide.window import Window, histogram_quantile

MIN_OBSERVATIONS = 5  # finished requests a window needs before its own histograms are used
KV_SATURATED = 0.9
CACHED_SOURCES = ("local_cache_hit", "external_kv_transfer")


@dataclass(frozen=True)
class Finding:
    code: str  # Preempting, KVSaturated, WaitingForCapacity, LowPrefixHitRate, NoData, Idle, EngineRestarted,
    # CorruptMetrics, AlternatingSource, PreemptedForOtherReasons
    severity: str  # info, warning, critical
    message: str
    evidence: str


@dataclass(frozen=True)
class Distribution:
    p50: float
    p95: float
    p99: float
    count: float
    since: str  # "this window" or "since engine start"
    mean: float | None = None  # exact, from the histogram's sum and count (no bucket interpolation)


@dataclass(frozen=True)
class Diagnosis:
    status: str  # no_data, idle, active
    window_seconds: float = 0.0
    samples: int = 0
    restarts: int = 0
    # KV-pressure preemptions (what the ladder remedies): all of them unless the engine says why
    preemptions: float | None = None
    preemption_rate: float | None = None
    # where the engine says why (vllm#58037's by-reason counter): (reason, preemptions) that moved, and the
    # preemptions no lack of KV blocks caused, reported and left out of the two figures above
    preemptions_by_reason: tuple[tuple[str, float], ...] = ()
    other_preemptions: float | None = None
    # the requests that finished in the window by times preempted (vllm:request_num_preemptions, vLLM >= 0.30)
    preempted_requests: PreemptedRequests | None = None
    kv_usage_mean: float | None = None
    kv_usage_max: float | None = None
    prefix_hit_rate: float | None = None
    prefix_hit_rate_source: str | None = None
    running_mean: float | None = None
    running_max: float | None = None
    waiting_mean: float | None = None
    waiting_max: float | None = None
    waiting_for_capacity: float | None = None
    goodput: float | None = None  # generated tokens per second
    prompt_len: Distribution | None = None
    generation_len: Distribution | None = None
    declared_max_tokens: Distribution | None = None
    footprint_p50: float | None = None
    footprint_p95: float | None = None
    footprint_p99: float | None = None
    footprint_mean: float | None = None
    real_concurrency_ceiling: int | None = None
    mean_footprint_concurrency: int | None = None  # pool / mean footprint: every resident at its mean size
    pooled_p95_concurrency: int | None = None  # residents whose total footprint's p95 fits the pool
    boot_line_concurrency: float | None = None
    prompt_tokens: float | None = None  # prompt tokens processed in the window
    # The prefix-defeat detector's findings in the window (kvtune serve, or a kvtune proxy in front of vLLM /
    # SGLang), reasons that moved only: (reason, defeated prompts) and (reason, tokens that would have hit)
    prefix_defeats: tuple[tuple[str, float], ...] = ()
    prefix_defeat_tokens: tuple[tuple[str, float], ...] = ()
    # (mode, requests) the max_tokens cap changed or refused in the window: clamp, reject, default ('' for
    # an older kvtune's unlabelled counter)
    capped_requests: tuple[tuple[str, float], ...] = ()
    # series dropped as impossible in the window (NaN, negative counters, ...): (exposed name, what is wrong)
    corrupt: tuple[tuple[str, str], ...] = ()
    findings: tuple[Finding, ...] = ()

    @property
    def preempting(self) -> bool:
        return bool(self.preemption_rate and self.preemption_rate > 0)

    @property
    def saturated(self) -> bool:
        """KV nearly full while requests wait: the pool, not the scheduler, limits throughput."""
        return (self.kv_usage_max or 0.0) >= KV_SATURATED and (self.waiting_max or 0.0) > 0


def known(value: float | None, spec: str) -> str:
    """A figure as the operator says it: `unknown` where it could not be read, never a made-up 0."""
    return "unknown" if value is None else format(value, spec)


def corrupt_text(corrupt: tuple[tuple[str, str], ...]) -> str:
    """The corrupt series as the doctor names them: `name (what is wrong), ...`."""
    return ", ".join(f"{name} ({problem})" for name, problem in corrupt)


def no_data(reason: str) -> Diagnosis:
    return Diagnosis("no_data", findings=(Finding("NoData", "warning", f"no data: {reason}", reason),))


def distribution(window: Window, name: str) -> Distribution | None:
    """Quantiles of a per-request histogram: from the window when it saw enough finished requests, else
    from everything since the engine started."""
    delta = window.histogram_delta(name)
    chosen: tuple[Histogram, str] | None = None
    if delta is not None and delta.count >= MIN_OBSERVATIONS:
        chosen = (delta, "this window")
    else:
        latest = window.histogram_latest(name)
        if latest is not None and latest.count > 0:
            chosen = (latest, "since engine start")
    if chosen is None:
        return None
    histogram, since = chosen
    p50, p95, p99 = (histogram_quantile(q, histogram) for q in (0.5, 0.95, 0.99))
    if p50 is None or p95 is None or p99 is None:
        return None
    mean = histogram.total / histogram.count if histogram.total > 0 else None  # no sum recorded: unknown
    return Distribution(p50, p95, p99, histogram.count, since, mean)


def prefix_hit_rate(window: Window) -> tuple[float | None, str | None]:
    """Token hit rate, preferring counters that stay honest under pressure (prompt tokens by source, then
    cached prompt tokens) over the prefix-cache query counters older builds skew, then SGLang's gauge."""
    by_source = window.increases_with_prefix(m.PROMPT_TOKENS_BY_SOURCE)
    if sum(by_source.values()) > 0:
        cached = sum(by_source.get(source, 0.0) for source in CACHED_SOURCES)
        return cached / sum(by_source.values()), "prompt_tokens_by_source"
    cached_tokens = window.increase(m.PROMPT_TOKENS_CACHED)
    prompt_tokens = window.increase(m.PROMPT_TOKENS)
    if cached_tokens is not None and prompt_tokens:
        return min(cached_tokens / prompt_tokens, 1.0), "prompt_tokens_cached"
    hits, queries = window.increase(m.PREFIX_HITS), window.increase(m.PREFIX_QUERIES)
    if hits is not None and queries:
        return hits / queries, "prefix_cache_hits/queries"
    gauge = window.gauge_mean(m.CACHE_HIT_RATE_GAUGE)
    if gauge is not None:
        return gauge, "cache_hit_rate gauge"
    return None, None


def moved(window: Window, name: str) -> tuple[tuple[str, float], ...]:
    """(label value, increase) of a split counter over the window, for the label values that moved."""
    return tuple(sorted((label, v) for label, v in window.increases_with_prefix(name).items() if v > 0))


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0%}"


def pooled_p95_concurrency(pool: float, mean: float | None, p95: float | None) -> int | None:
    """The most residents whose *total* footprint stays within the pool at its 95th percentile.

    pool / p95 sizes as if every resident held a p95-sized request at once; but residents' sizes are
    independent, so their total has mean N x mean and spread sqrt(N) x sigma, and its p95 is about
    N x mean + 1.645 sqrt(N) sigma. With p95 ~ mean + 1.645 sigma for one request, that is
    N x mean + sqrt(N) x (p95 - mean). One resident gives pool / p95 exactly; many move towards pool / mean
    as their sizes average out. (Still on the safe side: residents are part-way through their generation.)
    None without both figures; at least 1.
    """
    if not mean or not p95 or mean <= 0:
        return None
    spread = max(p95 - mean, 0.0)
    root = (-spread + math.sqrt(spread * spread + 4 * mean * pool)) / (2 * mean)
    count = max(1, math.floor(root * root))
    while count > 1 and count * mean + math.sqrt(count) * spread > pool:
        count -= 1
    while (count + 1) * mean + math.sqrt(count + 1) * spread <= pool:
        count += 1
    return count


def diagnose(window: Window, engine: EngineView) -> Diagnosis:
    if not window.samples:
        return no_data("no sample in the window")
    causes = preemption_causes(window)
    preemptions = kv_pressure_of(window.increase(m.PREEMPTIONS), causes)
    preemption_rate = (
        preemptions / window.duration if preemptions is not None and window.duration > 0 else None
    )
    generated = window.increase(m.GENERATION_TOKENS)
    prompt = window.increase(m.PROMPT_TOKENS)
    running_max = window.gauge_max(m.RUNNING)
    waiting_max = window.gauge_max(m.WAITING)
    traffic = any(v for v in (generated, prompt, running_max, waiting_max))
    hit_rate, hit_source = prefix_hit_rate(window)
    prompt_len = distribution(window, m.REQUEST_PROMPT_TOKENS)
    generation_len = distribution(window, m.REQUEST_GENERATION_TOKENS)
    footprints: tuple[float | None, float | None, float | None] = (None, None, None)
    if prompt_len is not None and generation_len is not None:
        footprints = (
            prompt_len.p50 + generation_len.p50,
            prompt_len.p95 + generation_len.p95,
            prompt_len.p99 + generation_len.p99,
        )
    footprint_mean = None
    if prompt_len is not None and generation_len is not None and prompt_len.mean and generation_len.mean:
        footprint_mean = prompt_len.mean + generation_len.mean
    pool = engine.pool_tokens
    ceiling = mean_sized = None
    if pool and footprints[1]:
        ceiling = max(1, math.floor(pool / footprints[1]))
    if pool and footprint_mean:
        mean_sized = max(1, math.floor(pool / footprint_mean))
    pooled = pooled_p95_concurrency(pool, footprint_mean, footprints[1]) if pool else None
    boot_line = pool / engine.max_model_len if pool and engine.max_model_len else None
    capacity = window.gauge_mean(f"{m.WAITING_BY_REASON}:capacity")
    diagnosis = Diagnosis(
        status="active" if traffic else "idle",
        window_seconds=window.duration,
        samples=len(window.samples),
        restarts=window.restarts(),
        preemptions=preemptions,
        preemption_rate=preemption_rate,
        preemptions_by_reason=() if causes is None else causes.by_reason,
        other_preemptions=None if causes is None else causes.other,
        preempted_requests=window_preempted_requests(window),
        kv_usage_mean=window.gauge_mean(m.KV_USAGE),
        kv_usage_max=window.gauge_max(m.KV_USAGE),
        prefix_hit_rate=hit_rate,
        prefix_hit_rate_source=hit_source,
        running_mean=window.gauge_mean(m.RUNNING),
        running_max=running_max,
        waiting_mean=window.gauge_mean(m.WAITING),
        waiting_max=waiting_max,
        waiting_for_capacity=capacity,
        goodput=window.rate(m.GENERATION_TOKENS),
        prompt_len=prompt_len,
        generation_len=generation_len,
        declared_max_tokens=distribution(window, m.REQUEST_MAX_TOKENS),
        footprint_p50=footprints[0],
        footprint_p95=footprints[1],
        footprint_p99=footprints[2],
        footprint_mean=footprint_mean,
        real_concurrency_ceiling=ceiling,
        mean_footprint_concurrency=mean_sized,
        pooled_p95_concurrency=pooled,
        boot_line_concurrency=boot_line,
        prompt_tokens=prompt,
        prefix_defeats=moved(window, m.PREFIX_DEFEATS),
        prefix_defeat_tokens=moved(window, m.PREFIX_DEFEAT_TOKENS),
        capped_requests=moved(window, m.CAPPED_REQUESTS),
        corrupt=tuple(sorted({pair for sample in window.samples for pair in sample.corrupt})),
    )
    return _with_findings(diagnosis, window, engine)


def _with_findings(d: Diagnosis, window: Window, engine: EngineView) -> Diagnosis:
    findings: list[Finding] = []
    span = f"over {d.window_seconds:.0f} s ({d.samples} samples)"
    if d.samples < 2:
        findings.append(
            Finding("ShortWindow", "info", "one sample: rates need two", "take two or more samples")
        )
    if d.restarts:
        findings.append(
            Finding(
                "EngineRestarted",
                "info",
                f"counters reset {d.restarts}x in the window (engine restart); rates count from zero",
                span,
            )
        )
    alternations = anomalies(window.samples)
    if alternations:
        findings.append(
            Finding(
                "AlternatingSource",
                "critical",
                f"{ALTERNATING_HINT}: its rates are flips between processes, not work, and nothing is sized "
                "from them",
                "; ".join(dict.fromkeys(alternations)),
            )
        )
    corrupt = d.corrupt
    if corrupt:
        series = sorted({name for name, _ in corrupt})
        findings.append(
            Finding(
                "CorruptMetrics",
                "warning",
                f"corrupt metrics, dropped and never used as figures: {', '.join(series)}",
                "; ".join(f"{name}: {problem}" for name, problem in corrupt),
            )
        )
    if d.status == "idle":
        findings.append(Finding("Idle", "info", "no traffic in the window", span))
    causes = None if d.other_preemptions is None else PreemptionCauses.of(d.preemptions_by_reason)
    detail = "" if causes is None else f"; {causes_text(causes)}"
    if d.preempted_requests is not None:
        detail += f"; {spread_text(d.preempted_requests)}"
    if d.preempting:
        kind, counted = (
            ("", "num_preemptions") if causes is None else (" for lack of KV blocks", "KV-pressure")
        )
        findings.append(
            Finding(
                "Preempting",
                "critical",
                f"{d.preemption_rate:.2f} preemptions/s{kind}: prompts are paid for twice",
                f"{counted} +{d.preemptions:.0f} {span}; KV usage max {_pct(d.kv_usage_max)}{detail}",
            )
        )
    elif d.preemption_rate is None and (window.gauge_max(m.RETRACTED_NOW) or 0) > 0:
        findings.append(
            Finding(
                "Preempting", "critical", "the engine is retracting requests", "sglang:num_retracted_reqs > 0"
            )
        )
    if d.other_preemptions:
        findings.append(
            Finding(
                "PreemptedForOtherReasons",
                "warning",
                f"{d.other_preemptions:.0f} preemptions not caused by a full KV cache: reported only, fewer "
                "residents would not prevent them",
                f"num_preemptions_by_reason {span}{detail}",
            )
        )
    if d.saturated:
        findings.append(
            Finding(
                "KVSaturated",
                "warning",
                f"KV cache {_pct(d.kv_usage_max)} full while requests wait",
                f"KV usage mean {_pct(d.kv_usage_mean)}, max {_pct(d.kv_usage_max)}; "
                f"waiting mean {d.waiting_mean or 0:.1f} {span}",
            )
        )
    if (d.waiting_mean or 0) > 0:
        reason = "" if d.waiting_for_capacity is None else f" ({d.waiting_for_capacity:.1f} for capacity)"
        findings.append(
            Finding(
                "Waiting",
                "info",
                f"{d.waiting_mean:.1f} requests waiting on average{reason}",
                f"num_requests_waiting max {d.waiting_max or 0:.0f} {span}",
            )
        )
    if d.real_concurrency_ceiling is not None and d.footprint_p95 is not None:
        boot = "n/a" if d.boot_line_concurrency is None else f"{d.boot_line_concurrency:.2f}x"
        findings.append(
            Finding(
                "ConcurrencyCeiling",
                "info",
                f"real concurrency ceiling {d.real_concurrency_ceiling} (boot line says {boot}, "
                f"which assumes max_model_len {engine.max_model_len} per request)",
                f"KV pool {engine.pool_tokens:,} tokens / p95 footprint {d.footprint_p95:,.0f} tokens "
                f"(prompt p95 + generation p95, an upper bound)",
            )
        )
    return Diagnosis(**{**d.__dict__, "findings": tuple(findings)})


@dataclass(frozen=True)
class PreemptedRequests:
    """Requests that finished over a span, by the times each was preempted (`vllm:request_num_preemptions`).

    `preempted` (at least once) is None where the buckets cannot tell: vLLM's first bucket holds 0 and 1
    together, so it comes from the histogram's sum, which is exact only while no request went past the last
    bucket that holds a single count (5 in vLLM's layout)."""

    finished: float
    preemptions: float  # preemptions those requests went through (the histogram's sum)
    more_than_once: float
    preempted: float | None
    beyond: float  # requests preempted more often than the last single-count bucket resolves
    beyond_bound: float | None  # that bucket's count (5 in vLLM's layout); None when none is resolved past 1


def _at_most(buckets: tuple[tuple[float, float], ...], times: int) -> float | None:
    """Requests preempted at most `times` times: the cumulative count of a bound in [times, times + 1)."""
    for bound, cumulative in buckets:
        if times <= bound < times + 1:
            return cumulative
    return None


def preempted_requests(histogram: Histogram) -> PreemptedRequests | None:
    """The spread of `histogram` over requests; None without a bucket that ends at one preemption."""
    buckets = histogram.buckets
    at_most_once = _at_most(buckets, 1)
    if at_most_once is None:
        return None
    count = histogram.count
    more_than_once = max(count - at_most_once, 0.0)
    # Counts 2, 3, ... resolved one by one, while consecutive bounds are whole numbers.
    resolved, times, weighted, below = None, 2, 0.0, at_most_once
    while (at_most := _at_most(buckets, times)) is not None:
        weighted += times * (at_most - below)
        resolved, below, times = times, at_most, times + 1
    beyond = max(count - below, 0.0)
    never = _at_most(buckets, 0)
    preempted: float | None = None
    if never is not None:
        preempted = max(count - never, 0.0)
    elif beyond == 0:
        once = histogram.total - weighted
        preempted = more_than_once + once if once >= 0 and math.isfinite(once) else None
    return PreemptedRequests(count, histogram.total, more_than_once, preempted, beyond,
                             None if resolved is None else float(resolved))  # fmt: skip


def window_preempted_requests(window: Window) -> PreemptedRequests | None:
    """The spread over the requests that finished in the window; None where the engine has no histogram."""
    delta = window.histogram_delta(m.REQUEST_PREEMPTIONS)
    return None if delta is None else preempted_requests(delta)


@dataclass(frozen=True)
class PreemptionCauses:
    """The window's preemptions by the reason the engine gave (reasons that moved only)."""

    by_reason: tuple[tuple[str, float], ...]
    other: float  # preemptions no lack of KV blocks caused: reported, never remedied by fewer residents
    unknown: tuple[str, ...]  # reasons kvtune does not know, counted as KV pressure

    @staticmethod
    def of(moved: tuple[tuple[str, float], ...]) -> PreemptionCauses:
        """The causes of (reason, preemptions) pairs that moved: which are not KV pressure, which unknown."""
        other = sum(count for reason, count in moved if reason in NOT_KV_PRESSURE_REASONS)
        known = KV_PRESSURE_REASONS | NOT_KV_PRESSURE_REASONS
        return PreemptionCauses(moved, other, tuple(reason for reason, _ in moved if reason not in known))


def preemption_causes(window: Window) -> PreemptionCauses | None:
    """Why the window's preemptions happened; None where the engine gives no reason (every vLLM release
    through 0.34, SGLang, kvtune serve): then every preemption is taken as KV pressure, as before."""
    grown = window.increases_with_prefix(m.PREEMPTIONS_BY_REASON)
    if not grown:
        return None
    return PreemptionCauses.of(tuple(sorted((reason, count) for reason, count in grown.items() if count > 0)))


def kv_pressure_of(total: float | None, causes: PreemptionCauses | None) -> float | None:
    """Preemptions for lack of KV blocks, what the ladder remedies: the preemption counter's increase less
    the causes the engine names as something else (all of it where it names none)."""
    if total is None or causes is None or causes.other <= 0:
        return total
    return max(total - causes.other, 0.0)  # the reasons sum to the total counter


def kv_pressure_increase(window: Window) -> float | None:
    """kv_pressure_of the window's preemption counter and causes."""
    return kv_pressure_of(window.increase(m.PREEMPTIONS), preemption_causes(window))


def spread_text(spread: PreemptedRequests) -> str:
    """`of 40 requests finished, 9 were preempted more than once (...)`, as the evidence says it."""
    preempted = "" if spread.preempted is None else f", {spread.preempted:.0f} at least once"
    beyond = ""
    if spread.beyond > 0 and spread.beyond_bound is not None:
        beyond = f", {spread.beyond:.0f} more than {spread.beyond_bound:.0f} times"
    return (
        f"of {spread.finished:.0f} requests finished, {spread.more_than_once:.0f} were preempted more than "
        f"once{preempted}{beyond} ({spread.preemptions:.0f} preemptions among them; "
        "vllm:request_num_preemptions)"
    )


def causes_text(causes: PreemptionCauses) -> str:
    """`kv_full 12, prefix_cache_reset 3`, with the reasons kvtune does not know named."""
    listed = ", ".join(f"{reason} {count:.0f}" for reason, count in causes.by_reason) or "none moved"
    unknown = (
        f"; not known to kvtune, counted as KV pressure: {', '.join(causes.unknown)}"
        if causes.unknown
        else ""
    )
    return f"by reason: {listed}{unknown}"
