"""The live workload, fitted from one window of an engine's metrics: what the what-if model replays.

From plain values any engine exports (vLLM's names; kvtune and SGLang map onto them): the prompt- and
output-length histograms' bucket deltas give the length distributions; the running and waiting gauges and
the request counters give the arrival pattern (a closed loop of N clients holds N requests in the engine
whatever it does; an open loop's count swings like a Poisson count); the prefix-cache counters the hit
share; `vllm:cache_config_info` the pool and the block size; the token counters and the running gauge one
operating point of the step-time model.

The fit says what it could not see instead of guessing: too few finished requests, too short a window, a
restart inside it, no pool size — `Insufficient`, with every reason. A fit that stands but leans on coarse
buckets, a small sample or an assumed step-time split says so in its `notes` and its `confidence`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise

from kvtune.core.bucketed_lengths import BucketedLengths, Buckets
from kvtune.core.step_time import OperatingPoint, StepTimeModel, fit_step_time


@dataclass(frozen=True)
class Scrape:
    """One reading of an engine: gauges now, counters cumulative (as exposed)."""

    at: float  # seconds (any epoch, the same for every scrape of a window)
    running: float
    waiting: float
    generated_tokens: float
    prompt_tokens: float
    finished_requests: float
    preemptions: float
    # running on every pod of a pooled reading (`running` is then the busiest pod's, which the step is
    # timed by); the arrival is judged on the whole workload's requests. None: one engine
    running_all: float | None = None


@dataclass(frozen=True)
class EngineSettings:
    """What the engine runs with: the pool and block size from cache_config_info, the rest from the
    engine's own gauges (kvtune) or its arguments (vLLM)."""

    pool_tokens: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int = 8192
    max_tokens_cap: int | None = None
    max_model_len: int | None = None
    cache_dtype: str = "auto"


@dataclass(frozen=True)
class MetricsWindow:
    """Everything the fit reads, from one engine process over one window (the caller never mixes
    processes: a restart inside the window is refused)."""

    scrapes: tuple[Scrape, ...]
    prompt_len: Buckets | None  # vllm:request_prompt_tokens, the window's delta
    output_len: Buckets | None  # vllm:request_generation_tokens, the window's delta
    settings: EngineSettings | None
    prefix_queries: float | None = None  # increase of vllm:prefix_cache_queries (tokens)
    prefix_hits: float | None = None
    inter_token_latency: Buckets | None = None  # vllm:inter_token_latency_seconds delta: a step's seconds


@dataclass(frozen=True)
class FitLimits:
    """Below these a window is not evidence enough; between `min_finished` and `few_finished` it is, with
    a note."""

    min_finished: float = 20
    few_finished: float = 100
    min_scrapes: int = 3
    min_seconds: float = 5.0
    coarse_resolution: float = 0.35  # buckets wider than this (share-weighted, relative) are coarse
    # in-system count steadier than this × √mean is a closed loop (a Poisson count swings by √mean)
    closed_loop_swing: float = 0.5


@dataclass(frozen=True)
class Arrival:
    """Closed loop (`clients` each sending one request after another) or open loop (`rate` per second)."""

    clients: int | None
    rate_per_s: float | None
    evidence: str

    @property
    def closed(self) -> bool:
        return self.clients is not None

    def describe(self) -> str:
        if self.clients is not None:
            return f"closed loop, {self.clients} clients"
        return f"open loop, {self.rate_per_s or 0:.2f} requests/s"


@dataclass(frozen=True)
class Observed:
    """The window's own figures, the yardstick the what-if run of the current setting is checked by."""

    seconds: float
    finished: float
    goodput: float  # generated tokens per second
    preemptions_per_min: float
    running_mean: float
    waiting_mean: float
    steps_per_s: float


@dataclass(frozen=True)
class Insufficient:
    """No fit: the window cannot support one, and why."""

    reasons: tuple[str, ...]

    def __str__(self) -> str:
        return "insufficient data: " + "; ".join(self.reasons)


@dataclass(frozen=True)
class FittedWorkload:
    prompt_len: BucketedLengths
    output_len: BucketedLengths
    arrival: Arrival
    prefix_hit_share: float
    settings: EngineSettings
    step_time: StepTimeModel
    operating_point: OperatingPoint
    observed: Observed
    footprint_relative_error: float  # standard error of the mean full footprint, relative
    notes: tuple[str, ...] = field(default=())

    @property
    def confidence(self) -> str:
        """`high` when nothing in `notes` qualifies the fit, else `low`."""
        return "low" if self.notes else "high"

    @property
    def mean_footprint(self) -> float:
        return self.prompt_len.observed_mean + self.output_len.observed_mean

    def summary(self) -> str:
        """The fitted workload in one line (the doctor prints it above its what-if table)."""
        return (
            f"{self.arrival.describe()}; prompts {self.prompt_len.describe()}, outputs "
            f"{self.output_len.describe()} tokens over {self.observed.finished:.0f} requests; prefix hits "
            f"{self.prefix_hit_share:.0%}; pool {self.settings.pool_tokens:,} tokens in blocks of "
            f"{self.settings.block_size} (÷ mean footprint {self.settings.pool_tokens / self.mean_footprint:.1f}); "
            f"step {self.operating_point.step_seconds * 1e3:.1f} ms at batch {self.operating_point.batch:.1f}; "
            f"confidence {self.confidence}" + (f" ({'; '.join(self.notes)})" if self.notes else "")
        )


def _steady(counts: Sequence[float], limits: FitLimits) -> bool:
    """A closed loop's in-system count: steadier than a Poisson count of the same mean swings."""
    mean = sum(counts) / len(counts)
    swing = math.sqrt(sum((n - mean) ** 2 for n in counts) / len(counts))
    return swing <= limits.closed_loop_swing * math.sqrt(max(mean, 1.0))


def _median(counts: Sequence[float]) -> float:
    return sorted(counts)[len(counts) // 2]


def _stepped_level(counts: Sequence[float], limits: FitLimits) -> tuple[float, float, int] | None:
    """A closed loop whose clients changed inside the window: the count steady before some scrape and steady
    again, at another level, from it on (the split with the least swing around its two levels). Its levels
    before and after, and the scrapes after; None when no split leaves two steady stretches."""
    best: tuple[float, int] | None = None
    for split in range(2, len(counts) - 1):  # two scrapes at least on each side
        parts = (counts[:split], counts[split:])
        if not all(_steady(part, limits) for part in parts):
            continue
        spread = sum((n - sum(part) / len(part)) ** 2 for part in parts for n in part)
        if best is None or spread < best[0]:
            best = (spread, split)
    if best is None:
        return None
    before, after = _median(counts[: best[1]]), _median(counts[best[1] :])
    return (before, after, len(counts) - best[1]) if before != after else None


def _arrival(scrapes: Sequence[Scrape], seconds: float, finished: float, limits: FitLimits) -> Arrival:
    in_system = [(s.running if s.running_all is None else s.running_all) + s.waiting for s in scrapes]
    mean = sum(in_system) / len(in_system)
    swing = math.sqrt(sum((n - mean) ** 2 for n in in_system) / len(in_system))
    evidence = (
        f"requests in the engine {min(in_system):.0f}-{max(in_system):.0f} (mean {mean:.1f}, sd {swing:.1f})"
    )
    if _steady(in_system, limits):
        return Arrival(max(1, round(_median(in_system))), None, evidence + ": steady, a closed loop")
    # a closed loop that stepped reads as a swing over the whole window: its current clients are the later
    # level, once it held for a few scrapes (a change in the last scrapes is the next window's to read)
    stepped = _stepped_level(in_system, limits)
    if stepped is not None:
        before, after, held = stepped
        level = after if held >= limits.min_scrapes else before
        return Arrival(max(1, round(level)), None,
                       evidence + f": steady at {before:.0f}, then at {after:.0f}, a closed loop that changed")  # fmt: skip
    grown = in_system[-1] - in_system[0]
    rate = max(0.0, (finished + grown) / seconds)
    return Arrival(None, rate, evidence + ": swinging, an open loop")


def operating_point(
    scrapes: Sequence[Scrape],
    mean_prompt: float,
    mean_output: float,
    prefix_hit_share: float,
    inter_token_latency: Buckets | None,
) -> OperatingPoint | None:
    """The window's mean step. Steps are counted as generated tokens ÷ mean running requests (each running
    request samples one token per step); a step's seconds are the mean inter-token latency when there is
    one, else the span ÷ steps (the engine is busy throughout: a request was running at every scrape).
    Prompt tokens computed = the prompt counter less prefix hits, plus the recompute each preemption costs
    (a victim's prompt and half its output, on average)."""
    first, last = scrapes[0], scrapes[-1]
    seconds = last.at - first.at
    generated = last.generated_tokens - first.generated_tokens
    running = sum(s.running for s in scrapes) / len(scrapes)
    if generated <= 0 or running <= 0 or seconds <= 0:
        return None
    steps = generated / running
    recompute = (last.preemptions - first.preemptions) * (mean_prompt + mean_output / 2)
    prefill = (last.prompt_tokens - first.prompt_tokens) * (1.0 - prefix_hit_share) + recompute
    if inter_token_latency is not None and inter_token_latency.count > 0:
        step_seconds = inter_token_latency.total / inter_token_latency.count
    elif min(s.running for s in scrapes) > 0:
        step_seconds = seconds / steps
    else:
        return None
    return OperatingPoint(running, prefill / steps, step_seconds)


def fit_workload(
    window: MetricsWindow,
    earlier_points: Sequence[OperatingPoint] = (),
    limits: FitLimits | None = None,
) -> FittedWorkload | Insufficient:
    """Fit the window. `earlier_points`: operating points of earlier windows of the same engine at other
    settings (a tuner's previous windows), which pin down the step-time split one window cannot."""
    limits = limits or FitLimits()
    reasons: list[str] = []
    scrapes = tuple(sorted(window.scrapes, key=lambda s: s.at))
    settings = window.settings
    if len(scrapes) < limits.min_scrapes:
        reasons.append(f"{len(scrapes)} scrapes in the window, at least {limits.min_scrapes} needed")
    seconds = scrapes[-1].at - scrapes[0].at if scrapes else 0.0
    if seconds < limits.min_seconds:
        reasons.append(f"the window spans {seconds:.1f} s, at least {limits.min_seconds:g} s needed")
    for before, after in pairwise(scrapes):
        counters = ("generated_tokens", "prompt_tokens", "finished_requests", "preemptions")
        if any(getattr(after, c) < getattr(before, c) for c in counters):
            reasons.append(
                "a counter fell inside the window: the engine restarted; fit one process at a time"
            )
            break
    # the window's own finished requests time its arrivals; the lengths may come from more (the engine's
    # histograms since it started), which sizes the fit's sample, never its rate
    finished = scrapes[-1].finished_requests - scrapes[0].finished_requests if scrapes else 0.0
    if window.output_len is not None and finished <= 0:
        finished = window.output_len.count  # no finished-requests counter moved: the lengths' own count
    sample_size = max(finished, window.output_len.count if window.output_len is not None else 0.0)
    if sample_size < limits.min_finished:
        reasons.append(
            f"{sample_size:.0f} requests finished in the window, at least {limits.min_finished:g} needed"
        )
    upper = float(settings.max_model_len) if settings and settings.max_model_len else None
    prompt = BucketedLengths.fit(window.prompt_len, upper) if window.prompt_len else None
    output = BucketedLengths.fit(window.output_len, upper) if window.output_len else None
    if prompt is None:
        reasons.append("no prompt-length histogram observations (vllm:request_prompt_tokens)")
    if output is None:
        reasons.append("no output-length histogram observations (vllm:request_generation_tokens)")
    if settings is None or settings.pool_tokens <= 0 or settings.block_size <= 0:
        reasons.append("the pool size or block size is unknown (vllm:cache_config_info)")
    if reasons or prompt is None or output is None or settings is None:
        return Insufficient(tuple(reasons))
    hit_share = 0.0
    if window.prefix_queries and window.prefix_hits is not None:
        hit_share = min(1.0, max(0.0, window.prefix_hits / window.prefix_queries))
    point = operating_point(scrapes, prompt.observed_mean, output.observed_mean, hit_share,
                            window.inter_token_latency)  # fmt: skip
    if point is None:
        return Insufficient(("no step could be timed: nothing was generated, or the engine sat idle with no "
                             "inter-token latency histogram to time its steps",))  # fmt: skip
    step_time = fit_step_time([point, *earlier_points])
    assert step_time is not None  # `point` is usable
    notes: list[str] = []
    if sample_size < limits.few_finished:
        notes.append(f"only {sample_size:.0f} finished requests")
    for name, lengths in (("prompt", prompt), ("output", output)):
        if lengths.resolution > limits.coarse_resolution:
            notes.append(f"{name} buckets coarse (±{lengths.resolution / 2:.0%} of a length)")
        if lengths.open_top:
            notes.append(f"{name} lengths above the last finite bucket: the top is assumed")
        if not lengths.mean_matched:
            notes.append(f"the {name} histogram's sum does not fit its buckets")
    if "prior" in step_time.basis:
        notes.append("step-time split from the prior (no operating point at another batch size yet)")
    arrival = _arrival(scrapes, seconds, finished, limits)
    variance = prompt.variance() + output.variance()
    relative_error = math.sqrt(variance / sample_size) / (prompt.observed_mean + output.observed_mean)
    first, last = scrapes[0], scrapes[-1]
    observed = Observed(
        seconds=seconds,
        finished=sample_size,
        goodput=(last.generated_tokens - first.generated_tokens) / seconds,
        preemptions_per_min=(last.preemptions - first.preemptions) / seconds * 60,
        running_mean=point.batch,
        waiting_mean=sum(s.waiting for s in scrapes) / len(scrapes),
        steps_per_s=(last.generated_tokens - first.generated_tokens) / point.batch / seconds,
    )
    return FittedWorkload(prompt, output, arrival, hit_share, settings, step_time, point, observed,
                          relative_error, tuple(notes))  # fmt: skip
