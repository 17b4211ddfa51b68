"""The recording and alert rules, as data, and their two renderings (a plain rules file, a PrometheusRule).

Recording rules fold every engine's names into one family, `kvtune_engine:`: vLLM's current and legacy
names, SGLang's, kvtune serve's and the proxy's, each in its colon spelling and the `vllm_` spelling that a
Prometheus 2.x scrape of a recent prometheus-client stores (see reference/observability.md). Spellings are
joined with `or`, which matches on labels without the metric name, so an engine exposed under two spellings
is counted once. Every rule keeps `namespace`, `pod` and `model_name`. Alerts read only that family and the
operator's own metrics, so one alert works on every engine, and a rule's test is a test of every source.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import yaml

from kvtune import __version__
from kvtune.contract import metrics as m
from kvtune.contract.metrics import spellings

KEEP = ("namespace", "pod", "model_name")
# The matchers on every raw engine series. The chart replaces this block, written on the rules file's second
# line, with monitoring.prometheusRule.engineSelector (job, container or port of your engines' scrape).
ENGINE_SELECTOR = "{" + ", ".join(m.ENGINE_MATCHERS) + "}"
RATE_WINDOW = "5m"
# One page per alert under docs/runbooks/, at this release's tag (a test resolves every one to its file).
RUNBOOK_BASE = f"https://github.com/kvtune/kvtune/blob/v{__version__}/docs/runbooks"
# On-call runs the doctor from a laptop (through a port-forward to Prometheus) or from a Job with no rights,
# never by exec into the operator, whose token may patch workloads (docs/runbooks/README.md). The chart
# fills in <PROMETHEUS_URL> for its release (monitoring.prometheusRule.prometheusUrl).
PROMETHEUS_PLACEHOLDER = "<PROMETHEUS_URL>"


def doctor_command(selector: str) -> str:
    return f"kvtune doctor --prometheus {PROMETHEUS_PLACEHOLDER} --selector '{selector}' --since 1h"


DOCTOR_COMMAND = doctor_command('namespace="{{ $labels.namespace }}",pod="{{ $labels.pod }}"')
# The engine alerts evaluate in the recording rules' group, after them: a group's rules run in order at one
# timestamp, so an alert reads the value recorded in the same pass. In a group of their own they would read
# it one evaluation later (KVCachePreemptions up to three intervals after the first preempted scrape, not two).
ENGINE_GROUP = "kvtune-engine.rules"
OPERATOR_ALERT_GROUP = "kvtune-operator.alerts"
# The tickets about what the operator did or left undone. A rollback stays firing for this long after it
# happened (then resolves by itself), so it reaches a ticket queue however Alertmanager groups it.
ROLLBACK_WINDOW = "1h"
# A recommendation nobody applied for this long (Recommend mode, or Apply held at Recommend by maxMode)
# is a ticket: long enough to be a decision not taken, not a change still in review.
RECOMMENDATION_PENDING_DAYS = 3
SECONDS_PER_DAY = 86400
# A pending recommendation's alert outlives a gap in the operator's series (a restart) by this much, so the
# gap does not resolve and then re-open the ticket.
PENDING_KEEP_FIRING_FOR = "15m"


@dataclass(frozen=True)
class RecordingRule:
    """One series of the `kvtune_engine:` family, computed from every engine's spellings."""

    record: str
    expr: str


@dataclass(frozen=True)
class AlertRule:
    """An alert with what a person paged needs: what happened where, the runbook, the doctor command.
    Severity: `critical` pages (act now), `warning` is a ticket for working hours."""

    alert: str
    expr: str
    for_: str
    severity: str
    summary: str
    description: str
    doctor: str | None = DOCTOR_COMMAND  # None: no doctor command helps (the operator itself is down)
    extra_labels: Mapping[str, str] = field(default_factory=dict)
    keep_firing_for: str | None = None  # rides out a short gap in the series it reads

    @property
    def runbook_url(self) -> str:
        return f"{RUNBOOK_BASE}/{self.alert}.md"


@dataclass(frozen=True)
class RuleGroup:
    """Rules evaluated together; recording rules come first, so alerts read this round's family."""

    name: str
    rules: Sequence[RecordingRule | AlertRule]


# --- source names (kvtune.contract.metrics: the operator reads the same families) ---------------------------
def _any_of(names: Sequence[str], function: str | None = None) -> str:
    """`a{sel} or b{sel} or ...`, each wrapped in `function(name{sel}[5m])` when a function is given: every
    raw engine series is taken through the engine selector, so a router's copies are never an engine's."""
    selected = [f"{name}{ENGINE_SELECTOR}" for name in names]
    terms = selected if function is None else [f"{function}({name}[{RATE_WINDOW}])" for name in selected]
    return "\n  or ".join(terms)


def _by(aggregation: str, inner: str, *extra: str) -> str:
    labels = ", ".join((*KEEP, *extra))
    return f"{aggregation} by ({labels}) (\n  {inner}\n)"


KV_USAGE = spellings(*m.series_of(m.KV_USAGE))
PREEMPTIONS = spellings(*m.series_of(m.PREEMPTIONS))
RUNNING = spellings(*m.series_of(m.RUNNING))
WAITING = spellings(*m.series_of(m.WAITING))
# SGLang counts cached prompt tokens among its prompt tokens: its hit rate is the one pair it has.
PREFIX_HITS = spellings(*m.series_of(m.PREFIX_HITS), *m.series_of(m.PROMPT_TOKENS_CACHED, "sglang"))
PREFIX_QUERIES = spellings(*m.series_of(m.PREFIX_QUERIES), *m.series_of(m.PROMPT_TOKENS, "sglang"))
HISTOGRAMS: dict[str, list[str]] = {
    "ttft_seconds": spellings(*m.TTFT_SERIES),
    "itl_seconds": spellings(*m.ITL_SERIES),
    "e2e_seconds": spellings(*m.E2E_SERIES),
    "queue_seconds": spellings(*m.QUEUE_SERIES),
    "prompt_tokens": spellings(*m.series_of(m.REQUEST_PROMPT_TOKENS)),
    "generation_tokens": spellings(*m.series_of(m.REQUEST_GENERATION_TOKENS)),
    "max_tokens": spellings(*m.series_of(m.REQUEST_MAX_TOKENS)),
    "preemptions_per_request": spellings(*m.series_of(m.REQUEST_PREEMPTIONS)),  # vLLM >= 0.30, kvtune serve
}
UNATTRIBUTED = "unattributed"  # the reason of preemptions whose engine gives none
# Series every engine (or proxy) exposes from its first scrape: what `kvtune_engine:up` counts.
PRESENCE = [*RUNNING, *spellings(*m.series_of(m.MAX_TOKENS_CAP))]


def _kvtune_only(canonical: str) -> str:
    """The series of kvtune's own (what vLLM lacks) that means `canonical`, in both spellings."""
    return _any_of(spellings(*m.series_of(canonical, "kvtune")))


def _indent(text: str) -> str:
    return text.replace("\n", "\n  ")


def _hit_ratio() -> str:
    """Hit tokens over queried tokens. No value while nothing is queried (rather than 0/0), but 0 when
    queries come and the engine has no hit series yet (SGLang creates its counter on the first hit)."""
    hits = _by("sum", _any_of(PREFIX_HITS, "rate"))
    queries = _by("sum", _any_of(PREFIX_QUERIES, "rate"))
    return f"(\n  {_indent(hits)}\n  or 0 * {_indent(queries)}\n)\n/\n(\n  {_indent(queries)} > 0\n)"


def _preemptions_by_reason() -> str:
    """Preemptions per second by the reason the engine gives (vllm#58037's counter, where it has landed);
    an engine that gives none has its whole rate under `reason="unattributed"`, so the panel draws every
    engine. Reads `kvtune_engine:preemptions:rate5m`, recorded before it in the same group."""
    given = _by("sum", _any_of(spellings(*m.series_of(m.PREEMPTIONS_BY_REASON)), "rate"), "reason")
    any_reason = _by("sum", _any_of(spellings(*m.series_of(m.PREEMPTIONS_BY_REASON)), "rate"))
    without = f"kvtune_engine:preemptions:rate5m\n  unless on ({', '.join(KEEP)})\n  {_indent(any_reason)}"
    return f'{given}\nor\nlabel_replace(\n  {_indent(without)},\n  "reason", "{UNATTRIBUTED}", "", ""\n)'


def recording_rules() -> list[RecordingRule]:
    rules = [
        RecordingRule("kvtune_engine:kv_usage:ratio", _by("max", _any_of(KV_USAGE))),
        RecordingRule("kvtune_engine:preemptions:total", _by("sum", _any_of(PREEMPTIONS))),
        RecordingRule("kvtune_engine:preemptions:increase5m", _by("sum", _any_of(PREEMPTIONS, "increase"))),
        RecordingRule("kvtune_engine:preemptions:rate5m", _by("sum", _any_of(PREEMPTIONS, "rate"))),
        RecordingRule("kvtune_engine:preemptions_by_reason:rate5m", _preemptions_by_reason()),
        RecordingRule("kvtune_engine:requests_running", _by("sum", _any_of(RUNNING))),
        RecordingRule("kvtune_engine:requests_waiting", _by("sum", _any_of(WAITING))),
        RecordingRule("kvtune_engine:prefix_hit:ratio", _hit_ratio()),
        RecordingRule(
            "kvtune_engine:prefix_defeats:rate5m",
            _by("sum", _any_of(spellings(*m.series_of(m.PREFIX_DEFEATS)), "rate"), "reason"),
        ),
        RecordingRule(
            "kvtune_engine:prefix_defeat_tokens:rate5m",
            _by("sum", _any_of(spellings(*m.series_of(m.PREFIX_DEFEAT_TOKENS)), "rate"), "reason"),
        ),
        RecordingRule("kvtune_engine:kv_effective:ratio", _by("max", _kvtune_only(m.KV_EFFECTIVE))),
        RecordingRule("kvtune_engine:max_num_seqs", _by("max", _kvtune_only(m.MAX_NUM_SEQS))),
        RecordingRule("kvtune_engine:max_tokens_cap", _by("max", _kvtune_only(m.MAX_TOKENS_CAP))),
        RecordingRule(
            "kvtune_engine:capped_requests:rate5m",
            _by("sum", _any_of(spellings(*m.series_of(m.CAPPED_REQUESTS)), "rate"), "mode"),
        ),
    ]
    for short, names in HISTOGRAMS.items():
        buckets = [name + "_bucket" for name in names]
        rules.append(
            RecordingRule(f"kvtune_engine:{short}_bucket:rate5m", _by("sum", _any_of(buckets, "rate"), "le"))
        )
    rules.append(
        RecordingRule("kvtune_engine:up", f"clamp(\n  {_by('count', _any_of(PRESENCE))},\n  1, 1\n)")
    )
    return rules


# --- alerts ------------------------------------------------------------------------------------------------
def _cause(expr: str, cause: str) -> str:
    """Tags one branch of an alert with `cause`, so an alert with two triggers says which one fired."""
    return f'label_replace(\n  {expr},\n  "cause", "{cause}", "", ""\n)'


WHERE = "{{ $labels.namespace }}/{{ $labels.pod }}"
MODEL = "(model {{ $labels.model_name }})"


def alert_rules() -> list[AlertRule]:
    return [
        AlertRule(
            alert="KVCachePreemptions",
            expr="kvtune_engine:preemptions:increase5m > 0",
            for_="0s",
            severity="warning",
            summary='{{ $value | printf "%.0f" }} KV-cache preemptions in 5m on ' + WHERE,
            description=(
                f'{WHERE} {MODEL} preempted about {{{{ $value | printf "%.0f" }}}} requests in the last 5 '
                "minutes: the KV cache ran out of blocks, and running requests were evicted to recompute "
                "their prompts later. Each one wastes the compute already spent on that request and delays "
                "it. A ticket, not a page (KVCachePreemptionStorm pages): run the doctor (annotation "
                "`doctor`) for the cause and the remedies in ladder order."
            ),
        ),
        AlertRule(
            alert="KVCachePreemptionStorm",
            expr="kvtune_engine:preemptions:rate5m > 1",
            for_="5m",
            severity="critical",
            summary='{{ $value | printf "%.1f" }} KV-cache preemptions per second on ' + WHERE,
            description=(
                f"{WHERE} {MODEL} has preempted more than one request per second for 5 minutes "
                '({{ $value | printf "%.1f" }}/s now): most of its compute goes to recomputing evicted '
                "prompts. This pages: lower max_num_seqs or cap max_tokens now; the doctor gives the values."
            ),
        ),
        AlertRule(
            alert="KVCacheSaturated",
            expr=(
                "kvtune_engine:kv_usage:ratio > 0.95\nand on (namespace, pod, model_name)\n"
                "kvtune_engine:requests_waiting > 0"
            ),
            for_="10m",
            severity="warning",
            summary="KV cache {{ $value | humanizePercentage }} full with requests waiting on " + WHERE,
            description=(
                f"{WHERE} {MODEL} has kept its KV cache above 95% ({{{{ $value | humanizePercentage }}}} now) "
                "for 10 minutes while requests wait: the pool, not compute, limits throughput, and "
                "preemptions are one burst away."
            ),
        ),
        AlertRule(
            alert="PrefixCacheDefeated",
            expr=(
                _cause(
                    "sum by (namespace, pod, model_name) (kvtune_engine:prefix_defeats:rate5m) > 0", "defeats"
                )
                + "\nor\n"
                + _cause(
                    "kvtune_engine:prefix_hit:ratio < 0.5 * (kvtune_engine:prefix_hit:ratio offset 1h)\n"
                    "  and (kvtune_engine:prefix_hit:ratio offset 1h) > 0.2",
                    "hit_rate_collapsed",
                )
            ),
            for_="10m",
            severity="warning",
            summary="Prefix cache defeated on " + WHERE + " ({{ $labels.cause }})",
            description=(
                f'{WHERE} {MODEL}: {{{{ if eq $labels.cause "defeats" }}}}prompts that share content with '
                'earlier ones keep missing the prefix cache ({{ $value | printf "%.2f" }} defeats/s): '
                "something varies at their head (a timestamp, a request id) or their chunking is misaligned."
                "{{ else }}the prefix-cache hit rate fell to {{ $value | humanizePercentage }}, under half of "
                "what it was an hour ago.{{ end }} The doctor names the reasons and the fix."
            ),
        ),
        AlertRule(
            alert="EngineMetricsAbsent",
            expr=(
                "absent(kvtune_engine:up)\nor\n"
                "(\n  max_over_time(kvtune_engine:up[1h])\n  unless kvtune_engine:up\n)\n"
                "and on (namespace, pod) up"
            ),
            for_="5m",
            severity="warning",
            summary="No engine metrics{{ with $labels.pod }} from {{ $labels.namespace }}/{{ . }}{{ end }}",
            description=(
                "{{ if $labels.pod }}" + WHERE + " is still a scrape target but has exposed no engine series "
                "for 5 minutes{{ else }}Prometheus holds no series of any engine kvtune knows{{ end }}: the "
                "scrape fails, or the names changed (a `vllm:` name stored as `vllm_` is read; an unknown "
                "engine is not). Preemption and saturation alerts cannot fire meanwhile."
            ),
        ),
    ]


def operator_alert_rules() -> list[AlertRule]:
    by = "sum by (namespace, policy)"
    return [
        AlertRule(
            alert="KVTuneOperatorCannotAct",
            expr=(
                _cause(f"{by} (increase(kvtune_operator_errors_total[5m])) > 0", "errors")
                + "\nor\n"
                + _cause(f"{by} (increase(kvtune_operator_no_data_total[5m])) > 0", "no_data")
            ),
            for_="15m",
            severity="warning",
            summary="kvtune operator cannot act on {{ $labels.namespace }}/{{ $labels.policy }} ({{ $labels.cause }})",
            description=(
                'The kvtune operator has had {{ if eq $labels.cause "errors" }}errors{{ else }}no metrics to '
                "read{{ end }} for policy {{ $labels.namespace }}/{{ $labels.policy }} for 15 minutes: it "
                "can neither diagnose nor tune that engine. Its log and the policy's status conditions say why."
            ),
            doctor=doctor_command('namespace="{{ $labels.namespace }}"'),
        ),
        AlertRule(
            alert="KVTuneOperatorDown",
            expr="absent(kvtune_operator_info)",
            for_="10m",
            severity="warning",
            summary="No kvtune operator has been scraped for 10 minutes",
            description=(
                "Prometheus holds no kvtune_operator_info series: the operator's pod is down, crash-looping or "
                "not scraped (its ServiceMonitor is not selected, or the scrape fails). Policies are neither "
                "evaluated nor tuned meanwhile; the engines keep the values last applied."
            ),
            doctor=None,  # nothing to run it in: the runbook starts from the operator's pod
        ),
        AlertRule(
            alert="KVTuneOperatorStalled",
            expr=(
                "time() - kvtune_operator_last_evaluation_timestamp_seconds\n"
                "> on (namespace, policy)\n"
                "3 * kvtune_operator_evaluation_interval_seconds"
            ),
            for_="5m",
            severity="warning",
            summary="kvtune operator stopped evaluating {{ $labels.namespace }}/{{ $labels.policy }}",
            description=(
                "The operator is scraped but has not evaluated policy {{ $labels.namespace }}/"
                "{{ $labels.policy }} for more than three of its intervals ({{ $value | humanizeDuration }} "
                "since the last): the policy's loop is stuck. The policy is neither diagnosed nor tuned."
            ),
            doctor=doctor_command('namespace="{{ $labels.namespace }}"'),
        ),
        *ticket_alert_rules(),
    ]


def ticket_alert_rules() -> list[AlertRule]:
    """What the operator did, or advised and nobody did: tickets for the people who own the policy. The
    pending recommendation reads `kvtune_operator_recommendation_pending_since_timestamp_seconds`, the
    earliest of the operator's replicas (a restart seeds it from the policy's history)."""
    where = "{{ $labels.namespace }}/{{ $labels.policy }}"
    window_s = RECOMMENDATION_PENDING_DAYS * SECONDS_PER_DAY
    return [
        AlertRule(
            alert="KVTuneRollback",
            expr=f"sum by (namespace, policy) (increase(kvtune_operator_rollbacks_total[{ROLLBACK_WINDOW}])) > 0",
            for_="0s",
            severity="warning",
            summary="kvtune operator rolled back a change on " + where,
            description=(
                f"The kvtune operator rolled back a change it had applied to policy {where} in the last "
                f"{ROLLBACK_WINDOW}: the engine got worse in the evaluation window after it (goodput fell, or "
                "preemptions rose against the forecast), so the operator put the value back. The engine "
                "runs as before the change. A ticket, not a page: the policy's history says what was tried "
                "and on what evidence, before the operator tries again."
            ),
            doctor=doctor_command('namespace="{{ $labels.namespace }}"'),
        ),
        AlertRule(
            alert="KVTuneRecommendationPending",
            expr=(
                "time()\n- min by (namespace, policy, knob) "
                "(kvtune_operator_recommendation_pending_since_timestamp_seconds)\n"
                f"> {window_s}"
            ),
            for_="0s",
            severity="warning",
            summary=(
                "kvtune recommendation for {{ $labels.knob }} on " + where + " pending for more than "
                f"{RECOMMENDATION_PENDING_DAYS} days"
            ),
            description=(
                f"The kvtune operator has recommended a new {{{{ $labels.knob }}}} for policy {where} for "
                "{{ $value | humanizeDuration }}, and the engine still runs its old value: the policy is in "
                "Recommend mode, maxMode holds it there, or the operator yielded to another field manager "
                "(YieldedToFieldManager), and nobody has applied or declined the change. A ticket, not a "
                "page: apply the recommended value (the policy's status.recommended), or change the policy so "
                "it stops."
            ),
            doctor=doctor_command('namespace="{{ $labels.namespace }}"'),
            keep_firing_for=PENDING_KEEP_FIRING_FOR,
        ),
    ]


def rule_groups() -> list[RuleGroup]:
    return [
        RuleGroup(ENGINE_GROUP, [*recording_rules(), *alert_rules()]),
        RuleGroup(OPERATOR_ALERT_GROUP, operator_alert_rules()),
    ]


# --- rendering ---------------------------------------------------------------------------------------------
def _rule_dict(rule: RecordingRule | AlertRule) -> dict[str, object]:
    if isinstance(rule, RecordingRule):
        return {"record": rule.record, "expr": rule.expr}
    annotations = {
        "summary": rule.summary,
        "description": rule.description,
        "runbook_url": rule.runbook_url,
        **({"doctor": rule.doctor} if rule.doctor else {}),
    }
    return {
        "alert": rule.alert,
        "expr": rule.expr,
        "for": rule.for_,
        **({"keep_firing_for": rule.keep_firing_for} if rule.keep_firing_for else {}),
        "labels": {"severity": rule.severity, **rule.extra_labels},
        "annotations": annotations,
    }


def groups_dict() -> list[dict[str, object]]:
    return [{"name": g.name, "rules": [_rule_dict(r) for r in g.rules]} for g in rule_groups()]


class _Dumper(yaml.SafeDumper):  # type: ignore[misc]  # PyYAML ships no type stubs
    """Multi-line strings (PromQL) as literal blocks, so the rendered files read like hand-written ones."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)

ENGINE_SELECTOR_LINE = "# engine selector: "
HEADER = (
    "# Generated by `kvtune rules build` from kvtune/observability/rules.py. Do not edit.\n"
    f"{ENGINE_SELECTOR_LINE}{ENGINE_SELECTOR}\n"
)


def _dump(document: object) -> str:
    body: str = yaml.dump(document, Dumper=_Dumper, sort_keys=False, width=1000, allow_unicode=True)
    return HEADER + body


def render_rules_file() -> str:
    """The plain Prometheus rules file (`rule_files:` in prometheus.yml, `promtool check rules`)."""
    return _dump({"groups": groups_dict()})


def render_prometheus_rule(name: str, namespace: str, labels: Mapping[str, str]) -> str:
    """The same groups as a prometheus-operator PrometheusRule; `labels` must match the Prometheus'
    ruleSelector (kube-prometheus-stack selects `release: <its release name>`)."""
    document = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(labels)},
        "spec": {"groups": groups_dict()},
    }
    return _dump(document)
