"""`kvtune bench connections`: what idle and slow clients cost both fronts at their default deadlines.

`kvtune serve` (the tiny model) and `kvtune proxy` in front of it run as child processes with their
default `--header-timeout` and `--idle-timeout`. For each front: `/health` timed by one client on its own
(the peer), then while 1,000 connections that send nothing are open (three crowds in a row), how long
those connections live before the front closes them, and when a slowloris client (a header byte every
0.25 s) is cut off. The figures go to BENCHMARKS.md with the machine line.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvtune.bench.connection_probes import idle_crowd, slowloris
from kvtune.front.connections import DEFAULT_HEADER_TIMEOUT_S, DEFAULT_IDLE_TIMEOUT_S
from kvtune.harness.engine_process import write_tiny_model_in_subprocess
from kvtune.harness.local_http import free_port
from kvtune.harness.server import ServerProcess, cli_argv

SECTION = "connections"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass(frozen=True)
class FrontFigures:
    front: str
    quiet: list[float]  # /health seconds, nobody else connected
    crowded: list[float]  # /health seconds while the idle connections were open
    failures: int  # /health answers other than 200 while crowded
    lifetimes: list[float]  # seconds each idle connection lived
    still_open: int  # idle connections the front never closed
    slowloris_s: float
    slowloris_answer: str


def quiet_health(url: str, count: int) -> list[float]:
    times = []
    with httpx.Client(base_url=url, timeout=30) as http:
        for _ in range(count):
            began = time.perf_counter()
            assert http.get("/health").status_code == 200
            times.append(time.perf_counter() - began)
            time.sleep(0.01)
    return times


def measure(front: str, url: str, idle: int, crowds: int, quiet: int) -> FrontFigures:
    calm = quiet_health(url, quiet)
    crowded: list[float] = []
    lifetimes: list[float] = []
    failures = still_open = 0
    for _ in range(crowds):
        crowd = idle_crowd(url, idle)
        crowded += crowd.health
        lifetimes += crowd.lifetimes
        failures += len(crowd.health_failures)
        still_open += crowd.still_open
    cut = slowloris(url)
    answer = cut.answer.split(b"\r\n", 1)[0].decode(errors="replace") or "(closed, no answer)"
    return FrontFigures(front, calm, crowded, failures, lifetimes, still_open, cut.seconds, answer)


@contextmanager
def child(command: list[str], port: int, log: Path, name: str) -> Iterator[None]:
    with ServerProcess(command, port, log, name=name, append=True) as server:
        server.wait_ready(300)
        yield


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}"


def format_table(rows: list[FrontFigures]) -> str:
    lines = [
        "| front | /health p50 / p99 ms, alone | /health p50 / p99 ms, 1,000 idle open | /health answers | "
        "idle connections closed after, s | slowloris cut after, s |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        closed = f"{min(r.lifetimes):.2f}-{max(r.lifetimes):.2f} ({len(r.lifetimes):,} closed, {r.still_open} left)"
        lines.append(
            f"| {r.front} | {ms(statistics.median(r.quiet))} / {ms(percentile(r.quiet, 0.99))} | "
            f"{ms(statistics.median(r.crowded))} / {ms(percentile(r.crowded, 0.99))} | "
            f"{len(r.crowded) - r.failures:,} of {len(r.crowded):,} 200 | {closed} | "
            f"{r.slowloris_s:.2f} ({r.slowloris_answer}) |"
        )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--idle", type=int, default=1000, help="idle connections per crowd (default 1,000)")
    parser.add_argument("--crowds", type=int, default=3, help="crowds in a row per front (default 3)")
    parser.add_argument("--quiet", type=int, default=300, help="/health requests alone (default 300)")
    parser.add_argument("--log-dir", type=Path, default=Path(".bench-logs"))
    parser.add_argument("--output", type=Path, default=Path("BENCHMARKS.md"))
    parser.add_argument("--no-record", action="store_true", help="print only; leave BENCHMARKS.md alone")


def run(args: argparse.Namespace) -> int:
    from kvtune.bench.benchmarks_md import git_revision, machine_description, record_section

    args.log_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvtune-connections-") as folder:
        model = write_tiny_model_in_subprocess(Path(folder) / "tiny")
        engine_port, proxy_port = free_port(), free_port()
        engine, proxy = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{proxy_port}"
        serve = cli_argv("serve", "--model", str(model), "--served-model-name", "tiny", "--port",
                               str(engine_port), "--threads", "1", "--log-stats-interval", "0")  # fmt: skip
        front = cli_argv("proxy", "--upstream", engine, "--model-dir", str(model), "--port", str(proxy_port))
        rows = []
        with child(serve, engine_port, args.log_dir / "connections-engine.log", "kvtune serve"):
            rows.append(measure("kvtune serve", engine, args.idle, args.crowds, args.quiet))
            with child(front, proxy_port, args.log_dir / "connections-proxy.log", "kvtune proxy"):
                rows.append(measure("kvtune proxy", proxy, args.idle, args.crowds, args.quiet))
    table = format_table(rows)
    print(table)
    if not args.no_record:
        machine, revision = machine_description(), git_revision()
        record_section(SECTION, f"""## Connections: idle and slow clients at the default deadlines

`kvtune bench connections --idle {args.idle} --crowds {args.crowds}` at {revision}, on {machine}. Each front
runs with its defaults (`--idle-timeout {DEFAULT_IDLE_TIMEOUT_S:g}`, `--header-timeout {DEFAULT_HEADER_TIMEOUT_S:g}`);
the proxy's /health asks the engine's. `/health` is timed by one client, alone ({args.quiet} requests, the peer)
and while {args.idle:,} connections that send nothing are open ({args.crowds} crowds in a row); the slowloris
client sends a header byte every 0.25 s.

{table}
""", args.output)  # fmt: skip
    return 0 if all(r.failures == 0 and r.still_open == 0 for r in rows) else 1
