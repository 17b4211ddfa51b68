"""Windows of metrics built from known request lengths, the way an engine's histograms and counters would
record them, for the workload-fit and what-if tests."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

from kvtune.core.bucketed_lengths import Buckets
from kvtune.core.workload_fit import EngineSettings, FittedWorkload, MetricsWindow, Scrape, fit_workload


def kvtune_bounds(limit: int = 8192) -> list[float]:
    """kvtune's request-size buckets: 20 per decade, whole tokens (as the engine builds them)."""
    bounds: list[float] = []
    decade = 1
    while True:
        for i in range(20):
            value = float(int(10 ** (i / 20) * decade + 0.5))
            if value > limit:
                return bounds
            if not bounds or value > bounds[-1]:
                bounds.append(value)
        decade *= 10


VLLM_BOUNDS = [float(m * 10**e) for e in range(5) for m in (1, 2, 5)]


def histogram(values: Sequence[int], bounds: Sequence[float]) -> Buckets:
    ordered = sorted(values)
    cumulative = []
    for bound in bounds:
        cumulative.append((bound, float(sum(1 for v in ordered if v <= bound))))
    cumulative.append((math.inf, float(len(values))))
    return Buckets(tuple(cumulative), float(len(values)), float(sum(values)))


def window(
    prompts: Sequence[int],
    outputs: Sequence[int],
    *,
    pool_tokens: int = 4096,
    max_num_seqs: int = 64,
    in_system: Sequence[float] = (16,) * 13,
    running: float = 10,
    seconds: float = 12.0,
    step_seconds: float = 0.02,
    bounds: Sequence[float] | None = None,
    preemptions: float = 0,
) -> MetricsWindow:
    """A window over which `len(prompts)` requests finished, scraped once per `seconds / (n - 1)`, the
    engine running `running` requests at a step time of `step_seconds` (counters consistent with it)."""
    bounds = bounds if bounds is not None else kvtune_bounds()
    n = len(in_system)
    every = seconds / (n - 1)
    generated_per_s = running / step_seconds
    prompt_per_s = sum(prompts) / seconds
    finished_per_s = len(prompts) / seconds
    scrapes = tuple(
        Scrape(
            at=1000.0 + i * every,
            running=min(running, count),
            waiting=max(0.0, count - running),
            generated_tokens=50_000 + generated_per_s * i * every,
            prompt_tokens=90_000 + prompt_per_s * i * every,
            finished_requests=300 + finished_per_s * i * every,
            preemptions=7 + preemptions * i / (n - 1),
        )
        for i, count in enumerate(in_system)
    )
    return MetricsWindow(
        scrapes,
        histogram(prompts, bounds),
        histogram(outputs, bounds),
        EngineSettings(pool_tokens, 16, max_num_seqs),
        prefix_queries=float(sum(prompts)),
        prefix_hits=0.0,
    )


def uniform_lengths(seed: int, count: int, span: tuple[int, int]) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(*span) for _ in range(count)]


def fitted(
    prompt: tuple[int, int] = (200, 400),
    output: tuple[int, int] = (100, 200),
    *,
    count: int = 300,
    seed: int = 1,
    **kwargs: object,
) -> FittedWorkload:
    """The fit of a window of `count` requests with uniform lengths (the tuner benchmark's default)."""
    fit = fit_workload(
        window(uniform_lengths(seed, count, prompt), uniform_lengths(seed + 1, count, output), **kwargs)  # type: ignore[arg-type]
    )
    assert isinstance(fit, FittedWorkload), fit
    return fit
