"""`kvtune demo [--quick] [--out DIR] [--port N]`: the live demo, then its report; Ctrl-C or SIGTERM stop
every child it started (the engine's process group) before it exits."""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import signal
import sys
from pathlib import Path
from types import FrameType

from kvtune.demo.engine import check_port_free
from kvtune.demo.report_summary import figures_line
from kvtune.demo.run import FULL, QUICK, Demo
from kvtune.demo.timeline import Timeline
from kvtune.demo.view import LiveView
from kvtune.harness.local_http import free_port


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="a shortened demo (for tests): shorter windows")
    p.add_argument("--out", type=Path, default=Path("demo-report"), help="the report's folder")
    p.add_argument("--port", type=int, help="the engine's port (default: a free one)")


def _interrupt(signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def write_outputs(timeline: Timeline, out_dir: Path) -> Path:
    """timeline.json always (the run's raw record); the report from kvtune.demo.report."""
    (out_dir / "timeline.json").write_text(json.dumps(timeline.to_json(), indent=2) + "\n")
    from kvtune.demo.report import write_report  # matplotlib: loaded only when a report is written

    path: Path = write_report(timeline, out_dir)
    return path


def run(args: argparse.Namespace) -> int:
    port = args.port if args.port is not None else free_port()
    check_port_free(port)
    out_dir: Path = args.out
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "children.txt").write_text("")
    signal.signal(signal.SIGTERM, _interrupt)
    # `kill -USR1 PID` prints where every thread of the demo is (a stop that hangs says where, and why)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    operator_log = logging.getLogger("kvtune.operator")  # its lines go to a file, not over the live view
    operator_log.addHandler(logging.FileHandler(out_dir / "operator.log"))
    operator_log.setLevel(logging.INFO)
    operator_log.propagate = False
    view = LiveView()
    try:
        timeline = Demo(QUICK if args.quick else FULL, port, out_dir, view, args.quick).run()
    except KeyboardInterrupt:
        # Demo.run has stopped the engine and the load on its way out. End now: the interpreter's own exit
        # would join whatever helper threads the HTTP clients left behind, and a Ctrl-C must not hang.
        view.close()
        sys.stderr.write("interrupted: the engine and the load are stopped\n")
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(130)
    finally:
        view.close()
    for name, measured in (("before", timeline.before), ("after", timeline.after)):
        print(f"{name}: {figures_line(measured)}", flush=True)
    failed = sum(sum(causes.values()) for causes in timeline.failures.values())
    print(f"requests: {timeline.meta['requests_sent']:,} sent, {failed:,} failed; duration "
          f"{timeline.meta['duration_s']} s", flush=True)  # fmt: skip
    path = write_outputs(timeline, out_dir)
    sys.stdout.write(f"report: {path}\n")
    return 0
