"""From the operator's window of samples to the workload fit (`kvtune.core.workload_fit`): what the tuner's
predictive move and the doctor's what-if table read.

The arrival pattern, the step time and the prefix hits come from the window itself; the length
distributions from the window's histogram deltas when the window finished enough requests, else from the
engine's histograms since it started (they describe the same workload; a short tuner window alone often
holds too few finished requests to fit lengths from, and waiting for more is the slowness the prediction
removes). The pool and block size come from the engine view (cache_config_info).
"""

from __future__ import annotations

from kvtune.contract import metrics as m
from kvtune.core.bucketed_lengths import Buckets
from kvtune.core.step_time import OperatingPoint
from kvtune.core.workload_fit import (
    EngineSettings,
    FitLimits,
    FittedWorkload,
    Insufficient,
    MetricsWindow,
    Scrape,
    fit_workload,
)
from kvtune.operator.decide.sample import EngineView, Histogram, Sample
from kvtune.operator.decide.window import Window


def _finished(sample: Sample) -> float:
    return sum(v for k, v in sample.counters.items() if k.startswith(m.REQUEST_SUCCESS + ":"))


def scrape_of(sample: Sample) -> Scrape:
    c, g = sample.counters, sample.gauges
    return Scrape(
        at=sample.timestamp,
        running=g.get(m.RUNNING, 0.0),
        running_all=g.get(m.RUNNING_ALL_PODS),
        waiting=g.get(m.WAITING, 0.0),
        generated_tokens=c.get(m.GENERATION_TOKENS, 0.0),
        prompt_tokens=c.get(m.PROMPT_TOKENS, 0.0),
        finished_requests=_finished(sample),
        preemptions=c.get(m.PREEMPTIONS, 0.0),
    )


def buckets_of(histogram: Histogram | None) -> Buckets | None:
    if histogram is None or histogram.count <= 0:
        return None
    return Buckets(histogram.buckets, histogram.count, histogram.total)


def settings_of(engine: EngineView) -> EngineSettings | None:
    if not engine.pool_tokens or not engine.block_size or not engine.max_num_seqs:
        return None
    return EngineSettings(
        pool_tokens=engine.pool_tokens,
        block_size=engine.block_size,
        max_num_seqs=engine.max_num_seqs,
        max_tokens_cap=engine.max_tokens_cap,
        max_model_len=engine.max_model_len,
        cache_dtype=engine.cache_dtype or "auto",
    )


def _lengths(window: Window, name: str, enough: float) -> tuple[Buckets | None, bool]:
    """The window's delta when it holds `enough` observations, else the engine's since-start histogram
    when that holds more; True when the latter was used."""
    delta = buckets_of(window.histogram_delta(name))
    if delta is not None and delta.count >= enough:
        return delta, False
    since_start = buckets_of(window.histogram_latest(name))
    if since_start is not None and since_start.count > (delta.count if delta else 0.0):
        return since_start, True
    return delta, False


def metrics_window(window: Window, engine: EngineView, limits: FitLimits) -> tuple[MetricsWindow, bool]:
    """The plain window the fit takes, and whether its lengths are the engine's since-start histograms."""
    prompt, boot_prompt = _lengths(window, m.REQUEST_PROMPT_TOKENS, limits.few_finished)
    output, boot_output = _lengths(window, m.REQUEST_GENERATION_TOKENS, limits.few_finished)
    return (
        MetricsWindow(
            scrapes=tuple(scrape_of(s) for s in window.samples),
            prompt_len=prompt,
            output_len=output,
            settings=settings_of(engine),
            prefix_queries=window.increase(m.PREFIX_QUERIES),
            prefix_hits=window.increase(m.PREFIX_HITS),
            inter_token_latency=buckets_of(window.histogram_delta(m.INTER_TOKEN_LATENCY)),
        ),
        boot_prompt or boot_output,
    )


def fit_from_window(
    window: Window,
    engine: EngineView,
    earlier_points: tuple[OperatingPoint, ...] = (),
    limits: FitLimits | None = None,
) -> FittedWorkload | Insufficient:
    """The workload fit of the window (one engine process: a restart inside it is refused by the fit)."""
    limits = limits or FitLimits()
    plain, since_start = metrics_window(window, engine, limits)
    fit = fit_workload(plain, earlier_points, limits)
    if isinstance(fit, FittedWorkload) and since_start:
        count = plain.output_len.count if plain.output_len else 0.0
        note = f"lengths from the engine's histograms since it started ({count:.0f} requests)"
        fit = FittedWorkload(
            fit.prompt_len, fit.output_len, fit.arrival, fit.prefix_hit_share, fit.settings, fit.step_time,
            fit.operating_point, fit.observed, fit.footprint_relative_error, (*fit.notes, note),
        )  # fmt: skip
    return fit
