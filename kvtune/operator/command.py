"""`kvtune operator`: in a cluster, kopf runs the handlers over KVTuningPolicy resources (`--namespace`,
repeatable, or `--all-namespaces`); `--local --target URL --admin-token-file F` runs the same tuning loop
against one engine without Kubernetes.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
import time
from pathlib import Path
from types import FrameType

from kvtune.errors import KvtuneError
from kvtune.operator.actuators import KvtuneAdminActuator
from kvtune.operator.local import Tick, run_loop
from kvtune.operator.policy import Mode, TuningPolicy
from kvtune.operator.sources import MetricsEndpoint, url_problem


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--local", action="store_true", help="tune one engine directly, without Kubernetes")
    parser.add_argument("--target", help="the engine's base URL (its /metrics and /admin/config)")
    parser.add_argument("--admin-token-file", help="file holding the engine's admin bearer token")
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
    parser.add_argument("--duration", type=float, help="stop after this many seconds (default: run until ^C)")
    parser.add_argument(
        "--namespace", "-n", action="append", default=[], help="in cluster: watch this namespace (repeatable)"
    )
    parser.add_argument(
        "--all-namespaces", "-A", action="store_true", help="in cluster: watch every namespace"
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
        )
    except ValueError as err:
        raise KvtuneError(str(err)) from None


def run_in_cluster(args: argparse.Namespace) -> int:
    """kopf's operator loop with our handlers, standalone (one replica; no peering resource needed)."""
    if bool(args.namespace) == bool(args.all_namespaces):
        raise KvtuneError("the in-cluster operator needs --namespace NS (repeatable) or --all-namespaces")
    import kopf

    import kvtune.operator.handlers  # noqa: F401  (registers the handlers)

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s [%(name)s] %(message)s")
    kopf.run(standalone=True, clusterwide=args.all_namespaces, namespaces=args.namespace)
    return 0


def run(args: argparse.Namespace) -> int:
    if not args.local:
        return run_in_cluster(args)
    if not args.target or not args.admin_token_file:
        raise KvtuneError("--local needs --target URL and --admin-token-file F")
    problem = url_problem(args.target)
    if problem is not None:
        raise KvtuneError(f"--target: {problem}")
    if args.interval <= 0:
        raise KvtuneError(f"--interval must be positive, got {args.interval}")
    try:
        token = Path(args.admin_token_file).read_text(encoding="utf-8").strip()
    except OSError as err:
        raise KvtuneError(f"--admin-token-file {args.admin_token_file}: {err.strerror or err}") from None
    if not token:
        raise KvtuneError(f"--admin-token-file {args.admin_token_file} is empty")
    policy = policy_from_args(args)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s [%(name)s] %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    if args.duration is not None:
        threading.Timer(args.duration, stop.set).start()
    log = logging.getLogger("kvtune.operator")

    def on_tick(tick: Tick) -> None:
        if tick.decision is not None and not tick.applied:
            d = tick.decision.diagnosis
            log.info(
                "%s; preemptions %.2f/s, KV usage max %s, waiting %.1f, goodput %.0f tokens/s",
                tick.decision.note, d.preemption_rate or 0, f"{d.kv_usage_max or 0:.0%}",
                d.waiting_mean or 0, d.goodput or 0,
            )  # fmt: skip

    source = MetricsEndpoint(args.target)
    actuator = KvtuneAdminActuator(args.target, token)
    log.info("tuning %s every %.1f s (mode %s)", args.target, args.interval, policy.mode.value)
    try:
        run_loop(source, actuator, policy, args.interval, stop, on_tick, time.time)
    except KeyboardInterrupt:
        stop.set()
    return 0
