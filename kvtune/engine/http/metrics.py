"""Prometheus metrics under vLLM V1's names (so dashboards and rules work unchanged) plus kvtune's own.

Series live in a private registry, served in the classic text format 0.0.4: Prometheus 2.x stores colon
names scraped as OpenMetrics under underscore names, so every `vllm:` rule would miss. Counters are fed
from the engine's cumulative counters by difference, so they stay monotonic whatever order snapshots
arrive in; histograms observe each finished request exactly once. Two kinds of series come from outside
the engine thread: capped requests, counted by the HTTP layer that decides the cap, and the prefix-defeat
counters, read from the detector at scrape time (prefix_report).
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from kvtune.contract.metrics import CAPPED_LABELS
from kvtune.contract.preemptions import REQUEST_PREEMPTIONS_BUCKETS, REQUEST_PREEMPTIONS_SERIES
from kvtune.engine.loop.errors import ERROR_FINISH_REASON, FAILURE_STAGES
from kvtune.engine.loop.llm_engine import LLMEngine
from kvtune.engine.loop.thread import EngineStats
from kvtune.front.prefix_report import PrefixDefeatCollector

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
ENGINE_INDEX = "0"  # one engine per server; vLLM labels data-parallel ranks the same way
LABELS = ("model_name", "engine")
CACHE_INFO_LABELS = (*LABELS, "block_size", "num_gpu_blocks", "cache_dtype", "enable_prefix_caching",
                     "kv_cache_size_tokens", "kv_cache_max_concurrency")  # fmt: skip

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


def size_buckets(limit: int) -> list[float]:
    """Token-count buckets for the request-size histograms: a geometric series with 20 steps per decade
    (..., 100, 112, 126, 141, 158, 178, 200, ...: 12% apart), in whole tokens, up to `limit`.

    vLLM uses 1, 2, 5, 10, ...: a p95 interpolated inside a (200, 500] bucket read 680 tokens for requests
    of at most 600 (the tuner benchmark), and the operator sizes max_num_seqs from the p95 footprint. The
    series names are vLLM's; a histogram's buckets are its own, and Prometheus readers take any layout.
    """
    steps = [10 ** (i / 20) for i in range(20)]  # 20 per decade, each 12.2% above the last
    buckets: list[float] = []
    decade = 1
    while True:
        for step in steps:
            value = float(int(step * decade + 0.5))
            if value > limit:
                return buckets
            if not buckets or value > buckets[-1]:
                buckets.append(value)
        decade *= 10


class EngineMetrics:
    """Every series the server exposes, and how an engine snapshot updates them."""

    def __init__(self, engine: LLMEngine) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.labels = {"model_name": engine.served_model_name, "engine": ENGINE_INDEX}
        self._lock = threading.Lock()
        self._last_counts: dict[str, int] = {}
        reg = self.registry
        # process_start_time_seconds (as vLLM exports it): how the operator tells an engine restart
        ProcessCollector(registry=reg)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, LABELS, registry=reg)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, (*LABELS, *extra), registry=reg)

        def histogram(name: str, doc: str, buckets: tuple[float, ...] | list[float]) -> Histogram:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=reg)

        self.kv_cache_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self.prefix_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.request_success = counter(
            "vllm:request_success", "Count of successfully processed requests.", ("finished_reason",)
        )
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        sizes = size_buckets(engine.max_model_len)
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", sizes
        )
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", sizes
        )
        self.request_max_tokens = histogram(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", sizes
        )
        # vLLM's buckets and semantics: every finished request is observed, never-preempted ones as 0
        self.request_preemptions = histogram(
            REQUEST_PREEMPTIONS_SERIES,
            "Histogram of the number of times a request was preempted.",
            REQUEST_PREEMPTIONS_BUCKETS,
        )
        pool_tokens = engine.cache.num_tokens
        cache_info = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            CACHE_INFO_LABELS,
            registry=reg,
        )
        cache_info.labels(
            **self.labels,
            block_size=str(engine.cache.block_size),
            num_gpu_blocks=str(engine.cache.num_blocks),
            cache_dtype=engine.config.kv_cache_dtype,
            enable_prefix_caching=str(engine.config.enable_prefix_caching),
            kv_cache_size_tokens=str(pool_tokens),
            kv_cache_max_concurrency=f"{pool_tokens / engine.max_model_len:.2f}",
        ).set(1)
        self.effective = gauge(
            "kvtune:kv_effective_utilization",
            "Token slots holding a token divided by token slots held by running requests (0-1).",
        )
        self.held_empty = gauge(
            "kvtune:kv_held_empty_slots", "Token slots held by running requests that hold no token."
        )
        self.max_num_seqs = gauge("kvtune:max_num_seqs", "Live max_num_seqs (the admin API can change it).")
        self.max_tokens_cap = gauge(
            "kvtune:max_tokens_cap", "Live server-side cap on max_tokens; 0 means no cap."
        )
        self.capped_requests = counter(
            "kvtune:capped_requests",
            "Requests the server-side max_tokens cap acted on, by mode: clamp (lowered), reject (refused "
            "with a 400), default (no max_tokens asked, the cap used as the default).",
            ("mode",),
        )
        self.request_failures = counter(
            "kvtune:request_failures",
            "Requests the engine failed (finished_reason=error), by the stage of the step that raised.",
            ("reason",),
        )
        self.rejected_requests = counter(
            "kvtune:rejected_requests", "Requests refused before queueing (HTTP 429), by reason.", ("reason",)
        )
        # Create every labelled series now, so a scrape before any traffic already shows each name.
        for metric in (
            self.kv_cache_usage, self.running, self.waiting, self.preemptions, self.prefix_queries,
            self.prefix_hits, self.prompt_tokens, self.generation_tokens, self.ttft, self.itl, self.e2e,
            self.queue_time, self.request_prompt_tokens, self.request_generation_tokens,
            self.request_max_tokens, self.request_preemptions, self.effective, self.held_empty,
            self.max_num_seqs, self.max_tokens_cap,
        ):  # fmt: skip
            metric.labels(**self.labels)
        for reason in ("stop", "length", "abort", ERROR_FINISH_REASON):
            self.request_success.labels(**self.labels, finished_reason=reason)
        for stage in FAILURE_STAGES:
            self.request_failures.labels(**self.labels, reason=stage)
        self.rejected_requests.labels(**self.labels, reason="queue_full")
        for mode in CAPPED_LABELS:
            self.capped_requests.labels(**self.labels, mode=mode)
        if engine.prefix_detector is not None:
            reg.register(PrefixDefeatCollector(engine.prefix_detector, self.labels))

    def count_capped(self, mode: str) -> None:
        """One request the cap acted on (any thread: prometheus counters are thread-safe)."""
        self.capped_requests.labels(**self.labels, mode=mode).inc()

    def _add(self, key: str, counter: Counter, total: int, **extra: str) -> None:
        """Advance `counter` to the engine's cumulative `total` (never backwards)."""
        delta = total - self._last_counts.get(key, 0)
        if delta > 0:
            counter.labels(**self.labels, **extra).inc(delta)
            self._last_counts[key] = total

    def update(self, stats: EngineStats) -> None:
        """Apply one engine snapshot (called on the engine thread after each step)."""
        labels = self.labels
        with self._lock:
            self.kv_cache_usage.labels(**labels).set(stats.kv_cache_usage)
            self.running.labels(**labels).set(stats.num_running)
            self.waiting.labels(**labels).set(stats.num_waiting)
            self.effective.labels(**labels).set(stats.effective_utilization)
            self.held_empty.labels(**labels).set(stats.held_empty_slots)
            self.max_num_seqs.labels(**labels).set(stats.max_num_seqs)
            self.max_tokens_cap.labels(**labels).set(stats.max_tokens_cap or 0)
            c = stats.counters
            self._add("preemptions", self.preemptions, c.num_preemptions)
            self._add("prefix_queries", self.prefix_queries, c.prefix_cache_queries)
            self._add("prefix_hits", self.prefix_hits, c.prefix_cache_hits)
            self._add("prompt_tokens", self.prompt_tokens, c.prompt_tokens)
            self._add("generation_tokens", self.generation_tokens, c.generation_tokens)
            for reason, count in c.finished.items():
                self._add(f"finished:{reason}", self.request_success, count, finished_reason=reason)
            for stage, count in c.failures.items():
                self._add(f"failed:{stage}", self.request_failures, count, reason=stage)
            for reason, count in stats.rejected.items():
                self._add(f"rejected:{reason}", self.rejected_requests, count, reason=reason)
            for fin in stats.finished:
                if fin.time_to_first_token is not None:
                    self.ttft.labels(**labels).observe(fin.time_to_first_token)
                self.e2e.labels(**labels).observe(fin.e2e_latency)
                self.queue_time.labels(**labels).observe(fin.queue_time)
                self.request_prompt_tokens.labels(**labels).observe(fin.prompt_tokens)
                self.request_generation_tokens.labels(**labels).observe(fin.generation_tokens)
                self.request_max_tokens.labels(**labels).observe(fin.max_tokens)
                self.request_preemptions.labels(**labels).observe(fin.num_preemptions)
            for gap in stats.inter_token_latencies:
                self.itl.labels(**labels).observe(gap)

    def render(self) -> bytes:
        """The scrape body, text format 0.0.4 (serve it with CONTENT_TYPE)."""
        return generate_latest(self.registry)
