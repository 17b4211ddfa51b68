"""`kvtune bench autoscale`: kvtune's replica signal against production-stack's default (KEDA on
`vllm:num_requests_waiting`, threshold 5) and a KV-usage threshold (AIBrix's 0.3 per pod), each sizing the
same Deployment of real engines through the same KEDA and HPA on the local control plane, under the same
closed-loop load stepped 1x -> 3x -> 1x of one replica's ceiling.

The engines run the policy's admission (max_num_seqs pinned, Recommend mode) so the three runs differ in the
replica signal only. One replica's ceiling is what its pool holds at the longest requests, at that
admission: 1x is that many clients. The load goes to the engine with the fewest requests in flight, as a
least-request router sends it. Each run samples the Deployment's replicas and the engines' preemption
counters every second; each step's p95 queue wait is its requests' p95 time to first token (the wait plus
a prefill of 10-20 tokens).

It drives the local control plane and the e2e harness (scripts/local_cluster.py, tests/e2e), so it runs from
a repository checkout, as root (the pods' network namespace), after `make k8s-tools monitoring-tools
keda-tools`.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

from kvtune.bench.autoscale_signals import (
    KV_USAGE,
    KVTUNE,
    WAITING_QUEUE,
    Point,
    RunFigures,
    figures,
    signals,
    table,
)

SECTION = "autoscale"
REPO = Path(__file__).resolve().parents[2]
RELEASE, SYSTEM, NAMESPACE = "kvtune", "kvtune-system", "bench-autoscale"
DEPLOYMENT, POLICY = "bench-engines", "bench"
# each request at most 20 + 240 tokens (17 blocks of 16; up to about 290 tokens as the engines' 12%-wide length
# buckets read it): a pool of 1,216 tokens holds MAX_NUM_SEQS of them at their longest, so admission never
# preempts and one replica's ceiling is MAX_NUM_SEQS clients
MAX_NUM_SEQS, KV_CACHE_TOKENS = 4, 1216
PROMPT_LEN, OUTPUT_LEN = (10, 20), (200, 240)
SCALE_DOWN = {"stabilizationWindowSeconds": 15, "podsPerPeriod": 1, "periodSeconds": 10}
POLLING_S = 5  # KEDA's query interval (its default is 30 s; production-stack's chart sets 15)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--signals", default=f"{KVTUNE},{WAITING_QUEUE},{KV_USAGE}",
                        help="which signals to run, in order (default all three)")  # fmt: skip
    parser.add_argument("--clients", type=int, default=MAX_NUM_SEQS,
                        help=f"1x, in clients: one replica's ceiling (default {MAX_NUM_SEQS})")  # fmt: skip
    parser.add_argument(
        "--steps", default="60,180,150", help="seconds at 1x, 3x and 1x again (default 60,180,150)"
    )
    parser.add_argument("--max-replicas", type=int, default=4)
    parser.add_argument("--window", type=float, default=15.0, help="the policy's evaluation window, seconds")
    parser.add_argument("--bound", type=float, default=0.3, help="the policy's p95 queue-wait bound, seconds")
    parser.add_argument("--log-dir", type=Path, default=Path(".bench-logs"))
    parser.add_argument("--json", type=Path, help="also write each run's timeline as JSON here")
    parser.add_argument("--output", type=Path, default=Path("BENCHMARKS.md"))
    parser.add_argument("--no-record", action="store_true", help="print only; leave BENCHMARKS.md alone")


def run(args: argparse.Namespace) -> int:
    from kvtune.bench.benchmarks_md import git_revision, machine_description, record_section
    from kvtune.errors import KvtuneError

    chosen = [name.strip() for name in args.signals.split(",") if name.strip()]
    known = (KVTUNE, WAITING_QUEUE, KV_USAGE)
    steps = [float(s) for s in args.steps.split(",")]
    if not chosen or any(name not in known for name in chosen):
        raise KvtuneError(f"--signals takes a comma-separated list of {', '.join(known)}")
    if len(steps) != 3 or min(steps) <= 0 or args.clients < 1 or args.max_replicas < 2:
        raise KvtuneError(
            "--steps is three positive durations; --clients is at least 1, --max-replicas at least 2"
        )
    if not (REPO / "tests" / "e2e" / "autoscale_world.py").exists():
        raise KvtuneError(
            "kvtune bench autoscale drives the local control plane and the e2e harness: run it from a "
            "repository checkout (scripts/local_cluster.py, tests/e2e)"
        )
    sys.path.insert(0, str(REPO))
    args.log_dir.mkdir(parents=True, exist_ok=True)
    runs: list[RunFigures] = []
    timelines: dict[str, list[dict[str, Any]]] = {}
    for name in chosen:
        found, points = one_run(name, args, steps)
        runs.append(found)
        timelines[name] = [p.__dict__ for p in points]
        print("\n".join(table(runs)), flush=True)
    if args.json:
        args.json.write_text(json.dumps(timelines, indent=1))
    if not args.no_record:
        record_section(SECTION, format_section(args, steps, runs, machine_description(), git_revision()),
                       args.output)  # fmt: skip
    return 0


def one_run(name: str, args: argparse.Namespace, steps: list[float]) -> tuple[RunFigures, list[Point]]:
    """A fresh control plane, the chart, the engines at one replica, and `name`'s ScaledObject; the load in
    its three steps; the figures."""
    from kvtune.harness.local_http import free_port

    # the e2e harness, from the checkout (not part of the package, so imported by name)
    world = importlib.import_module("tests.e2e.autoscale_world")
    e2e = importlib.import_module("tests.e2e.cluster")
    network = importlib.import_module("tests.e2e.pod_network")
    workload = world.Workload(NAMESPACE, DEPLOYMENT, f"{DEPLOYMENT}-engine", POLICY, f"{DEPLOYMENT}-admin")
    folder = Path(tempfile.mkdtemp(prefix=f"autoscale-{name}-", dir=args.log_dir.resolve()))
    print(f"{name}: control plane, chart, operator and engines in {folder}", flush=True)
    with (
        network.pod_network() as pods,
        e2e.control_plane(folder / "control-plane", monitoring=True, keda=True) as cluster,
    ):
        cluster.namespace(NAMESPACE)
        prometheus = cluster.monitoring["prometheus"]
        cluster.helm("install", RELEASE, str(e2e.CHART), "--namespace", SYSTEM, "--create-namespace",
                     "--set", f"image.repository={e2e.REGISTRY}/kvtune-operator",
                     "--set-json", f"watchNamespaces={json.dumps([NAMESPACE])}",
                     "--set-json", f"adminTokenSecrets={json.dumps([workload.secret])}",
                     "--set", "monitoring.serviceMonitor.interval=1s",
                     "--set", "monitoring.podMonitor.enabled=true", "--set", "monitoring.podMonitor.interval=1s",
                     "--set-json", f'monitoring.podMonitor.selector={{"matchLabels":{{"app":"{DEPLOYMENT}"}}}}')  # fmt: skip
        port = free_port()
        operator = e2e.chart_operator(
            cluster, RELEASE, SYSTEM, folder / "operator.log", metrics_port=port
        ).start()
        world.expose_operator_metrics(cluster, RELEASE, SYSTEM, pods.host_address, port)
        flags = ("--kv-cache-tokens", str(KV_CACHE_TOKENS), "--max-num-seqs", str(MAX_NUM_SEQS),
                 "--max-waiting-requests", "-1")  # fmt: skip
        try:
            with world.scaled_engines(cluster, pods, workload, folder, flags) as engines:
                cluster.apply(
                    workload.policy_manifest(args.window, args.bound, MAX_NUM_SEQS, args.max_replicas)
                )
                signal = signals(NAMESPACE, POLICY, f"{DEPLOYMENT}-.*")[name]
                cluster.apply(scaled_object(signal.trigger(prometheus), args.max_replicas))
                shape = world.RequestShape(PROMPT_LEN, OUTPUT_LEN)
                load = world.ClosedLoad(
                    lambda: [e.url for e in engines.engines().values()], shape, args.clients
                ).start()
                # warm-up at 1x, left out of the figures: until the signal's first value reaches KEDA (kvtune's
                # comes an evaluation window into the load; the engines' series at their first scrape)
                e2e.wait_for(f"KEDA's first reading of the {name} signal", lambda: scaled_object_ready(cluster),
                             timeout=20 * args.window)  # fmt: skip
                sampler = Sampler(cluster, engines, world.read_counters)
                began = time.monotonic()
                sampler.start(began)
                bounds = [began]
                for index, (seconds, clients) in enumerate(zip(steps, (1, 3, 1), strict=True)):
                    load.set_clients(clients * args.clients)
                    sampler.step = index
                    print(f"{name}: step {index} ({clients}x, {clients * args.clients} clients) for {seconds:g} s",
                          flush=True)  # fmt: skip
                    time.sleep(seconds)  # the profile's step: a benchmark's duration, not a wait for an event
                    bounds.append(time.monotonic())
                load.stop()
                points = sampler.stop()
        finally:
            operator.stop()
    waits = []
    for start, end in itertools.pairwise(bounds):
        ttfts = sorted(s.ttft for s in load.since(start, end) if s.ttft is not None)
        waits.append(ttfts[min(len(ttfts) - 1, int(0.95 * len(ttfts)))] if ttfts else None)
    failed = sum(not s.ok for s in load.sent)
    print(f"{name}: {len(load.sent)} requests, {failed} failed", flush=True)
    return figures(name, points, waits), points


def scaled_object_ready(cluster: Any) -> bool:
    """KEDA read the trigger's query and found a value (its ScaledObject's Ready condition)."""
    found = cluster.get("scaledobject.keda.sh", DEPLOYMENT, NAMESPACE)
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in found.get("status", {}).get("conditions", []))  # fmt: skip


def scaled_object(trigger: dict[str, object], max_replicas: int) -> dict[str, Any]:
    """The ScaledObject each run gets, alike but for its trigger: the chart's shape (1 to max replicas, the
    same scale-down behaviour) on the bench's Deployment."""
    return {
        "apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject",
        "metadata": {"name": DEPLOYMENT, "namespace": NAMESPACE},
        "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": DEPLOYMENT},
                 "minReplicaCount": 1, "maxReplicaCount": max_replicas, "pollingInterval": POLLING_S,
                 "advanced": {"horizontalPodAutoscalerConfig": {"behavior": {"scaleDown": {
                     "stabilizationWindowSeconds": SCALE_DOWN["stabilizationWindowSeconds"],
                     "policies": [{"type": "Pods", "value": SCALE_DOWN["podsPerPeriod"],
                                   "periodSeconds": SCALE_DOWN["periodSeconds"]}]}}}},
                 "triggers": [trigger]},
    }  # fmt: skip


class Sampler:
    """Every second: the Deployment's spec.replicas and the engines' preemptions, summed over every pod the
    run had (a pod that went keeps its last count)."""

    def __init__(self, cluster: Any, engines: Any, read_counters: Any) -> None:
        self.cluster, self.engines, self.read_counters = cluster, engines, read_counters
        self.step = 0
        self.points: list[Point] = []
        self.preemptions: dict[str, float] = {}
        self.stopping = threading.Event()
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self.sample, name="autoscale sampler", daemon=True)

    def start(self, began: float) -> None:
        self.began = began
        self.thread.start()

    def stop(self) -> list[Point]:
        self.stopping.set()
        self.thread.join(30)
        if self.errors:
            raise self.errors[0]
        return self.points

    def sample(self) -> None:
        from kubernetes import client

        apps = client.AppsV1Api(self.cluster.api)
        try:
            while not self.stopping.wait(1.0):
                for pod, engine in self.engines.engines().items():
                    try:
                        self.preemptions[pod] = self.read_counters(engine.url).preemptions
                    except Exception:
                        continue
                replicas = int(apps.read_namespaced_deployment(DEPLOYMENT, NAMESPACE).spec.replicas or 0)
                self.points.append(Point(round(time.monotonic() - self.began, 1), self.step, replicas,
                                         sum(self.preemptions.values())))  # fmt: skip
        except BaseException as err:
            self.errors.append(err)


def format_section(
    args: argparse.Namespace, steps: list[float], runs: list[RunFigures], machine: str, revision: str
) -> str:
    one_x = args.clients
    method = (
        f"`kvtune bench autoscale --clients {one_x} --steps {args.steps}` at {revision}, on {machine}. Each signal "
        "on a fresh local control plane (kube-apiserver, kube-controller-manager's HPA controller, kwok, "
        "prometheus-operator with Prometheus 3, KEDA v2.20.2's operator and metrics server), one ScaledObject on "
        f"the same Deployment of kvtune engines (`--kv-cache-tokens {KV_CACHE_TOKENS} --max-num-seqs "
        f"{MAX_NUM_SEQS}`: the pool holds {MAX_NUM_SEQS} requests of {PROMPT_LEN[0]}-{PROMPT_LEN[1]} + "
        f"{OUTPUT_LEN[0]}-{OUTPUT_LEN[1]} tokens at their longest, so one replica's ceiling is {MAX_NUM_SEQS} "
        f"clients), 1 to {args.max_replicas} replicas, polling every {POLLING_S} s, scale-down after "
        f"{SCALE_DOWN['stabilizationWindowSeconds']} s of agreement, one pod per {SCALE_DOWN['periodSeconds']} s. "
        f"A closed loop of {one_x}, {3 * one_x}, then {one_x} clients for {' / '.join(f'{s:g}' for s in steps)} s, "
        "each request to the engine with the fewest in flight, after a warm-up at 1x until KEDA first reads the "
        f"signal. kvtune's policy: Recommend, max_num_seqs pinned at {MAX_NUM_SEQS}, evaluation window "
        f"{args.window:g} s, p95 queue-wait bound {args.bound:g} s. The p95 queue wait of a step is its requests' "
        "p95 time to first token (the wait plus a prefill of 10-20 tokens)."
    )
    title = "## Replicas through KEDA: kvtune's signal against the waiting queue and KV usage (`kvtune bench autoscale`)"
    return f"{title}\n\n{textwrap.fill(method, 110, break_on_hyphens=False)}\n\n{chr(10).join(table(runs))}\n"
