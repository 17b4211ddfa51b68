"""Where samples come from: an engine's own `/metrics` (merged with the `/metrics` of a kvtune proxy in
front of it, when there is one), or a Prometheus HTTP API with a label selector.

Every failure (unreachable, HTTP error, unparsable body, no known series) becomes `NoData`; nothing raises
out of `read()`, because a missing source must never turn into an action.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvtune.contract.metrics import (
    ENGINE_MATCHERS,
    PROCESS_SERIES,
    PROCESS_START,
    Kind,
    lookup,
    read_names,
)
from kvtune.operator.decide.sample import (
    NoData,
    Sample,
    SampleResult,
    Series,
    identity_of,
    sample_from_series,
)
from kvtune.operator.io.http import shared_client
from kvtune.operator.io.prometheus_batch import InstantBatcher

Clock = Callable[[], float]
PROXY = "proxy"  # the proxy's part of an EngineWithProxy sample's identity
PROXY_START_SERIES = "process_start_time_seconds"
# the names the sample reads, exactly (a regular expression of alternatives): a vLLM pod's 431 series
# are 109 of them
READ_NAMES = "|".join(re.escape(name).replace("\\:", ":") for name in read_names())
# the same without the histograms' parts: most of a pod's series are buckets (a vLLM pod's 60 of 95)
PLAIN_NAMES = "|".join(
    re.escape(name).replace("\\:", ":")
    for name in read_names()
    if (found := lookup(name)) is None or found[0].kind is not Kind.HISTOGRAM
)
MAX_RANGE_POINTS = 240  # a range query's points per series: enough for rates, small enough to answer fast


def exposition_series(text: str) -> list[Series]:
    """The samples of a Prometheus text exposition (0.0.4 or OpenMetrics); ValueError when it does not
    parse."""
    return [
        (sample.name, sample.labels, float(sample.value))
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if not sample.name.endswith("_created")
    ]


def url_problem(url: str) -> str | None:
    """Why `url` cannot be an HTTP(S) base URL (checked before any request, so a typo is one clear line
    instead of a traceback), or None when it can."""
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, ValueError, TypeError) as err:
        return f"{url!r} is not a valid URL: {err}"
    if parsed.scheme not in ("http", "https"):
        return f"{url!r} is not an http:// or https:// URL"
    if not parsed.host:
        return f"{url!r} has no host"
    return None


class MetricsEndpoint:
    """Scrape one engine's `/metrics` directly (the URL may be the server base or the full path)."""

    proxy_problem: str | None = None  # no proxy here

    def __init__(self, url: str, timeout: float = 5.0, clock: Clock = time.time) -> None:
        base = url.rstrip("/")
        self.url = base if base.endswith("/metrics") else f"{base}/metrics"
        self.timeout = timeout
        self.clock = clock

    def series(self) -> list[Series] | NoData:
        """The raw samples of one scrape, or NoData."""
        now = self.clock()
        try:
            response = shared_client().get(self.url, timeout=self.timeout)
        except (httpx.HTTPError, httpx.InvalidURL) as err:
            return NoData(self.url, f"unreachable: {type(err).__name__}: {err}", now)
        if response.status_code != 200:
            return NoData(self.url, f"HTTP {response.status_code}", now)
        try:
            return exposition_series(response.text)
        except ValueError as err:
            return NoData(self.url, f"unparsable metrics: {err}", now)

    def read(self) -> SampleResult:
        found = self.series()
        if isinstance(found, NoData):
            return found
        return sample_from_series(found, self.clock(), self.url)


class EngineWithProxy:
    """An engine's /metrics and the /metrics of the kvtune proxy in front of it, read as one sample: the
    engine's own series (KV, preemptions, prefix hits, histograms) beside the proxy's (prefix defeats, the
    max_tokens cap, capped requests), which the engine lacks, so no figure is counted twice.

    The proxy's process series are left out of the figures (the engine's start time is what says the engine
    restarted) but its start time joins the sample's identity as `proxy`: the proxy's counters count from
    zero when it restarts, and that is a restart, not an engine whose counters fell. A proxy that cannot be
    read leaves the engine's sample alone (its knobs still need watching); an engine that cannot be read is
    NoData, as always."""

    def __init__(self, engine: MetricsEndpoint, proxy: MetricsEndpoint) -> None:
        self.engine = engine
        self.proxy = proxy
        self.proxy_problem: str | None = None  # why the proxy's last scrape failed, None when it answered

    def read(self) -> SampleResult:
        engine = self.engine.series()
        if isinstance(engine, NoData):
            return engine
        proxy = self.proxy.series()
        self.proxy_problem = f"{proxy.source}: {proxy.reason}" if isinstance(proxy, NoData) else None
        extra = [] if isinstance(proxy, NoData) else [s for s in proxy if s[0] not in PROCESS_SERIES]
        found = sample_from_series(
            [*engine, *extra], self.engine.clock(), f"{self.engine.url} + {self.proxy.url}"
        )
        started = [] if isinstance(proxy, NoData) else [v for n, _, v in proxy if n == PROXY_START_SERIES]
        if isinstance(found, NoData) or len(started) != 1 or not math.isfinite(started[0]):
            return found
        return replace(found, identity=tuple(sorted((*identity_of(found), (PROXY, started[0])))))


def selector_matchers(selector: str) -> str:
    """`{job="vllm"}` or `job="vllm"` -> `job="vllm"` (the matchers that go inside braces)."""
    inner = selector.strip()
    if inner.startswith("{") and inner.endswith("}"):
        inner = inner[1:-1]
    return inner.strip().strip(",")


def range_step(seconds: float) -> float:
    """The step of a range query over `seconds`: whole seconds, at most MAX_RANGE_POINTS points."""
    return float(max(1, math.ceil(seconds / MAX_RANGE_POINTS)))


POD_LABEL = "pod"  # the label Prometheus' Kubernetes service discovery gives each pod's series


def _engine_series(name: str) -> bool:
    """A series the name map reads, other than a process's start time."""
    found = lookup(name)
    return found is not None and found[0].name != PROCESS_START


class PrometheusSource:
    """Queries against a Prometheus HTTP API for every engine series matching the label selector: one
    instant (`read`, every matching series summed or merged as one engine), one instant per pod
    (`read_pods`, by the `pod` label), or a range turned into one sample per step (`read_range`)."""

    proxy_problem: str | None = None  # a proxy's series come through the same query: nothing apart to fail

    def __init__(self, url: str, selector: str, timeout: float = 10.0, clock: Clock = time.time,
                 batcher: InstantBatcher | None = None, histograms: bool = True,
                 known_pods: frozenset[str] = frozenset()) -> None:  # fmt: skip
        self.url = url.rstrip("/")
        self.selector = selector
        self.timeout = timeout
        self.clock = clock
        self.batcher = batcher  # the operator's: its instant queries share one with other policies'
        # False: `read_pods` leaves the histograms out (the pooling keeps each pod's last ones), unless a
        # pod not in `known_pods` answers, whose histograms are its baseline and are read at once
        self.histograms = histograms
        self.known_pods = known_pods

    def query(self, histograms: bool = True) -> str:
        """Every engine series the selector matches, in any spelling (a relabelling prefix included), less a
        router's copies of them (ENGINE_MATCHERS), unless the selector speaks of that label itself; without
        the histograms' parts when `histograms` is False."""
        matchers = selector_matchers(self.selector)
        own = [m for m in ENGINE_MATCHERS if not re.search(rf"\b{m.split('=')[0]}\s*[=!]", matchers)]
        names = READ_NAMES if histograms else PLAIN_NAMES
        return "{" + ",".join([f'__name__=~"{names}"', *own, *([matchers] if matchers else [])]) + "}"

    @property
    def where(self) -> str:
        return f"{self.url} {self.selector}"

    def _get(self, path: str, params: dict[str, str], now: float) -> dict[str, Any] | NoData:
        """The `data` of a successful API answer, or NoData saying why there is none."""
        try:
            response = shared_client().get(f"{self.url}{path}", params=params, timeout=self.timeout)
            body = response.json()
        except (httpx.HTTPError, httpx.InvalidURL, ValueError) as err:
            return NoData(self.where, f"unreachable: {type(err).__name__}: {err}", now)
        if not isinstance(body, dict):
            return NoData(self.where, f"HTTP {response.status_code}: not a Prometheus API answer", now)
        if response.status_code != 200 or body.get("status") != "success":
            return NoData(
                self.where, f"HTTP {response.status_code}: {body.get('error', 'query failed')}", now
            )
        data = body.get("data")
        return data if isinstance(data, dict) else NoData(self.where, "unexpected answer: no data", now)

    def _batched(self, now: float, histograms: bool) -> dict[str, Any] | NoData:
        """The instant answer through the batcher (the series of this selector, out of a shared query)."""
        assert self.batcher is not None
        query = self.query(histograms)
        answer = self.batcher.instant(query, query[1:-1])
        return NoData(self.where, str(answer["error"]), now) if "error" in answer else answer

    def read_range(self, seconds: float) -> list[Sample] | NoData:
        """The last `seconds` as one sample per step of a range query, oldest first: the same window of
        samples `collect` takes live, over a span that has already happened."""
        now = self.clock()
        step = range_step(seconds)
        params = {
            "query": self.query(),
            "start": f"{now - seconds:.3f}",
            "end": f"{now:.3f}",
            "step": f"{step:g}",
        }
        data = self._get("/api/v1/query_range", params, now)
        if isinstance(data, NoData):
            return data
        by_time: dict[float, list[Series]] = {}
        try:
            for item in data["result"]:
                labels = dict(item["metric"])
                name = labels.pop("__name__", "")
                for stamp, value in item["values"]:
                    by_time.setdefault(float(stamp), []).append((name, labels, float(value)))
        except (KeyError, TypeError, ValueError) as err:
            return NoData(self.where, f"unexpected answer: {err}", now)
        readings = [sample_from_series(by_time[stamp], stamp, self.where) for stamp in sorted(by_time)]
        samples = [reading for reading in readings if isinstance(reading, Sample)]
        failures = [reading for reading in readings if isinstance(reading, NoData)]
        if samples:
            return samples
        if failures:
            return failures[-1]
        return NoData(self.where, f"no series match the selector in the last {seconds:g} s", now)

    def instant(self, histograms: bool = True) -> tuple[list[Series], float] | NoData:
        """Every matching series now (the histograms' parts only if `histograms`), and the newest timestamp
        among them; NoData when none match."""
        now = self.clock()
        data = (
            self._batched(now, histograms)
            if self.batcher is not None
            else self._get("/api/v1/query", {"query": self.query(histograms)}, now)
        )
        if isinstance(data, NoData):
            return data
        series: list[Series] = []
        timestamp = None
        try:
            for item in data["result"]:
                labels = dict(item["metric"])
                name = labels.pop("__name__", "")
                stamp, value = item["value"]
                timestamp = float(stamp) if timestamp is None else max(timestamp, float(stamp))
                series.append((name, labels, float(value)))
        except (KeyError, TypeError, ValueError) as err:
            return NoData(self.where, f"unexpected answer: {err}", now)
        if not series:
            return NoData(self.where, "no series match the selector", now)
        return series, timestamp if timestamp is not None and math.isfinite(timestamp) else now

    def read(self) -> SampleResult:
        found = self.instant()
        if isinstance(found, NoData):
            return found
        series, stamp = found
        return sample_from_series(series, stamp, self.where)

    @staticmethod
    def _pods_of(series: list[Series]) -> set[str]:
        return {labels[POD_LABEL] for _, labels, _ in series if labels.get(POD_LABEL)}

    def read_pods(self) -> dict[str, SampleResult] | NoData:
        """One sample per value of the `pod` label (each pod its own series set, as `... by (pod)` keeps
        them apart); series without the label are left out, and none carrying it is NoData. Without
        `histograms`, a pod not in `known_pods` among the answers has them all read again at once."""
        found = self.instant(self.histograms)
        if (
            not self.histograms
            and not isinstance(found, NoData)
            and not self._pods_of(found[0]) <= self.known_pods
        ):
            found = self.instant(True)
        if isinstance(found, NoData):
            return found
        series, stamp = found
        by_pod: dict[str, list[Series]] = {}
        for name, labels, value in series:
            if labels.get(POD_LABEL):
                by_pod.setdefault(labels[POD_LABEL], []).append((name, labels, value))
        # A pod none of whose series the operator reads is no engine: a router's own `vllm_router_*`, or a
        # process that exports only its start time.
        by_pod = {pod: found for pod, found in by_pod.items() if any(_engine_series(s[0]) for s in found)}
        if not by_pod:
            return NoData(self.where, f"byPod: no matching series carries a {POD_LABEL!r} label", stamp)
        return {
            pod: sample_from_series(found, stamp, f"{self.where} pod={pod}") for pod, found in by_pod.items()
        }
