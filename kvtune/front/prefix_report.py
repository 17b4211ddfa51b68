"""What the engine tells the outside about prefix-cache defeats: `GET /kvtune/prefix-report` and two series.

The detector (core.prefix_defeats) keeps only token ids and hashes. The prompt text a varying span holds is
user data, so it enters the report only when the operator opted in (`--prefix-report-text`), decoded here
from the span's token ids. The counters are read from the detector at scrape time (its `counts()` is
monotonic), so the engine thread does nothing for them between scrapes; with the detector off they are not
exported at all, so a reader cannot mistake "not watched" for "no defeats".
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import cast

from prometheus_client.metrics_core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from kvtune.contract import metrics as m
from kvtune.contract.prefix_report import PrefixReport
from kvtune.core.prefix_defeats import PrefixDefeatDetector

(DEFEATS_METRIC,) = m.series_of(m.PREFIX_DEFEATS, "kvtune")  # kvtune:prefix_defeats_total{reason}
(DEFEAT_TOKENS_METRIC,) = m.series_of(m.PREFIX_DEFEAT_TOKENS, "kvtune")  # kvtune:prefix_defeat_tokens_total


def prefix_report(
    detector: PrefixDefeatDetector | None,
    key_header: str | None,
    decode: Callable[[Sequence[int]], str] | None,
) -> PrefixReport:
    """The report's JSON: the detector's own, plus whether it runs, what prompts are grouped by, and, when
    `decode` is given (the opt-in), each example's varying span as text."""
    if detector is None:
        return {"enabled": False, "reason": "the server runs with --no-prefix-detector"}
    report = cast(PrefixReport, detector.report())
    report["enabled"] = True
    report["key"] = f"header:{key_header}" if key_header else "model"
    if decode is not None:
        for entry in report.get("reasons", {}).values():
            for example in entry.get("examples", []):
                ids = example.get("span_token_ids")
                if ids:
                    example["text"] = decode(list(ids))
    return report


class PrefixDefeatCollector(Collector):
    """`kvtune:prefix_defeats_total{reason}` and `kvtune:prefix_defeat_tokens_total{reason}` (the prompt
    tokens that would have hit the cache), every reason present from the first scrape, at 0."""

    def __init__(self, detector: PrefixDefeatDetector, labels: dict[str, str]) -> None:
        self.detector = detector
        self.label_names = [*labels, "reason"]
        self.label_values = list(labels.values())

    def collect(self) -> Iterator[Metric]:
        defeats = CounterMetricFamily(
            DEFEATS_METRIC,
            "Prompts that shared content with an earlier prompt under the same key yet missed the prefix "
            "cache, by reason.",
            labels=self.label_names,
        )
        tokens = CounterMetricFamily(
            DEFEAT_TOKENS_METRIC,
            "Prompt tokens that would have hit the prefix cache but for the defeat, by reason.",
            labels=self.label_names,
        )
        for reason, (count, lost) in self.detector.counts().items():
            defeats.add_metric([*self.label_values, reason], count)
            tokens.add_metric([*self.label_values, reason], lost)
        seconds = CounterMetricFamily(
            m.DETECTOR_SECONDS,
            "Time the prefix-defeat detector spent judging prompts (its cost to the engine).",
            labels=self.label_names[:-1],
        )
        seconds.add_metric(self.label_values, self.detector.observe_seconds)
        yield defeats
        yield tokens
        yield seconds
