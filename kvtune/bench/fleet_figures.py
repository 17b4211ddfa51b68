"""What `kvtune bench fleet` measures, from the texts it reads: kube-apiserver's own /metrics (requests by
verb, watches held), the operator's /metrics (its evaluation lag histogram, evaluations), and the
operator's /proc (CPU seconds, resident memory). Pure: texts in, figures out, and the table they make.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from kvtune.bench.fleet_replay import sample_parts

REQUESTS = "apiserver_request_total"
LONGRUNNING = "apiserver_longrunning_requests"
LAG = "kvtune_operator_evaluation_lag_seconds"
EVALUATIONS = "kvtune_operator_last_evaluation_timestamp_seconds"
PROMETHEUS_REQUESTS = "prometheus_http_requests_total"
ERRORS = "kvtune_operator_errors_total"
NO_DATA = "kvtune_operator_no_data_total"
OWN_REQUESTS = "kvtune_operator_kube_api_requests_total"  # the operator's client, counted by itself
# what the operator reads and writes (kwok's node heartbeats and the controllers' leases are left out)
OPERATOR_RESOURCES = frozenset({"kvtuningpolicies", "endpointslices", "events", "deployments", "replicasets",
                                "pods", "secrets", "kopfpeerings", "clusterkopfpeerings", "statefulsets"})  # fmt: skip
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def samples(text: str, name: str) -> Iterator[tuple[dict[str, str], float]]:
    """(labels, value) of every sample named exactly `name` (a filter first: kube-apiserver's /metrics runs
    to megabytes, and only a few families are read)."""
    prefix = (f"{name}{{", f"{name} ")
    for line in text.splitlines():
        if not line.startswith(prefix):
            continue
        parts = sample_parts(line)
        if parts is None:
            continue
        series, value, _ = parts
        labels = dict(_LABEL.findall(series[len(name) :]))
        yield labels, float(value)


def requests_by_verb(text: str, resources: frozenset[str] = OPERATOR_RESOURCES) -> dict[str, float]:
    """kube-apiserver's request count by verb, over `resources` (all of them with an empty set)."""
    found: dict[str, float] = {}
    for labels, value in samples(text, REQUESTS):
        if resources and labels.get("resource") not in resources:
            continue
        verb = labels.get("verb", "?")
        found[verb] = found.get(verb, 0.0) + value
    return found


def own_requests_by_verb(text: str) -> dict[str, float]:
    """The operator's own count of its API requests, by verb (its client, the one the rate limit paces)."""
    found: dict[str, float] = {}
    for labels, value in samples(text, OWN_REQUESTS):
        verb = labels.get("verb", "?")
        found[verb] = found.get(verb, 0.0) + value
    return found


def watches_held(text: str) -> dict[str, float]:
    """Watches open now, by resource (`apiserver_longrunning_requests{verb="WATCH"}`)."""
    found: dict[str, float] = {}
    for labels, value in samples(text, LONGRUNNING):
        if labels.get("verb") == "WATCH":
            resource = labels.get("resource", "?")
            found[resource] = found.get(resource, 0.0) + value
    return found


def prometheus_queries(text: str) -> dict[str, float]:
    """Prometheus' own count of the queries it answered, by API handler (instant and range)."""
    found: dict[str, float] = {}
    for labels, value in samples(text, PROMETHEUS_REQUESTS):
        handler = labels.get("handler", "")
        if handler.startswith("/api/v1/query"):
            found[handler] = found.get(handler, 0.0) + value
    return found


def rates(before: Mapping[str, float], after: Mapping[str, float], seconds: float) -> dict[str, float]:
    """Per second, key by key, between two counts (a key first seen after counts from zero)."""
    return {key: (after[key] - before.get(key, 0.0)) / seconds for key in sorted(after)
            if after[key] - before.get(key, 0.0) > 0}  # fmt: skip


def lag_buckets(text: str) -> dict[float, float]:
    """The operator's evaluation lag histogram: upper bound -> cumulative count."""
    return {float(labels["le"]): value for labels, value in samples(text, f"{LAG}_bucket")}


def quantile(q: float, before: Mapping[float, float], after: Mapping[float, float]) -> float | None:
    """The q-quantile of what a cumulative histogram observed between two readings, interpolated inside its
    bucket as Prometheus' histogram_quantile does (the highest finite bound when it falls in +Inf). None
    when nothing was observed."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    if not counts or counts[-1] <= 0:
        return None
    rank = q * counts[-1]
    lower, below = 0.0, 0.0
    for bound, count in zip(bounds, counts, strict=True):
        if count >= rank:
            if bound == float("inf"):
                return lower
            inside = count - below
            return lower + (bound - lower) * ((rank - below) / inside if inside > 0 else 1.0)
        lower, below = bound, count
    return lower


def evaluation_times(text: str) -> dict[tuple[str, str], float]:
    """(namespace, policy) -> when the operator last evaluated it."""
    return {(labels.get("namespace", ""), labels.get("policy", "")): value
            for labels, value in samples(text, EVALUATIONS)}  # fmt: skip


def failures(text: str) -> dict[str, float]:
    """The operator's failed evaluations so far, summed over policies: errors by kind, and `no_data`."""
    found: dict[str, float] = {}
    for labels, value in samples(text, ERRORS):
        found[labels.get("kind", "?")] = found.get(labels.get("kind", "?"), 0.0) + value
    found["no_data"] = sum(value for _, value in samples(text, NO_DATA))
    return found


def cpu_seconds(stat: str, ticks_per_second: int) -> float:
    """User + system CPU seconds of a process, from /proc/PID/stat (past the command, which may hold spaces
    and parentheses)."""
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / ticks_per_second


def rss_bytes(status: str) -> int:
    """Resident memory now, from /proc/PID/status."""
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise ValueError("no VmRSS line: not a live process's status")


@dataclass(frozen=True)
class FleetFigures:
    source: str  # pods (each pod's /metrics) or prometheus
    policies: int
    pods: int
    namespaces: int
    interval_s: int
    window_s: float
    settle_s: (
        float | None
    )  # from the operator's start to every policy evaluated once (None: not within the limit)
    evaluated: int  # policies evaluated at least once by the end
    evaluations_per_s: float  # evaluations recorded in the window, per second
    cpu_percent: float  # of one core, over the window
    rss_peak_mib: float
    lag_p50_s: float | None
    lag_p99_s: float | None
    requests_per_s: dict[str, float]  # by verb, the operator's resources
    watches: int  # watches the operator added (held during the window minus before its start)
    failed: dict[str, float]  # errors by kind, and no_data, in the window
    queries_per_s: float | None = None  # Prometheus queries per second (None: the pods source)
    own_requests_per_s: dict[str, float] | None = None  # by verb, as the operator's client counts them
    qps_limit: float | None = None  # its client-side limit (--kube-api-qps)

    @property
    def needed_per_s(self) -> float:
        """Evaluations per second the policies ask for (each once per interval)."""
        return self.policies / self.interval_s


def _seconds(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def _own(r: FleetFigures) -> str:
    if r.own_requests_per_s is None:
        return "n/a"
    total = sum(r.own_requests_per_s.values())
    verbs = ", ".join(f"{verb} {rate:.2f}" for verb, rate in sorted(r.own_requests_per_s.items()) if rate)
    limit = f" ({r.qps_limit:g})" if r.qps_limit is not None else ""
    return f"{total:.2f}{limit}: {verbs or 'none'}"


def table(rows: list[FleetFigures]) -> list[str]:
    head = ("| source | policies | pods | namespaces | evaluated | evaluations/s (needed) | operator CPU (% of a core) | "
            "RSS peak (MiB) | tick lag p50 / p99 (s) | API requests/s by verb | watches | settled in (s) | "
            "failed in the window | Prometheus queries/s | operator's own API requests/s (limit) |")  # fmt: skip
    lines = [head, "|" + "---|" * 15]
    for r in rows:
        verbs = ", ".join(f"{verb} {rate:.2f}" for verb, rate in sorted(r.requests_per_s.items())) or "none"
        failed = ", ".join(f"{kind} {int(n)}" for kind, n in sorted(r.failed.items()) if n) or "none"
        lines.append(
            f"| {r.source} | {r.policies} | {r.pods} | {r.namespaces} | {r.evaluated} | {r.evaluations_per_s:.2f} "
            f"({r.needed_per_s:.2f}) | {r.cpu_percent:.0f} | {r.rss_peak_mib:.0f} | {_seconds(r.lag_p50_s)} / "
            f"{_seconds(r.lag_p99_s)} | {verbs} | {r.watches} | {_seconds(r.settle_s)} | {failed} | "
            f"{'n/a' if r.queries_per_s is None else f'{r.queries_per_s:.2f}'} | {_own(r)} |"
        )
    return lines
