"""Every engine's metric names, once: one map from vLLM's (current and legacy), SGLang's and kvtune's series
to kvtune's canonical names, and the families the rules and benchmarks read by meaning.

vLLM, SGLang and kvtune all land on the same canonical keys, so diagnosis never knows which engine it reads.
`vllm_`/`sglang_`/`kvtune_` spellings (colons rewritten by an OpenMetrics scrape or a relabel) are folded
onto the colon spelling first; `spellings` gives both, for a PromQL query or a scrape that must match either.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from kvtune.contract.knobs import CAP_MODES
from kvtune.contract.preemptions import PREEMPTIONS_BY_REASON_SERIES, REQUEST_PREEMPTIONS_SERIES


class Kind(Enum):
    GAUGE = "gauge"
    COUNTER = "counter"
    HISTOGRAM = "histogram"
    INFO = "info"
    CONFIG = "config"  # a gauge whose value is a setting (SGLang's page size): read into cache_config


class Merge(Enum):
    """How several series of one canonical name (several pods, several labels) combine into one figure."""

    SUM = "sum"
    MAX = "max"


@dataclass(frozen=True)
class Canonical:
    name: str
    kind: Kind
    merge: Merge = Merge.SUM
    split_label: str | None = None  # keep one figure per value of this label: `name:value`


# Canonical keys the diagnosis reads.
KV_USAGE = "kv_usage"
RUNNING = "num_running"
WAITING = "num_waiting"
WAITING_BY_REASON = "num_waiting_by_reason"
RETRACTED_NOW = "retracted_now"
CACHE_HIT_RATE_GAUGE = "cache_hit_rate_gauge"
KV_EFFECTIVE = "kv_effective_utilization"
MAX_NUM_SEQS = "max_num_seqs"
MAX_TOKENS_CAP = "max_tokens_cap"
PREEMPTIONS = "preemptions"
PREEMPTIONS_BY_REASON = "preemptions_by_reason"  # newer vLLM, see kvtune.contract.preemptions
PREFIX_QUERIES = "prefix_cache_queries"
PREFIX_HITS = "prefix_cache_hits"
PROMPT_TOKENS = "prompt_tokens"
PROMPT_TOKENS_CACHED = "prompt_tokens_cached"
PROMPT_TOKENS_BY_SOURCE = "prompt_tokens_by_source"
GENERATION_TOKENS = "generation_tokens"
REQUEST_SUCCESS = "request_success"
CAPPED_REQUESTS = "capped_requests"
PREFIX_DEFEATS = "prefix_defeats"
PREFIX_DEFEAT_TOKENS = "prefix_defeat_tokens"
REQUEST_PROMPT_TOKENS = "request_prompt_tokens"
REQUEST_GENERATION_TOKENS = "request_generation_tokens"
REQUEST_MAX_TOKENS = "request_max_tokens"
REQUEST_PREEMPTIONS = "request_preemptions"  # preemptions per finished request (a histogram)
CACHE_CONFIG = "cache_config"
PROCESS_START = "process_start_time"
INTER_TOKEN_LATENCY = "inter_token_latency"  # seconds between two tokens of a request: a step's time
RUNNING_ALL_PODS = "num_running_all_pods"  # kvtune's own: running summed over a pooled sample's pods
POOLED_PODS = "pooled_pods"  # kvtune's own: the pods a pooled sample was read from (absent: one engine)

# Gauges that are fractions: a value outside [0, 1] is corrupt, not a figure.
RATIO_GAUGES = frozenset({KV_USAGE, KV_EFFECTIVE, CACHE_HIT_RATE_GAUGE})

_G, _C, _H = Kind.GAUGE, Kind.COUNTER, Kind.HISTOGRAM

# Exposed series name (colon spelling; counters with their `_total`) -> canonical.
NAME_MAP: dict[str, Canonical] = {
    # vLLM V1, current names
    "vllm:kv_cache_usage_perc": Canonical(KV_USAGE, _G, Merge.MAX),
    "vllm:num_requests_running": Canonical(RUNNING, _G),
    "vllm:num_requests_waiting": Canonical(WAITING, _G),
    "vllm:num_requests_waiting_by_reason": Canonical(WAITING_BY_REASON, _G, split_label="reason"),
    "vllm:num_preemptions_total": Canonical(PREEMPTIONS, _C),
    "vllm:prefix_cache_queries_total": Canonical(PREFIX_QUERIES, _C),
    "vllm:prefix_cache_hits_total": Canonical(PREFIX_HITS, _C),
    "vllm:prompt_tokens_total": Canonical(PROMPT_TOKENS, _C),
    "vllm:prompt_tokens_cached_total": Canonical(PROMPT_TOKENS_CACHED, _C),
    "vllm:prompt_tokens_by_source_total": Canonical(PROMPT_TOKENS_BY_SOURCE, _C, split_label="source"),
    "vllm:generation_tokens_total": Canonical(GENERATION_TOKENS, _C),
    "vllm:request_success_total": Canonical(REQUEST_SUCCESS, _C, split_label="finished_reason"),
    "vllm:request_prompt_tokens": Canonical(REQUEST_PROMPT_TOKENS, _H),
    "vllm:request_generation_tokens": Canonical(REQUEST_GENERATION_TOKENS, _H),
    "vllm:request_params_max_tokens": Canonical(REQUEST_MAX_TOKENS, _H),
    # a step's seconds where running requests were not seen at every scrape (an open loop below saturation)
    "vllm:inter_token_latency_seconds": Canonical(INTER_TOKEN_LATENCY, _H),
    "vllm:time_per_output_token_seconds": Canonical(INTER_TOKEN_LATENCY, _H),
    # vLLM >= 0.30, and the by-reason counter vllm#58037 proposes (kvtune.contract.preemptions)
    REQUEST_PREEMPTIONS_SERIES: Canonical(REQUEST_PREEMPTIONS, _H),
    PREEMPTIONS_BY_REASON_SERIES: Canonical(PREEMPTIONS_BY_REASON, _C, split_label="reason"),
    "vllm:cache_config_info": Canonical(CACHE_CONFIG, Kind.INFO),
    # vLLM legacy names (V0 / early V1, removed by 0.11)
    "vllm:gpu_cache_usage_perc": Canonical(KV_USAGE, _G, Merge.MAX),
    "vllm:gpu_prefix_cache_queries_total": Canonical(PREFIX_QUERIES, _C),
    "vllm:gpu_prefix_cache_hits_total": Canonical(PREFIX_HITS, _C),
    # SGLang
    "sglang:token_usage": Canonical(KV_USAGE, _G, Merge.MAX),
    "sglang:num_running_reqs": Canonical(RUNNING, _G),
    "sglang:num_queue_reqs": Canonical(WAITING, _G),
    "sglang:num_retracted_requests_total": Canonical(PREEMPTIONS, _C),
    "sglang:total_retracted_reqs": Canonical(PREEMPTIONS, _C),  # older: a cumulative count kept in a gauge
    "sglang:num_retracted_reqs": Canonical(RETRACTED_NOW, _G),
    "sglang:cache_hit_rate": Canonical(CACHE_HIT_RATE_GAUGE, _G, Merge.MAX),
    "sglang:cached_tokens_total": Canonical(PROMPT_TOKENS_CACHED, _C),
    "sglang:prompt_tokens_total": Canonical(PROMPT_TOKENS, _C),
    "sglang:generation_tokens_total": Canonical(GENERATION_TOKENS, _C),
    "sglang:cache_config_info": Canonical(CACHE_CONFIG, Kind.INFO),
    # SGLang 0.5 exports its pool as plain gauges rather than an info series
    "sglang:max_total_num_tokens": Canonical("kv_cache_size_tokens", Kind.CONFIG),
    "sglang:page_size": Canonical("block_size", Kind.CONFIG),
    "sglang:num_pages": Canonical("num_blocks", Kind.CONFIG),
    "sglang:context_len": Canonical("max_model_len", Kind.CONFIG),
    # its buckets are coarse (100, 300, 500, ...), so a p95 read from them runs high, as from vLLM's
    "sglang:prompt_tokens_histogram": Canonical(REQUEST_PROMPT_TOKENS, _H),
    "sglang:generation_tokens_histogram": Canonical(REQUEST_GENERATION_TOKENS, _H),
    # kvtune's own (what vLLM lacks)
    "kvtune:kv_effective_utilization": Canonical(KV_EFFECTIVE, _G, Merge.MAX),
    "kvtune:max_num_seqs": Canonical(MAX_NUM_SEQS, _G, Merge.MAX),
    "kvtune:max_tokens_cap": Canonical(MAX_TOKENS_CAP, _G, Merge.MAX),
    # by mode (clamp, reject, default); an older kvtune's unlabelled series lands on mode ''
    "kvtune:capped_requests_total": Canonical(CAPPED_REQUESTS, _C, split_label="mode"),
    # the prefix-defeat detector (engine and proxy): defeated prompts, and the tokens that would have hit
    "kvtune:prefix_defeats_total": Canonical(PREFIX_DEFEATS, _C, split_label="reason"),
    "kvtune:prefix_defeat_tokens_total": Canonical(PREFIX_DEFEAT_TOKENS, _C, split_label="reason"),
    # prometheus-client's process collector (vLLM, kvtune): moves when the engine process restarts
    "process_start_time_seconds": Canonical(PROCESS_START, _G, Merge.MAX),
}

# cache_config_info label spellings -> kvtune's keys (SGLang says page for block).
CACHE_CONFIG_LABELS = {
    "block_size": "block_size",
    "page_size": "block_size",
    "num_gpu_blocks": "num_blocks",
    "num_pages": "num_blocks",
    "cache_dtype": "cache_dtype",
    "kv_cache_dtype": "cache_dtype",
    "kv_cache_size_tokens": "kv_cache_size_tokens",
    "kv_cache_max_concurrency": "kv_cache_max_concurrency",
    "enable_prefix_caching": "enable_prefix_caching",
    "max_model_len": "max_model_len",
}

# kvtune's own series that the operator does not read (the proxy's, the detector's cost).
DETECTOR_SECONDS = "kvtune:prefix_detector_seconds_total"
# The label values of `kvtune:capped_requests_total{mode}`: the two cap modes, and the cap used as a default.
CAPPED_DEFAULT = "default"
CAPPED_LABELS = (*CAP_MODES, CAPPED_DEFAULT)

# Latency histograms, read by the rules and dashboards (the operator judges from counts, not latencies; it
# reads the inter-token latency only to time an engine's step for the workload fit).
TTFT_SERIES = ("vllm:time_to_first_token_seconds", "sglang:time_to_first_token_seconds")
ITL_SERIES = (
    "vllm:inter_token_latency_seconds",
    "vllm:time_per_output_token_seconds",  # its name before vLLM 0.10
    "sglang:inter_token_latency_seconds",
)
E2E_SERIES = ("vllm:e2e_request_latency_seconds", "sglang:e2e_request_latency_seconds")
QUEUE_SERIES = ("vllm:request_queue_time_seconds",)

ENGINE_PREFIXES = ("vllm", "sglang", "kvtune")
PROCESS_SERIES = ("process_start_time_seconds",)  # read beside the engine's own series
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
# Prefixes a scrape's relabelling puts before every name: KServe's controller-made PodMonitor for an
# LLMInferenceService stores `vllm:num_requests_running` as `kserve_vllm:num_requests_running` (kserve#5208).
RELABEL_PREFIXES = ("kserve_",)
# Label matchers every engine's series satisfies and a router's copy of them does not: production-stack's
# router re-exports vllm:num_requests_running/waiting and the prefix-cache gauges once per backend, each
# labelled `server` (the backend's URL), which no engine and no Kubernetes scrape sets.
ENGINE_MATCHERS = ('server=""',)


def series_of(canonical: str, engine: str | None = None) -> tuple[str, ...]:
    """The exposed series (colon spelling) that mean `canonical`, in the map's order; only `engine`'s
    (`vllm`, `sglang`, `kvtune`) when one is named."""
    return tuple(
        name
        for name, entry in NAME_MAP.items()
        if entry.name == canonical and (engine is None or name.startswith(f"{engine}:"))
    )


def spellings(*colon_names: str) -> list[str]:
    """Each name in its colon spelling and in the underscore spelling an OpenMetrics scrape stores, then
    both again under each relabelling prefix (`kserve_vllm:...`, `kserve_vllm_...`)."""
    plain: list[str] = []
    for name in colon_names:
        plain += [name, name.replace(":", "_", 1)]
    return plain + [prefix + name for prefix in RELABEL_PREFIXES for name in plain]


def read_names() -> list[str]:
    """Every exposed name `lookup` reads, in every spelling it accepts (colon and underscore, a counter with
    and without `_total`, a histogram's three parts, under each relabelling prefix), and the process' start
    time: what a query needs to ask for, and no more (a vLLM scrape is four times larger)."""
    colon: list[str] = []
    for name, entry in NAME_MAP.items():
        if entry.kind is Kind.HISTOGRAM:
            colon += [name + suffix for suffix in HISTOGRAM_SUFFIXES]
        elif entry.kind is Kind.COUNTER and name.endswith("_total"):
            colon += [name, name.removesuffix("_total")]
        else:
            colon.append(name)
    process = [prefix + name for prefix in ("", *RELABEL_PREFIXES) for name in PROCESS_SERIES]
    return sorted({*spellings(*colon), *process})


def colon_spelling(series: str) -> str:
    """`vllm_num_preemptions_total` or `kserve_vllm:num_preemptions_total` -> `vllm:num_preemptions_total`
    (colon names pass unchanged; a relabelling prefix goes, so `kserve_process_start_time_seconds` reads
    as the process series it is)."""
    for relabel in RELABEL_PREFIXES:
        series = series.removeprefix(relabel)
    for prefix in ENGINE_PREFIXES:
        if series.startswith(prefix + "_"):
            return f"{prefix}:{series[len(prefix) + 1 :]}"
    return series


def lookup(series: str) -> tuple[Canonical, str] | None:
    """The canonical entry of one exposed sample name, and the histogram part (`_bucket`, `_sum`,
    `_count`, or '' for a plain series); None for a series the operator does not read."""
    name = colon_spelling(series)
    entry = NAME_MAP.get(name)
    if entry is not None and entry.kind is not Kind.HISTOGRAM:
        return entry, ""
    if entry is None and not name.endswith("_total"):
        # a counter exposed without `_total` (some exporters, or a Prometheus recording rule)
        counter = NAME_MAP.get(name + "_total")
        if counter is not None and counter.kind is Kind.COUNTER:
            return counter, ""
    for suffix in HISTOGRAM_SUFFIXES:
        if name.endswith(suffix):
            base = NAME_MAP.get(name[: -len(suffix)])
            if base is not None and base.kind is Kind.HISTOGRAM:
                return base, suffix
    return None
