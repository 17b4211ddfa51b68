"""`kvtune bench fleet`: the operator over a fleet on the local control plane: P KVTuningPolicies (Recommend,
engine vllm, each pod's /metrics through `target.podEndpoints`) over their Deployments' pods on kwok nodes,
every pod's /metrics a replayed real engine (fleet_replay_server.py over docs/examples' recordings). For each
P, on a fresh control plane: the chart installed, the fleet created, then the operator started as the
chart's ServiceAccount; once every policy has been evaluated, a window in which it measures the operator's
CPU (from /proc, % of one core) and peak RSS, its tick lag (p50 and p99 of
`kvtune_operator_evaluation_lag_seconds`: from a policy's interval running out to its evaluation being
recorded), evaluations per second against those the policies ask for, kube-apiserver's requests per second
by verb on the resources the operator uses, and the watches the operator holds (kube-apiserver's own
/metrics, read as the admin, before and after its start).

It drives the local control plane and the e2e harness (scripts/local_cluster.py, tests/e2e), so it runs from
a repository checkout, as root (the pods' network namespace), after `make k8s-tools`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from kvtune.bench.fleet_figures import (
    FleetFigures,
    cpu_seconds,
    evaluation_times,
    failures,
    lag_buckets,
    own_requests_by_verb,
    prometheus_queries,
    quantile,
    rates,
    requests_by_verb,
    rss_bytes,
    table,
    watches_held,
)

SECTION = "fleet"  # one section per source: fleet-pods, fleet-prometheus
REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "docs" / "examples"
RECORDINGS = ("vllm-0.32-cpu-preempting", "kvtune-engine-preempting", "kvtune-engine-quiet")
# what each recorded engine's GET /version answered (vLLM's, from its recorded log); kvtune's engine as a vLLM
# target has none, and the operator reads the image's tag instead
VERSIONS = {"vllm-0.32-cpu-preempting": "0.32.0"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--policies", default="10,100", help="comma-separated fleet sizes (default 10,100)")
    parser.add_argument("--source", choices=("pods", "prometheus"), default="pods",
                        help="where the policies read the pods' metrics: each pod's /metrics (default), or a "
                        "Prometheus 3 scraping them (the monitoring stack and the chart's PodMonitor)")  # fmt: skip
    parser.add_argument("--pods-per-policy", type=int, default=10)
    parser.add_argument("--policies-per-namespace", type=int, default=10)
    parser.add_argument("--interval", type=int, default=15, help="each policy's intervalSeconds (default 15)")
    parser.add_argument(
        "--window", type=float, default=60.0, help="seconds measured once settled (default 60)"
    )
    parser.add_argument("--warmup", type=float, default=0.0,
                        help="seconds after every policy's first evaluation before the window: the first plans "
                        "(a what-if simulation per preempting policy, all due at once after a start) run "
                        "then; 0 measures them (default 0)")  # fmt: skip
    parser.add_argument("--settle-timeout", type=float, default=600.0,
                        help="seconds allowed for every policy's first evaluation (default 600)")  # fmt: skip
    parser.add_argument("--recordings", default=",".join(RECORDINGS),
                        help="docs/examples/NAME.prom the pods replay, dealt to the policies in turn")  # fmt: skip
    parser.add_argument("--workers", type=int, default=None,
                        help="the chart's `workers`, evaluations at once (default: the chart's, 16)")  # fmt: skip
    parser.add_argument("--keep-read-series", action="store_true",
                        help="with --source prometheus: the PodMonitor keeps only the series the operator reads, "
                        "so that Prometheus fits beside the control plane on a small box")  # fmt: skip
    parser.add_argument("--operator-cpus", default="1",
                        help="the CPUs the operator may run on (taskset -c; default 1: one core, the issue's "
                        "bound); 'all' leaves it unpinned")  # fmt: skip
    parser.add_argument("--log-dir", type=Path, default=Path(".bench-logs"))
    parser.add_argument("--output", type=Path, default=Path("BENCHMARKS.md"))
    parser.add_argument("--no-record", action="store_true", help="print only; leave BENCHMARKS.md alone")


def run(args: argparse.Namespace) -> int:
    from kvtune.bench.benchmarks_md import git_revision, machine_description, record_section
    from kvtune.errors import KvtuneError

    try:
        sizes = [int(s) for s in args.policies.split(",") if s.strip()]
    except ValueError:
        raise KvtuneError("--policies takes a comma-separated list of counts") from None
    names = [n.strip() for n in args.recordings.split(",") if n.strip()]
    recordings = {name: EXAMPLES / f"{name}.prom" for name in names}
    missing = [str(path) for path in recordings.values() if not path.exists()]
    if not sizes or min(sizes) < 1 or args.pods_per_policy < 1 or args.interval < 1 or args.window <= 0:
        raise KvtuneError("--policies, --pods-per-policy, --interval and --window are positive")
    if missing or not recordings:
        raise KvtuneError(f"recordings not found: {', '.join(missing) or 'none named'}")
    if not (REPO / "tests" / "e2e" / "cluster.py").exists():
        raise KvtuneError("kvtune bench fleet drives the local control plane and the e2e harness: run it from a "
                          "repository checkout (scripts/local_cluster.py, tests/e2e)")  # fmt: skip
    sys.path.insert(0, str(REPO))
    args.log_dir.mkdir(parents=True, exist_ok=True)
    rows: list[FleetFigures] = []
    for size in sizes:
        rows.append(one_run(size, args, recordings))
        print("\n".join(table(rows)), flush=True)
        if not args.no_record:  # after each size: a larger one that hangs keeps the smaller ones' figures
            body = format_section(args, rows, machine_description(), git_revision())
            record_section(f"{SECTION}-{args.source}", body, args.output)
    return 0


def apiserver_metrics(cluster: Any) -> str:
    """kube-apiserver's own /metrics, as the admin."""
    text: str = cluster.kubectl("get", "--raw", "/metrics").stdout
    return text


def operator_metrics(port: int) -> str:
    return metrics_of(f"http://127.0.0.1:{port}")


def metrics_of(url: str) -> str:
    return httpx.get(f"{url}/metrics", timeout=30).text


class PeakRss:
    """The process' resident memory every second, its peak kept, until stopped."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak = pid, 0
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.sample, name="operator RSS", daemon=True)
        self.thread.start()

    def sample(self) -> None:
        while True:
            try:
                self.peak = max(self.peak, rss_bytes(Path(f"/proc/{self.pid}/status").read_text()))
            except (OSError, ValueError):
                return  # the process has gone
            if self.stopping.wait(1.0):
                return

    def stop(self) -> int:
        self.stopping.set()
        self.thread.join(5)
        return self.peak


def one_run(size: int, args: argparse.Namespace, recordings: dict[str, Path]) -> FleetFigures:
    """A fresh control plane with the chart and a fleet of `size` policies; the operator over it; figures."""
    from kvtune.bench.fleet_cluster import RELEASE, SYSTEM, FleetShape, fleet_on_cluster
    from kvtune.harness.local_http import free_port

    e2e = importlib.import_module("tests.e2e.cluster")
    network_module = importlib.import_module("tests.e2e.pod_network")
    folder = Path(tempfile.mkdtemp(prefix=f"fleet-{size}-", dir=args.log_dir.resolve()))
    print(f"fleet of {size} policies: control plane, chart, fleet and operator in {folder}", flush=True)
    versions = {name: VERSIONS[name] for name in recordings if name in VERSIONS}
    shape = FleetShape(size, args.pods_per_policy, args.policies_per_namespace, args.interval, recordings,
                       versions, args.source, args.workers, args.keep_read_series)  # fmt: skip
    with fleet_on_cluster(e2e, network_module, folder, shape) as world:
        plan, cluster = world.fleet, world.cluster
        print(f"fleet of {size}: {plan.pods} pods in {len(plan.namespaces)} namespaces, made in "
              f"{world.made_in_s:.0f} s", flush=True)  # fmt: skip
        port = free_port()
        before_start = apiserver_metrics(cluster)
        pinned = [] if args.operator_cpus == "all" else ["taskset", "-c", args.operator_cpus]
        operator = e2e.chart_operator(
            cluster, RELEASE, SYSTEM, folder / "operator.log", metrics_port=port, wrapper=pinned
        ).start()
        try:
            assert operator.process is not None
            pid = operator.process.pid
            rss = PeakRss(pid)
            started = time.monotonic()

            def evaluated() -> int:
                try:
                    return len(evaluation_times(operator_metrics(port)))
                except httpx.HTTPError:
                    return 0

            settle: float | None = None
            try:
                e2e.wait_for(f"the operator to evaluate all {size} policies", lambda: evaluated() >= size,
                             timeout=args.settle_timeout, every=2.0)  # fmt: skip
                settle = time.monotonic() - started
            except AssertionError as err:
                print(f"fleet of {size}: {err}", flush=True)
            if args.warmup > 0:  # a benchmark's duration, not a wait for an event
                print(f"fleet of {size}: warming up {args.warmup:g} s (the first plans)", flush=True)
                time.sleep(args.warmup)
            ticks = os.sysconf("SC_CLK_TCK")
            api_before, ours_before = apiserver_metrics(cluster), operator_metrics(port)
            queries_before = prometheus_queries(metrics_of(world.prometheus)) if world.prometheus else {}
            cpu_before, at_before = (
                cpu_seconds(Path(f"/proc/{pid}/stat").read_text(), ticks),
                time.monotonic(),
            )
            time.sleep(args.window)  # the measured window: a benchmark's duration, not a wait for an event
            cpu_after, at_after = cpu_seconds(Path(f"/proc/{pid}/stat").read_text(), ticks), time.monotonic()
            api_after, ours_after = apiserver_metrics(cluster), operator_metrics(port)
            queries_after = prometheus_queries(metrics_of(world.prometheus)) if world.prometheus else {}
            peak = rss.stop()
        finally:
            operator.stop()
    seconds = at_after - at_before
    lag_before, lag_after = lag_buckets(ours_before), lag_buckets(ours_after)
    count = lag_after.get(float("inf"), 0.0) - lag_before.get(float("inf"), 0.0)
    watches = sum(watches_held(api_after).values()) - sum(watches_held(before_start).values())
    queries = sum(rates(queries_before, queries_after, seconds).values()) if world.prometheus else None
    return FleetFigures(
        source=args.source,
        policies=size, pods=plan.pods, namespaces=len(plan.namespaces), interval_s=args.interval,
        window_s=seconds, settle_s=settle, evaluated=len(evaluation_times(ours_after)),
        evaluations_per_s=count / seconds, cpu_percent=100 * (cpu_after - cpu_before) / seconds,
        rss_peak_mib=peak / 2**20, lag_p50_s=quantile(0.5, lag_before, lag_after),
        lag_p99_s=quantile(0.99, lag_before, lag_after),
        requests_per_s=rates(requests_by_verb(api_before), requests_by_verb(api_after), seconds),
        watches=int(watches),
        failed={kind: n - failures(ours_before).get(kind, 0.0) for kind, n in failures(ours_after).items()},
        queries_per_s=queries,
        own_requests_per_s=rates(own_requests_by_verb(ours_before), own_requests_by_verb(ours_after), seconds),
        qps_limit=chart_qps(operator.args),
    )  # fmt: skip


def chart_qps(args: list[str]) -> float | None:
    """The operator's --kube-api-qps, as the chart's args give it."""
    return float(args[args.index("--kube-api-qps") + 1]) if "--kube-api-qps" in args else None


def pinning(cpus: str) -> str:
    return (
        "unpinned"
        if cpus == "all"
        else f"pinned to CPU {cpus} (`taskset -c {cpus}`; the rest share both cores)"
    )


def format_section(args: argparse.Namespace, rows: list[FleetFigures], machine: str, revision: str) -> str:
    source = (
        "through `target.podEndpoints` (a selector-less Service and its EndpointSlice)"
        if args.source == "pods"
        else "through `metrics.prometheus` with `byPod` (Prometheus 3 from `local_cluster.py up --monitoring`, "
        "scraping every pod through the chart's PodMonitor at the policies' interval; Prometheus queries per "
        "second from its own `prometheus_http_requests_total`)"
    )
    method = (
        f"`kvtune bench fleet --source {args.source} --policies {args.policies} --pods-per-policy {args.pods_per_policy} "
        f"--policies-per-namespace {args.policies_per_namespace} --interval {args.interval} --window "
        f"{args.window:g} --warmup {args.warmup:g} --operator-cpus {args.operator_cpus}{' --workers ' + str(args.workers) if args.workers else ''}{' --keep-read-series' if args.keep_read_series else ''}` at {revision}, on {machine}, shared by everything below. Each size on a fresh local "
        "control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kwok), the chart installed "
        "watching the fleet's namespaces, and the operator run as a process with the chart's args (its default "
        "client-side limit: 20 requests/s, bursts of 30; 16 evaluations at once) and a token of "
        f"its ServiceAccount, {pinning(args.operator_cpus)}. Each policy is Recommend, engine vllm, over its Deployment's pods on kwok nodes "
        f"{source}; every pod's /metrics is "
        "served by one replay process in the pods' network namespace, replaying a real engine's recorded "
        f"scrapes ({', '.join(f'docs/examples/{n}.prom' for n in args.recordings.split(','))}, dealt to the "
        "policies in turn) in a loop, counters carried on across loops. The operator starts with every policy "
        "in place; once it has evaluated each once"
        f"{f' and {args.warmup:g} s more (its first plans)' if args.warmup else ''}, a window of "
        f"{args.window:g} s: operator CPU (utime + stime from /proc, % of one core) and peak RSS (VmRSS every "
        "second from its start); tick lag p50 / p99 from `kvtune_operator_evaluation_lag_seconds` (from a "
        "policy's interval running out to its evaluation recorded, bucket-interpolated); evaluations per second "
        "against policies / interval; kube-apiserver's `apiserver_request_total` per second by verb on the "
        "resources the operator uses (kvtuningpolicies, endpointslices, events, deployments, replicasets, pods, "
        'secrets, kopfpeerings); watches: `apiserver_longrunning_requests{verb="WATCH"}` during the window '
        "less before the operator's start."
    )
    title = f"## The operator over a fleet of policies and pods, metrics from {args.source} (`kvtune bench fleet`)"
    return f"{title}\n\n{textwrap.fill(method, 110, break_on_hyphens=False)}\n\n{chr(10).join(table(rows))}\n"
