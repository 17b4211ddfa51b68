"""`kvtune operator`: in a cluster, kopf runs the handlers over KVTuningPolicy resources (`--namespace`,
repeatable, or `--all-namespaces`); `--local --target URL --admin-token-file F` runs the same tuning loop
against one engine without Kubernetes, and `--local --target URL --proxy URL --proxy-admin-token-file F`
against a vLLM or SGLang engine behind a kvtune proxy (the cap set through the proxy). Both serve the
operator's own metrics on `--metrics-port` (default 9100; 0: none).
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
import time
from pathlib import Path
from types import FrameType

from kvtune.contract.knobs import KNOB_MAX_NUM_SEQS
from kvtune.errors import KvtuneError
from kvtune.operator.decide.diagnosis import Diagnosis, known
from kvtune.operator.decide.loop import Tick, run_loop
from kvtune.operator.decide.policy import Mode, TuningPolicy
from kvtune.operator.decide.ports import Actuator, MetricSource
from kvtune.operator.io.actuators import PROXY_KNOBS, ComposedActuator, KvtuneAdminActuator
from kvtune.operator.io.own_metrics import DEFAULT_PORT, OperatorMetrics
from kvtune.operator.io.sources import EngineWithProxy, MetricsEndpoint, url_problem
from kvtune.operator.k8s.kube_api import DEFAULT_BURST, DEFAULT_QPS, DEFAULT_WORKERS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--local", action="store_true", help="tune one engine directly, without Kubernetes")
    parser.add_argument("--target", help="the engine's base URL (its /metrics and /admin/config)")
    parser.add_argument("--admin-token-file", help="file holding the engine's admin bearer token")
    parser.add_argument(
        "--proxy",
        metavar="URL",
        help="a kvtune proxy in front of a vLLM / SGLang --target: its /metrics is read beside the engine's "
        "and the max_tokens cap is set through its admin API",
    )
    parser.add_argument("--proxy-admin-token-file", help="file holding the proxy's admin bearer token")
    parser.add_argument(
        "--proxy-admin-url",
        metavar="URL",
        help="the proxy's admin API when it has its own port (default: --proxy)",
    )
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between samples")
    parser.add_argument("--mode", choices=[m.value for m in Mode], default=Mode.APPLY.value)
    parser.add_argument("--evaluation-window", type=float, help="seconds (default: 3 intervals)")
    parser.add_argument(
        "--cooldown", type=float, help="seconds between actions (default: the evaluation window)"
    )
    parser.add_argument("--min-max-num-seqs", type=int, default=TuningPolicy.min_max_num_seqs)
    parser.add_argument("--max-max-num-seqs", type=int, default=TuningPolicy.max_max_num_seqs)
    parser.add_argument("--max-step", type=int, default=TuningPolicy.max_step)
    parser.add_argument("--cap-floor", type=int, default=TuningPolicy.cap_floor)
    parser.add_argument("--allow-fp8", action="store_true")
    parser.add_argument("--shared-prefix-tokens", type=int, default=0)
    parser.add_argument("--no-predict", action="store_true",
                        help="measured stepping only: no what-if fit and predicted move of max_num_seqs")  # fmt: skip
    parser.add_argument("--objective", choices=("NoPreemption", "Goodput"), default="NoPreemption",
                        help="what the predicted move maximises (Goodput needs --p95-wait-bound)")  # fmt: skip
    parser.add_argument("--p95-wait-bound", type=float, metavar="SECONDS",
                        help="Goodput's bound on the predicted p95 queue wait")  # fmt: skip
    parser.add_argument("--round-to", type=int, default=1,
                        help="max_num_seqs in multiples of this (8 for vLLM on CUDA: its CUDA graphs)")  # fmt: skip
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=DEFAULT_PORT,
        help=f"serve the operator's own /metrics on this port (default {DEFAULT_PORT}; 0: do not serve)",
    )
    parser.add_argument("--duration", type=float, help="stop after this many seconds (default: run until ^C)")
    parser.add_argument(
        "--namespace", "-n", action="append", default=[], help="in cluster: watch this namespace (repeatable)"
    )
    parser.add_argument(
        "--all-namespaces", "-A", action="store_true", help="in cluster: watch every namespace"
    )
    parser.add_argument(
        "--liveness-port",
        type=int,
        help="in cluster: serve kopf's health check on http://0.0.0.0:PORT/healthz (the pod's probes)",
    )
    parser.add_argument(
        "--max-mode",
        choices=[m.value for m in Mode],
        default=Mode.RECOMMEND.value,
        help="in cluster: the highest mode any KVTuningPolicy runs in (default Recommend: acting is an explicit "
        "choice); a policy asking for more runs at this mode, with condition ModeCapped (the chart sets it "
        "from maxMode)",
    )
    parser.add_argument(
        "--delete-policies",
        action="store_true",
        help="in cluster, once: delete every KVTuningPolicy in the --namespace(s) (or -A) and wait until the "
        "running operator has released them; for uninstalling (the chart's uninstall.deletePolicies hook)",
    )
    parser.add_argument(
        "--timeout", type=float, default=120.0, help="--delete-policies: seconds to wait (default 120)"
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=DEFAULT_WORKERS,
        help=f"in cluster: policy evaluations run at once, whatever the number of policies (default {DEFAULT_WORKERS})",
    )
    parser.add_argument(
        "--kube-api-qps",
        type=float,
        default=DEFAULT_QPS,
        help=f"in cluster: the operator's own API requests per second, sustained (client-side token bucket, "
        f"as controller-runtime's; default {DEFAULT_QPS:g}); kopf's watches are apart",
    )
    parser.add_argument(
        "--kube-api-burst",
        type=int,
        default=DEFAULT_BURST,
        help=f"in cluster: API requests allowed at once above --kube-api-qps (default {DEFAULT_BURST})",
    )
    parser.add_argument(
        "--peering",
        metavar="NAME",
        help="in cluster: coordinate replicas through the kopf peering object NAME (one acts, the others "
        "stand by); without it the operator runs standalone",
    )


def tick_line(note: str, d: Diagnosis) -> str:
    """One tick as the local loop logs it: a figure it could not read (no sample, a corrupt series) says
    `unknown`, never 0, so an on-call can tell an idle engine from one whose metrics are broken."""
    return (
        f"{note}; preemptions {known(d.preemption_rate, '.2f')}/s, KV usage max {known(d.kv_usage_max, '.0%')}, "
        f"waiting {known(d.waiting_mean, '.1f')}, goodput {known(d.goodput, '.0f')} tokens/s"
    )


def policy_from_args(args: argparse.Namespace) -> TuningPolicy:
    evaluation = args.evaluation_window if args.evaluation_window is not None else 3 * args.interval
    try:
        return TuningPolicy(
            mode=Mode(args.mode),
            min_max_num_seqs=args.min_max_num_seqs,
            max_max_num_seqs=args.max_max_num_seqs,
            cap_floor=args.cap_floor,
            evaluation_window_s=evaluation,
            cooldown_s=args.cooldown if args.cooldown is not None else evaluation,
            max_step=args.max_step,
            allow_fp8=args.allow_fp8,
            shared_prefix_tokens=args.shared_prefix_tokens,
            predict=not args.no_predict,
            objective=args.objective,
            p95_wait_bound_s=args.p95_wait_bound,
            round_to=args.round_to,
        )
    except ValueError as err:
        raise KvtuneError(str(err)) from None


def serve_own_metrics(port: int, max_mode: Mode = Mode.APPLY) -> OperatorMetrics:
    """The operator's metrics registry, served on `port` unless it is 0."""
    if not 0 <= port <= 65535:
        raise KvtuneError(f"--metrics-port {port}: must be 0-65535")
    metrics = OperatorMetrics(max_mode.value)
    if port:
        try:
            metrics.serve(port)
        except OSError as err:
            raise KvtuneError(f"--metrics-port {port}: {err.strerror or err}") from None
        logging.getLogger("kvtune.operator").info("the operator's metrics on :%d/metrics", port)
    return metrics


def run_in_cluster(args: argparse.Namespace) -> int:
    """kopf's operator loop with our handlers: standalone, or with --peering NAME beside other replicas
    (see `peering` for which object must exist and how the active replica is chosen)."""
    if bool(args.namespace) == bool(args.all_namespaces):
        raise KvtuneError("the in-cluster operator needs --namespace NS (repeatable) or --all-namespaces")
    if args.liveness_port is not None and not 1 <= args.liveness_port <= 65535:
        raise KvtuneError(f"--liveness-port {args.liveness_port}: must be 1-65535")
    if not 1 <= args.workers <= 256:
        raise KvtuneError(f"--workers {args.workers}: must be 1-256")
    if args.kube_api_qps <= 0 or args.kube_api_burst < 1:
        raise KvtuneError(
            f"--kube-api-qps {args.kube_api_qps:g} / --kube-api-burst {args.kube_api_burst}: "
            "need a rate above 0 and a burst of at least 1"
        )
    if args.peering is not None and not args.peering.strip():
        raise KvtuneError("--peering needs a name (the KopfPeering / ClusterKopfPeering object)")
    import kopf

    import kvtune.operator.k8s.handlers  # noqa: F401  (registers the handlers)
    from kvtune.operator.k8s.peering import kopf_peering_arguments

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s [%(name)s] %(message)s")
    max_mode = Mode(args.max_mode)
    metrics = serve_own_metrics(args.metrics_port, max_mode)
    liveness = f"http://0.0.0.0:{args.liveness_port}/healthz" if args.liveness_port else None
    logging.getLogger("kvtune.operator").info("no policy runs above mode %s (--max-mode)", max_mode.value)
    kopf.run(clusterwide=args.all_namespaces, namespaces=args.namespace, liveness_endpoint=liveness,
             memo=kopf.Memo(operator_metrics=metrics, max_mode=max_mode, workers=args.workers,
                            kube_api_qps=args.kube_api_qps, kube_api_burst=args.kube_api_burst),
             **kopf_peering_arguments(args.peering))  # fmt: skip
    return 0


def read_token(flag: str, path: str) -> str:
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except OSError as err:
        raise KvtuneError(f"{flag} {path}: {err.strerror or err}") from None
    if not token:
        raise KvtuneError(f"{flag} {path} is empty")
    return token


def checked_url(flag: str, url: str) -> str:
    problem = url_problem(url)
    if problem is not None:
        raise KvtuneError(f"{flag}: {problem}")
    return url


def local_wiring(args: argparse.Namespace) -> tuple[MetricSource, Actuator]:
    """Where the local loop reads and acts. A kvtune engine: its /metrics and admin API. With --proxy (a
    vLLM or SGLang target): both /metrics merged, the cap through the proxy's admin API, and max_num_seqs
    through the engine's admin API only when it has one (--admin-token-file: a kvtune engine behind the
    proxy); otherwise max_num_seqs is advice (without Kubernetes there is no Deployment to patch)."""
    if not args.target:
        raise KvtuneError("--local needs --target URL")
    target = checked_url("--target", args.target)
    if args.proxy is None:
        if args.proxy_admin_token_file or args.proxy_admin_url:
            raise KvtuneError("--proxy-admin-token-file and --proxy-admin-url need --proxy URL")
        if not args.admin_token_file:
            raise KvtuneError("--local needs --target URL and --admin-token-file F (or --proxy URL)")
        token = read_token("--admin-token-file", args.admin_token_file)
        return MetricsEndpoint(target), KvtuneAdminActuator(target, token)
    proxy = checked_url("--proxy", args.proxy)
    if not args.proxy_admin_token_file:
        raise KvtuneError("--proxy needs --proxy-admin-token-file F (the proxy's admin bearer token)")
    proxy_admin = checked_url("--proxy-admin-url", args.proxy_admin_url or proxy)
    proxy_token = read_token("--proxy-admin-token-file", args.proxy_admin_token_file)
    parts: list[Actuator] = [
        KvtuneAdminActuator(proxy_admin, proxy_token, knobs=PROXY_KNOBS, name="proxy admin API")
    ]
    if args.admin_token_file:
        engine_token = read_token("--admin-token-file", args.admin_token_file)
        parts.append(KvtuneAdminActuator(target, engine_token, knobs=frozenset({KNOB_MAX_NUM_SEQS})))
    source = EngineWithProxy(MetricsEndpoint(target), MetricsEndpoint(proxy))
    return source, ComposedActuator(parts)


def run(args: argparse.Namespace) -> int:
    if args.delete_policies:
        if args.local or bool(args.namespace) == bool(args.all_namespaces):
            raise KvtuneError("--delete-policies needs --namespace NS (repeatable) or --all-namespaces")
        from kvtune.operator.k8s import uninstall

        return uninstall.run(args.namespace, args.timeout)
    if not args.local:
        return run_in_cluster(args)
    from kvtune.operator.io.local_metrics import LocalRecorder  # prometheus_client's registry: only when run

    if args.interval <= 0:
        raise KvtuneError(f"--interval must be positive, got {args.interval}")
    source, actuator = local_wiring(args)
    policy = policy_from_args(args)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s [%(name)s] %(message)s")
    record = LocalRecorder(serve_own_metrics(args.metrics_port), args.target, policy, args.interval)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    if args.duration is not None:
        threading.Timer(args.duration, stop.set).start()
    log = logging.getLogger("kvtune.operator")

    def on_tick(tick: Tick) -> None:
        proxy_problem = source.proxy_problem if isinstance(source, EngineWithProxy) else None
        record(tick, proxy_problem)  # logs each finding (proxy metrics missing, corrupt metrics...) once
        if tick.decision is not None and not tick.applied:
            log.info("%s", tick_line(tick.decision.note, tick.decision.diagnosis))

    via = f" through the proxy {args.proxy}" if args.proxy else ""
    log.info("tuning %s%s every %.1f s (mode %s)", args.target, via, args.interval, policy.mode.value)
    try:
        run_loop(source, actuator, policy, args.interval, stop, on_tick, time.time)
    except KeyboardInterrupt:
        stop.set()
    return 0
