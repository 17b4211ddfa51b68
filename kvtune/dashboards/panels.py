"""Every panel of the three dashboards, as plain data: title, description, unit and PromQL.

This is the single source that the Grafana dashboards (`kvtune.dashboards.grafana`), `kvtune report` and the
live Prometheus test read, so a query is written once. Engine panels read the `kvtune_engine:` recording-rule
family (which brings vLLM, SGLang and kvtune under one name); operator panels read the operator's own metrics.
"""

from __future__ import annotations

from dataclasses import dataclass

KV_CACHE_UID = "kvtune-kv-cache"
OPERATOR_UID = "kvtune-operator"
LATENCY_UID = "kvtune-latency"

# The dashboard variables every engine query filters on (the contract's label set).
ENGINE = 'namespace=~"$namespace", model_name=~"$model", pod=~"$pod"'
# The operator's metrics carry namespace and policy, not model or pod.
OPERATOR = 'namespace=~"$namespace", policy=~"$policy"'

# Grafana unit ids. A `suffix:` unit is Grafana's custom unit: the number followed by the word.
RATIO = "percentunit"
SECONDS = "s"
PER_SECOND = "reqps"
EVALUATIONS_PER_SECOND = "suffix: evaluations/s"
COUNT = "short"
ROLLBACKS = "suffix: rollbacks"
TOKENS = "suffix: tokens"
SEQUENCES = "suffix: sequences"
TIMESTAMP_AGE = "s"

# Grafana's own interval variable: the window a rate or increase takes, sized by Grafana from the zoom and the
# data source's scrape interval, so a counter's steps are never skipped between two points.
RATE_INTERVAL = "$__rate_interval"


@dataclass(frozen=True)
class Target:
    """One query of a panel: its PromQL, the legend of each series it returns, and its unit. A target whose
    unit differs from the panel's first one is drawn on a second axis (preemptions over a latency)."""

    expr: str
    legend: str
    unit: str


# How a panel shows its thresholds: `bands` shades each step behind the series (a ratio against a fixed pool,
# whose axis runs 0 to 1), `series` colours each line by the step its value is in (a rate whose healthy value
# is zero: a shaded band above a floor near zero would fill an idle panel).
BANDS = "bands"
SERIES = "series"


@dataclass(frozen=True)
class Thresholds:
    """Where a panel's value means trouble: each step (from, Grafana colour) starts at its value and holds
    until the next one; below the first step the value is healthy."""

    steps: tuple[tuple[float, str], ...]
    style: str


# Any value off the floor. One preemption (or cap hit, or error) in a 5-minute rate is 1/300 = 0.0033/s, so a
# step at 0.001/s (vLLM's own KV-cache dashboard puts preemptions/s at orange from 0.001) turns on the first.
OFF_THE_FLOOR = 0.001
# The design's rule: any preemption is the alert (KVCachePreemptions), so any preemption is red.
ANY_PREEMPTION = Thresholds(((OFF_THE_FLOOR, "red"),), SERIES)
# Worth a look, not an emergency: a clamped request (the cap at work, answers possibly cut), a failed
# evaluation, a defeated prefix, a rollback (each a ticket at most).
ANY_AT_ALL = Thresholds(((OFF_THE_FLOOR, "orange"),), SERIES)
# KV usage near the pool. Paging is built to run the pool near full (the seed's estimate: about 95% of the
# cache in use, seeds/002 §2.2.11), so 0.9 is a warning, not trouble: llm-d reads "above 0.9" as nearly full,
# and vLLM's KV-cache dashboard marks orange from 0.9 and red from 0.98, the last blocks before preemption.
# KVCacheSaturated fires at 0.95 only with requests waiting, for 10 minutes.
KV_NEAR_THE_POOL = Thresholds(((0.9, "orange"), (0.98, "red")), BANDS)


@dataclass(frozen=True)
class PanelSpec:
    dashboard_uid: str
    row: str
    title: str
    description: str
    targets: tuple[Target, ...]
    thresholds: Thresholds | None = None

    @property
    def unit(self) -> str:
        return self.targets[0].unit


@dataclass(frozen=True)
class PanelQuery:
    """One query of one panel, flat: what the report and the live test iterate over."""

    dashboard_uid: str
    panel_title: str
    expr: str
    unit: str


def _quantiles(family: str, unit: str, by: str = "pod") -> tuple[Target, ...]:
    """p50, p95 and p99 of a `..._bucket:rate5m` histogram family, per `by`."""
    return tuple(
        Target(
            f"histogram_quantile({q}, sum by (le, {by}) ({family}{{{ENGINE}}}))",
            f"p{round(q * 100)} {{{{{by}}}}}",
            unit,
        )
        for q in (0.5, 0.95, 0.99)
    )


def _preempted_beyond(times: int, by: str = "") -> str:
    """Finished requests per second preempted more than `times` times (a bound of vLLM's buckets): all of
    them (`le="+Inf"`) less those at most `times` (`le` is "5" on Prometheus 3, "5.0" as scraped by 2.x)."""
    family = "kvtune_engine:preemptions_per_request_bucket:rate5m"
    grouped = f"sum by ({by}) " if by else "sum"
    at_most = f'le=~"{times}|{times}\\\\.0"'
    return f'{grouped}({family}{{{ENGINE}, le="+Inf"}}) - {grouped}({family}{{{ENGINE}, {at_most}}})'


PREEMPTIONS_OVERLAY = Target(
    f"sum(kvtune_engine:preemptions:rate5m{{{ENGINE}}})", "preemptions/s (all pods)", PER_SECOND
)


def _kv_cache() -> list[PanelSpec]:
    d = KV_CACHE_UID
    return [
        PanelSpec(
            d,
            "KV cache",
            "KV cache usage",
            "Share of the KV cache's blocks held by running requests. Healthy: below 0.9 most of the time; "
            "at 1.0 with requests waiting the pool is too small for the concurrency and preemption follows. "
            "Shaded orange from 0.9, red from 0.98 (the last blocks).",
            (
                Target(f"max by (pod) (kvtune_engine:kv_usage:ratio{{{ENGINE}}})", "{{pod}}", RATIO),
                Target(f"avg(kvtune_engine:kv_usage:ratio{{{ENGINE}}})", "mean of all pods", RATIO),
            ),
            KV_NEAR_THE_POOL,
        ),
        PanelSpec(
            d,
            "KV cache",
            "Preemptions per second",
            "Running requests evicted to free KV blocks (they recompute from their prompt). Healthy: exactly "
            "zero; any preemption means max_num_seqs (or max_tokens) admits more than the cache holds, and turns "
            "the line red.",
            (
                Target(f"sum by (pod) (kvtune_engine:preemptions:rate5m{{{ENGINE}}})", "{{pod}}", PER_SECOND),
                Target(f"sum(kvtune_engine:preemptions:rate5m{{{ENGINE}}})", "all pods", PER_SECOND),
            ),
            ANY_PREEMPTION,
        ),
        PanelSpec(
            d,
            "KV cache",
            "Preemptions since boot",
            "The cumulative preemption counter (it restarts at zero when an engine restarts). Healthy: flat.",
            (
                Target(f"sum by (pod) (kvtune_engine:preemptions:total{{{ENGINE}}})", "{{pod}}", COUNT),
                Target(f"sum(kvtune_engine:preemptions:total{{{ENGINE}}})", "all pods", COUNT),
            ),
        ),
        PanelSpec(
            d,
            "KV cache",
            "Requests preempted more than once",
            "Finished requests per second by how often they were preempted (vllm:request_num_preemptions: "
            "vLLM 0.30 and later, kvtune serve), beside preemptions per second: a request preempted five "
            "times adds five to the preemptions and one to the 2+ line. vLLM's first bucket holds never and "
            "once together, so the lines start at twice. Healthy: zero; requests preempted again and again "
            "are thrashing.",
            (
                Target(_preempted_beyond(1, "pod"), "2+ times {{pod}}", PER_SECOND),
                Target(_preempted_beyond(1), "2+ times, all pods", PER_SECOND),
                Target(_preempted_beyond(5), "6+ times, all pods", PER_SECOND),
                Target(
                    f"sum(kvtune_engine:preemptions:rate5m{{{ENGINE}}})", "preemptions, all pods", PER_SECOND
                ),
            ),
            ANY_PREEMPTION,
        ),
        PanelSpec(
            d,
            "KV cache",
            "Preemptions by reason",
            "Why engines preempt, where they say (vLLM's proposed vllm:num_preemptions_by_reason, vllm#58037): "
            "kv_full and priority evict for lack of a free block, what a lower max_num_seqs relieves; "
            "prefix_cache_reset does not. 'unattributed': an engine that gives no reason (every vLLM release "
            "through 0.34, SGLang, kvtune serve). Healthy: zero.",
            (
                Target(
                    f"sum by (reason) (kvtune_engine:preemptions_by_reason:rate5m{{{ENGINE}}})",
                    "{{reason}}",
                    PER_SECOND,
                ),
            ),
            ANY_PREEMPTION,
        ),
        PanelSpec(
            d,
            "KV cache",
            "Effective utilisation against reserved",
            "Reserved: share of the cache held by requests. Effective: share of the held slots that hold a "
            "token (kvtune engine only: on vLLM and SGLang only the reserved line is drawn). Healthy: effective "
            "close to reserved; a wide gap is memory held for tokens that are never written.",
            (
                Target(f"max by (pod) (kvtune_engine:kv_usage:ratio{{{ENGINE}}})", "reserved {{pod}}", RATIO),
                Target(
                    f"max by (pod) (kvtune_engine:kv_effective:ratio{{{ENGINE}}})", "effective {{pod}}", RATIO
                ),
            ),
        ),
        PanelSpec(
            d,
            "Concurrency",
            "Concurrency ceiling: real against the boot line",
            "Boot line: the concurrency the engine printed at start (cache size / max model length). Real: "
            "what the cache holds for the requests actually seen (operator). Healthy: running stays under "
            "the real ceiling.",
            (
                Target(
                    f'max by (policy) (kvtune_operator_concurrency_ceiling{{{OPERATOR}, kind="real"}})',
                    "real ceiling {{policy}}",
                    SEQUENCES,
                ),
                Target(
                    f'max by (policy) (kvtune_operator_concurrency_ceiling{{{OPERATOR}, kind="boot_line"}})',
                    "boot-line ceiling {{policy}}",
                    SEQUENCES,
                ),
                Target(
                    f"sum by (pod) (kvtune_engine:requests_running{{{ENGINE}}})", "running {{pod}}", SEQUENCES
                ),
            ),
        ),
        PanelSpec(
            d,
            "Concurrency",
            "Live max_num_seqs",
            "The engine's admission limit now (kvtune engine, changed live by the operator; no data is expected "
            "on vLLM or SGLang: the operator dashboard's max_num_seqs panel shows theirs). Healthy: steady, at "
            "or below the real concurrency ceiling.",
            (Target(f"max by (pod) (kvtune_engine:max_num_seqs{{{ENGINE}}})", "{{pod}}", SEQUENCES),),
        ),
        PanelSpec(
            d,
            "Concurrency",
            "Requests waiting and running",
            "Healthy: waiting near zero; a queue that grows while running sits at max_num_seqs means the "
            "engine is full, and one that grows with preemptions means it admits too many.",
            (
                Target(
                    f"sum by (pod) (kvtune_engine:requests_running{{{ENGINE}}})", "running {{pod}}", COUNT
                ),
                Target(
                    f"sum by (pod) (kvtune_engine:requests_waiting{{{ENGINE}}})", "waiting {{pod}}", COUNT
                ),
            ),
        ),
        PanelSpec(
            d,
            "Prefix cache",
            "Prefix cache hit rate",
            "Prompt tokens served from the prefix cache over 5 minutes. Healthy: steady for the workload "
            "(high for chat with a shared system prompt); a collapse means something in the prompt varies.",
            (Target(f"avg by (pod) (kvtune_engine:prefix_hit:ratio{{{ENGINE}}})", "{{pod}}", RATIO),),
        ),
        PanelSpec(
            d,
            "Prefix cache",
            "Prefix-cache defeats by reason",
            "Prompts whose shared prefix is defeated (a timestamp at the head, a varying id), per reason "
            "(kvtune proxy or engine; no data is expected without one). Healthy: zero.",
            (
                Target(
                    f"sum by (reason) (kvtune_engine:prefix_defeats:rate5m{{{ENGINE}}})",
                    "{{reason}}",
                    PER_SECOND,
                ),
            ),
            ANY_AT_ALL,
        ),
        PanelSpec(
            d,
            "Requests",
            "Request footprint p50 / p95",
            "Prompt and generated tokens per finished request; a request's KV footprint is their sum. "
            "Healthy: stable; a rising p95 lowers the real concurrency ceiling.",
            (
                *(
                    Target(
                        f"histogram_quantile({q}, sum by (le) (kvtune_engine:{kind}_tokens_bucket:rate5m{{{ENGINE}}}))",
                        f"{label} p{round(q * 100)}",
                        TOKENS,
                    )
                    for kind, label in (("prompt", "prompt"), ("generation", "generated"))
                    for q in (0.5, 0.95)
                ),
            ),
        ),
        PanelSpec(
            d,
            "Requests",
            "max_tokens requested against generated",
            "The over-declaration gap: what clients ask for in max_tokens against what they generate. "
            "Healthy: close; a wide gap reserves cache for tokens never produced (cap max_tokens).",
            tuple(
                Target(
                    f"histogram_quantile({q}, sum by (le) (kvtune_engine:{kind}_bucket:rate5m{{{ENGINE}}}))",
                    f"{label} p{round(q * 100)}",
                    TOKENS,
                )
                for kind, label in (("max_tokens", "requested"), ("generation_tokens", "generated"))
                for q in (0.5, 0.95)
            ),
        ),
        PanelSpec(
            d,
            "Requests",
            "Capped requests",
            "Requests whose max_tokens the cap lowered, per mode (kvtune proxy or engine; no data is expected "
            "without one). Healthy: zero without a cap; with one, a steady share and no rise in truncated answers. "
            "Orange from the first cap hit: each one is an answer that may end short.",
            (
                Target(
                    f"sum by (mode) (kvtune_engine:capped_requests:rate5m{{{ENGINE}}})",
                    "{{mode}}",
                    PER_SECOND,
                ),
            ),
            ANY_AT_ALL,
        ),
    ]


def _operator() -> list[PanelSpec]:
    d = OPERATOR_UID
    return [
        PanelSpec(
            d,
            "Actions",
            "Actions by remedy and result",
            "What the operator did in each 5 minutes (also drawn as annotations). Healthy: a few actions "
            "after a change of load, then none; failed or rolled_back deserve a look.",
            (
                Target(
                    f"sum by (remedy, result) (increase(kvtune_operator_actions_total{{{OPERATOR}}}[5m]))",
                    "{{remedy}} {{result}}",
                    COUNT,
                ),
            ),
        ),
        PanelSpec(
            d,
            "Knobs",
            "max_num_seqs: current against recommended",
            "Per policy. Healthy: the lines meet; a gap in Recommend mode is a change waiting for a human.",
            (
                Target(
                    f'max by (policy, kind) (kvtune_operator_knob{{{OPERATOR}, knob="max_num_seqs"}})',
                    "{{kind}} {{policy}}",
                    SEQUENCES,
                ),
            ),
        ),
        PanelSpec(
            d,
            "Knobs",
            "max_tokens cap: current against recommended",
            "Per policy; no line means no cap. Healthy: the lines meet.",
            (
                Target(
                    f'max by (policy, kind) (kvtune_operator_knob{{{OPERATOR}, knob="max_tokens_cap"}})',
                    "{{kind}} {{policy}}",
                    TOKENS,
                ),
            ),
        ),
        PanelSpec(
            d,
            "Ladder",
            "Ladder rung",
            "0 none, 1 cap max_tokens, 2 lower max_num_seqs, 3 prefix defeats, 4 FP8 KV. Healthy: 0, or a rung "
            "that is worked and then returns to 0.",
            (Target(f"max by (policy) (kvtune_operator_ladder_rung{{{OPERATOR}}})", "{{policy}}", COUNT),),
        ),
        PanelSpec(
            d,
            "Ladder",
            "Conditions",
            "1 while a condition holds. Healthy: Stable at 1, Preempting and KVSaturated at 0.",
            (
                Target(
                    f"max by (policy, type) (kvtune_operator_condition{{{OPERATOR}}})",
                    "{{type}} {{policy}}",
                    COUNT,
                ),
            ),
        ),
        PanelSpec(
            d,
            "Prediction",
            "Preemptions per minute: predicted against observed",
            "At the max_num_seqs in force: the what-if model's forecast (issue 28) and the last window's "
            "rate. Healthy: both at 0 under NoPreemption, or close under Goodput; an observed line above a "
            "predicted 0 is a miss, and two misses put the tuner back to measured stepping.",
            (
                Target(
                    f"max by (policy, kind) (kvtune_operator_preemptions_per_minute{{{OPERATOR}}})",
                    "{{kind}} {{policy}}",
                    COUNT,
                ),
                Target(
                    f"max by (policy) (kvtune_operator_prediction_misses{{{OPERATOR}}})",
                    "misses {{policy}}",
                    COUNT,
                ),
            ),
        ),
        PanelSpec(
            d,
            "Prediction",
            "Objective in force",
            "1 on the objective each policy tunes for: NoPreemption (the largest max_num_seqs predicted "
            "never to preempt) or Goodput (the best predicted goodput under the policy's p95 queue-wait "
            "bound). Healthy: the objective the policy states; no line: prediction is off for that policy.",
            (
                Target(
                    f"max by (policy, objective) (kvtune_operator_objective{{{OPERATOR}}})",
                    "{{objective}} {{policy}}",
                    COUNT,
                ),
            ),
        ),
        PanelSpec(
            d,
            "Health",
            "Rollbacks in each interval",
            "Actions undone because the engine got worse, counted over Grafana's rate interval (the counter's "
            "increase, so an operator restart does not reset the line). Healthy: zero; each rollback is a "
            "KVTuneRollback ticket.",
            (
                Target(
                    f"sum by (policy) (increase(kvtune_operator_rollbacks_total{{{OPERATOR}}}[{RATE_INTERVAL}]))",
                    "{{policy}}",
                    ROLLBACKS,
                ),
            ),
            ANY_AT_ALL,
        ),
        PanelSpec(
            d,
            "Health",
            "Errors and no-data per second",
            "Evaluations that failed or found no metrics. Healthy: zero; a steady rate is the "
            "KVTuneOperatorCannotAct alert.",
            (
                Target(
                    f"sum by (policy, kind) (rate(kvtune_operator_errors_total{{{OPERATOR}}}[5m]))",
                    "error {{kind}} {{policy}}",
                    EVALUATIONS_PER_SECOND,
                ),
                Target(
                    f"sum by (policy) (rate(kvtune_operator_no_data_total{{{OPERATOR}}}[5m]))",
                    "no data {{policy}}",
                    EVALUATIONS_PER_SECOND,
                ),
            ),
            ANY_AT_ALL,
        ),
        PanelSpec(
            d,
            "Health",
            "Time since the last evaluation",
            "Healthy: below the policy's evaluation interval; a line that climbs means the operator stopped.",
            (
                Target(
                    f"time() - max by (policy) (kvtune_operator_last_evaluation_timestamp_seconds{{{OPERATOR}}})",
                    "{{policy}}",
                    TIMESTAMP_AGE,
                ),
            ),
        ),
    ]


def _latency() -> list[PanelSpec]:
    d = LATENCY_UID
    panels = [
        ("Time to first token", "ttft", "Healthy: p95 within the SLO and flat; it climbs with the queue."),
        (
            "Inter-token latency",
            "itl",
            "Healthy: flat; steps up as more sequences share each step, jumps with preemption.",
        ),
        ("End-to-end request latency", "e2e", "Healthy: follows the generated length, no long tail."),
        (
            "Queue time",
            "queue",
            "Time waiting before admission. Healthy: p95 near zero; a rise means the engine is full.",
        ),
    ]
    return [
        PanelSpec(
            d,
            "Latency",
            title,
            f"{healthy} Preemptions per second are overlaid on the right axis.",
            (*_quantiles(f"kvtune_engine:{family}_seconds_bucket:rate5m", SECONDS), PREEMPTIONS_OVERLAY),
        )
        for title, family, healthy in panels
    ]


def all_panels() -> list[PanelSpec]:
    """Every panel of every dashboard, in dashboard order."""
    return [*_kv_cache(), *_operator(), *_latency()]


def all_panel_queries() -> list[PanelQuery]:
    """Every query of every panel, flat: the report and the live test run each one."""
    return [PanelQuery(p.dashboard_uid, p.title, t.expr, t.unit) for p in all_panels() for t in p.targets]


# Every dashboard marks the minutes in which an engine preempted.
PREEMPTION_ANNOTATION = f"sum(increase(kvtune_engine:preemptions:total{{{ENGINE}}}[1m])) > 0"
# The operator's actions, drawn on the operator dashboard as annotations: a point wherever the timestamp
# of a remedy's last action moved.
ACTION_ANNOTATION = f"changes(kvtune_operator_last_action_timestamp_seconds{{{OPERATOR}}}[1m]) > 0"
