"""What newer vLLMs add to the preemption count: how the preemptions spread over requests (one request
preempted five times is not five requests preempted once) and why they happened (only KV pressure is
what fewer residents relieve). Pure: a window or a histogram in, figures out; None where the engine does not
say (older vLLMs, SGLang), so their diagnosis stays what it was. See kvtune.contract.preemptions."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvtune.contract import metrics as m
from kvtune.contract.preemptions import KV_PRESSURE_REASONS, NOT_KV_PRESSURE_REASONS
from kvtune.operator.decide.sample import Histogram
from kvtune.operator.decide.window import Window


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
