"""What the benchmarks read from a server's Prometheus `/metrics`: totals per series name, parsed by
prometheus-client's text parser (the one the operator uses), and the preemption count taken from them.

vLLM and kvtune spell the preemption counter `vllm:num_preemptions_total`; exporters that rewrite colons
give `vllm_num_preemptions_total`. Either is counted (the names are `kvtune.contract.metrics`').
"""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvtune.contract import metrics as m

(PREEMPTIONS_METRIC,) = m.series_of(m.PREEMPTIONS, "vllm")
PREEMPTION_SERIES = tuple(m.spellings(PREEMPTIONS_METRIC))


def metric_totals(text: str) -> dict[str, float]:
    """Prometheus text -> {series name: sum over its label sets}."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + float(sample.value)
    return totals


async def scrape_totals(client: httpx.AsyncClient, base_url: str) -> dict[str, float] | None:
    """The server's metric totals, or None when `/metrics` is unreachable or unparsable."""
    try:
        response = await client.get(f"{base_url}/metrics")
        response.raise_for_status()
        return metric_totals(response.text)
    except (httpx.HTTPError, ValueError):
        return None


def preemptions(totals: dict[str, float]) -> float | None:
    """The cumulative preemption count, or None when the server exports no preemption counter."""
    present = [totals[name] for name in PREEMPTION_SERIES if name in totals]
    return sum(present) if present else None


def preemption_delta(before: dict[str, float] | None, after: dict[str, float] | None) -> float | None:
    """Preemptions between two scrapes; None when either scrape failed or the counter is missing at the end
    (a counter first exported during the run started from zero)."""
    if before is None or after is None:
        return None
    last = preemptions(after)
    return None if last is None else last - (preemptions(before) or 0.0)


def counter_delta(before: dict[str, float] | None, after: dict[str, float] | None, name: str) -> float | None:
    """How much one counter grew between two scrapes; None when either scrape failed or lacks it."""
    if before is None or after is None or name not in after:
        return None
    return after[name] - before.get(name, 0.0)
