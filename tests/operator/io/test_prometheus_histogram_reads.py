"""Reading Prometheus by pod without the histograms between two reads of them (issue 38: most of a pod's
series are buckets): the lighter query asks for no histogram part, and a pod the pooling has not seen is
read whole at once, so its histograms' baseline is never missed."""

from __future__ import annotations

from typing import Any

from kvtune.contract import metrics as m
from kvtune.operator.decide.sample import Sample
from kvtune.operator.io.prometheus_batch import InstantBatcher
from kvtune.operator.io.sources import PrometheusSource

SELECTOR = '{namespace="llama",pod=~"engines-.+"}'


def series(pod: str) -> list[dict[str, Any]]:
    """One vLLM pod's series as Prometheus answers them: gauges, a counter and a histogram's parts."""
    labels = {"namespace": "llama", "pod": pod}
    plain = [("vllm:num_requests_running", {}, "3"), ("vllm:num_preemptions_total", {}, "7"),
             ("process_start_time_seconds", {}, "100")]  # fmt: skip
    parts = [("vllm:request_generation_tokens_bucket", {"le": le}, count) for le, count in
             (("128", "2"), ("1024", "5"), ("+Inf", "6"))]  # fmt: skip
    parts += [
        ("vllm:request_generation_tokens_sum", {}, "900"),
        ("vllm:request_generation_tokens_count", {}, "6"),
    ]
    return [{"metric": {"__name__": name, **labels, **extra}, "value": [1000.0, value]}
            for name, extra, value in [*plain, *parts]]  # fmt: skip


class FakePrometheus:
    """Answers like Prometheus: the series of `pods` whose metric name the query's name regex asks for."""

    def __init__(self, pods: list[str]) -> None:
        self.pods = pods
        self.queries: list[str] = []

    def send(self, url: str, query: str, timeout: float) -> dict[str, Any]:
        self.queries.append(query)
        asked = set(query.split('__name__=~"', 1)[1].split('"', 1)[0].split("|"))
        found = [item for pod in self.pods for item in series(pod) if item["metric"]["__name__"] in asked]
        return {"resultType": "vector", "result": found}


def read(prometheus: FakePrometheus, histograms: bool, known: set[str]) -> dict[str, Sample]:
    batcher = InstantBatcher("http://prometheus", send=prometheus.send, sleep=lambda _: None)
    source = PrometheusSource("http://prometheus", SELECTOR, batcher=batcher, histograms=histograms,
                              known_pods=frozenset(known))  # fmt: skip
    found = source.read_pods()
    assert isinstance(found, dict)
    return {pod: sample for pod, sample in found.items() if isinstance(sample, Sample)}


def test_the_lighter_query_asks_for_no_histogram_part_and_the_full_one_for_all() -> None:
    light = PrometheusSource("http://prometheus", SELECTOR).query(histograms=False)
    full = PrometheusSource("http://prometheus", SELECTOR).query()
    assert "_bucket" not in light and "_count" not in light and "request_generation_tokens" not in light
    assert "vllm:request_generation_tokens_bucket" in full and "vllm:num_requests_running" in light


def test_known_pods_are_read_without_histograms_and_keep_every_other_figure() -> None:
    prometheus = FakePrometheus(["engines-a", "engines-b"])
    samples = read(prometheus, histograms=False, known={"engines-a", "engines-b"})
    assert len(prometheus.queries) == 1 and "_bucket" not in prometheus.queries[0]
    assert set(samples) == {"engines-a", "engines-b"}
    for sample in samples.values():
        assert sample.histograms == {}
        assert sample.counters[m.PREEMPTIONS] == 7 and sample.gauges[m.RUNNING] == 3


def test_a_pod_not_seen_before_has_everything_read_at_once() -> None:
    prometheus = FakePrometheus(["engines-a", "engines-new"])
    samples = read(prometheus, histograms=False, known={"engines-a"})
    assert len(prometheus.queries) == 2 and "_bucket" in prometheus.queries[1]
    assert all(m.REQUEST_GENERATION_TOKENS in sample.histograms for sample in samples.values())
    assert samples["engines-new"].histograms[m.REQUEST_GENERATION_TOKENS].count == 6
