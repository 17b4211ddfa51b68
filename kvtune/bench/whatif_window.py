"""From scrapes of an engine's /metrics, read with the operator's own parser, to the plain window the
workload fit takes (`kvtune.core.workload_fit.MetricsWindow`): what the operator will do in phase B.

The inter-token latency histogram is read from the raw series (the operator's name map does not carry it
yet); vLLM's 1-2-5 buckets can be had from kvtune's finer ones (kvtune's geometric series holds every 1-2-5
bound to within 0.5%), so one run shows the fit at both engines' resolutions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvtune.contract import metrics as m
from kvtune.core.bucketed_lengths import Buckets
from kvtune.core.workload_fit import EngineSettings, MetricsWindow, Scrape
from kvtune.operator.decide.fit_window import scrape_of
from kvtune.operator.decide.sample import Histogram, Sample, Series

ITL_SERIES = "vllm:inter_token_latency_seconds"
VLLM_SIZE_BOUNDS = tuple(float(mantissa * 10**exp) for exp in range(6) for mantissa in (1, 2, 5))


@dataclass(frozen=True)
class Reading:
    """One scrape: the operator's Sample and the raw series it came from."""

    sample: Sample
    series: tuple[Series, ...]


def raw_histogram(series: Sequence[Series], name: str) -> Histogram | None:
    """A histogram straight from raw series (summed over label sets)."""
    per: dict[float, float] = {}
    count = total = 0.0
    for exposed, labels, value in series:
        if exposed == f"{name}_bucket":
            bound = float(labels.get("le", "inf"))
            per[bound] = per.get(bound, 0.0) + value
        elif exposed == f"{name}_count":
            count += value
        elif exposed == f"{name}_sum":
            total += value
    if not per:
        return None
    return Histogram(tuple(sorted(per.items())), count, total)


def delta(before: Histogram | None, after: Histogram | None) -> Buckets | None:
    """What landed in a histogram between two scrapes of one process."""
    if before is None or after is None:
        return None
    earlier = dict(before.buckets)
    cumulative = tuple((bound, count - earlier.get(bound, 0.0)) for bound, count in after.buckets)
    return Buckets(cumulative, after.count - before.count, after.total - before.total)


def coarsen(buckets: Buckets | None, bounds: Sequence[float] = VLLM_SIZE_BOUNDS) -> Buckets | None:
    """The same observations in vLLM's fewer buckets: each coarse bound read at the fine bound nearest to
    it, which lies within 0.5% (kvtune's 500 is 501, its 2000 is 1995): well inside a 1-2-5 bucket."""
    if buckets is None:
        return None
    fine = dict(buckets.cumulative)
    top = max(k for k in fine if math.isfinite(k))
    kept = []
    for bound in bounds:
        if bound > top:
            break
        nearest = min(fine, key=lambda k: abs(k - bound))
        if abs(nearest - bound) > 0.01 * bound:
            raise ValueError(f"the fine histogram has no bound near {bound:g}: it cannot be coarsened")
        kept.append((bound, fine[nearest]))
    return replace(buckets, cumulative=(*kept, (math.inf, fine[math.inf])))


def settings_of(sample: Sample) -> EngineSettings | None:
    """The pool and block size from cache_config_info, max_num_seqs and the cap from kvtune's gauges."""
    config = sample.cache_config
    try:
        pool = int(config["kv_cache_size_tokens"])
        block = int(config["block_size"])
    except (KeyError, ValueError):
        return None
    cap = int(sample.gauges.get(m.MAX_TOKENS_CAP, 0.0))
    return EngineSettings(
        pool_tokens=pool,
        block_size=block,
        max_num_seqs=int(sample.gauges.get(m.MAX_NUM_SEQS, 0.0)),
        max_tokens_cap=cap or None,
        cache_dtype=config.get("cache_dtype", "auto"),
    )


def metrics_window(readings: Sequence[Reading], vllm_buckets: bool = False) -> MetricsWindow:
    """The window from the first reading to the last."""
    first, last = readings[0].sample, readings[-1].sample
    prompt = delta(
        first.histograms.get(m.REQUEST_PROMPT_TOKENS), last.histograms.get(m.REQUEST_PROMPT_TOKENS)
    )
    output = delta(
        first.histograms.get(m.REQUEST_GENERATION_TOKENS), last.histograms.get(m.REQUEST_GENERATION_TOKENS)
    )
    if vllm_buckets:
        prompt, output = coarsen(prompt), coarsen(output)
    queries = last.counters.get(m.PREFIX_QUERIES, 0.0) - first.counters.get(m.PREFIX_QUERIES, 0.0)
    hits = last.counters.get(m.PREFIX_HITS, 0.0) - first.counters.get(m.PREFIX_HITS, 0.0)
    itl = delta(raw_histogram(readings[0].series, ITL_SERIES), raw_histogram(readings[-1].series, ITL_SERIES))
    return MetricsWindow(
        scrapes=tuple(scrape_of(r.sample) for r in readings),
        prompt_len=prompt,
        output_len=output,
        settings=settings_of(last),
        prefix_queries=queries,
        prefix_hits=hits,
        inter_token_latency=itl,
    )


def window_from_json(data: dict[str, Any]) -> MetricsWindow:
    """A window stored with `dataclasses.asdict` (a benchmark's result file) read back."""

    def buckets(value: dict[str, Any] | None) -> Buckets | None:
        if value is None:
            return None
        pairs = tuple((float(bound), float(count)) for bound, count in value["cumulative"])
        return Buckets(pairs, float(value["count"]), float(value["total"]))

    settings = data["settings"]
    return MetricsWindow(
        scrapes=tuple(Scrape(**s) for s in data["scrapes"]),
        prompt_len=buckets(data["prompt_len"]),
        output_len=buckets(data["output_len"]),
        settings=EngineSettings(**settings) if settings is not None else None,
        prefix_queries=data["prefix_queries"],
        prefix_hits=data["prefix_hits"],
        inter_token_latency=buckets(data["inter_token_latency"]),
    )
