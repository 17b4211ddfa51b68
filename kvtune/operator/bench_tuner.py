"""`kvtune bench tuner`: how good is the max_num_seqs the tuner converges to?

On one live engine (tiny model, a pool small enough to preempt) under a steady closed-loop workload, it
first sweeps static max_num_seqs values through the admin API and measures goodput (generated tokens/s
from the engine's own counters) and preemptions for each; the sweep-best is the best goodput with zero
preemptions. Then it sets a too-high start, lets the local-mode tuner converge, and measures the steady
state the same way.
"""

from __future__ import annotations

import argparse
import math
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from kvtune.benchmarks_md import git_revision, machine_description, record_section
from kvtune.errors import KvtuneError
from kvtune.operator.actuators import KvtuneAdminActuator
from kvtune.operator.engine_process import EngineProcess, start_engine, write_tiny_model
from kvtune.operator.load import BackgroundLoad, LoadShape
from kvtune.operator.local import Tick, run_loop
from kvtune.operator.metric_names import GENERATION_TOKENS, PREEMPTIONS
from kvtune.operator.policy import Mode, TuningPolicy
from kvtune.operator.sample import NoData
from kvtune.operator.sources import MetricsEndpoint

TOKEN = "bench-tuner-token"


@dataclass(frozen=True)
class Measured:
    max_num_seqs: int
    goodput: float
    preemptions: float


def measure(source: MetricsEndpoint, seconds: float, max_num_seqs: int) -> Measured:
    first = source.read()
    time.sleep(seconds)
    last = source.read()
    if isinstance(first, NoData) or isinstance(last, NoData):
        raise KvtuneError("the engine's /metrics stopped answering")
    span = last.timestamp - first.timestamp
    generated = last.counters[GENERATION_TOKENS] - first.counters[GENERATION_TOKENS]
    preempted = last.counters[PREEMPTIONS] - first.counters[PREEMPTIONS]
    return Measured(max_num_seqs, generated / span, preempted)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sweep", default="2,3,4,5,6,7,8,10,12", help="static max_num_seqs values")
    parser.add_argument("--start", type=int, default=64, help="the too-high max_num_seqs the tuner starts at")
    parser.add_argument("--kv-cache-tokens", type=int, default=1024)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--prompt-len", default="40:80")
    parser.add_argument("--output-len", default="80:160")
    parser.add_argument("--settle", type=float, default=3.0, help="seconds after a change before measuring")
    parser.add_argument("--measure", type=float, default=8.0, help="seconds each measurement spans")
    parser.add_argument("--interval", type=float, default=1.0, help="tuner sampling interval")
    parser.add_argument("--evaluation-window", type=float, default=3.0)
    parser.add_argument("--tune-seconds", type=float, default=40.0, help="how long the tuner runs first")
    parser.add_argument("--no-record", action="store_true", help="do not write BENCHMARKS.md")


def _range(text: str) -> tuple[int, int]:
    low, high = (int(part) for part in text.split(":"))
    return low, high


def run(args: argparse.Namespace) -> int:
    sweep = [int(v) for v in args.sweep.split(",")]
    shape = LoadShape(args.clients, _range(args.prompt_len), _range(args.output_len))
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        token_file = folder / "token"
        token_file.write_text(TOKEN)
        model = write_tiny_model(folder / "tiny")
        engine = start_engine(model, token_file, folder / "engine.log", "--kv-cache-tokens",
                              str(args.kv_cache_tokens), "--max-num-seqs", str(args.start))  # fmt: skip
        try:
            result = _bench(engine, shape, sweep, args)
        finally:
            engine.stop()
    print(result)
    if not args.no_record:
        record_section("tuner", result)
    return 0


def _bench(engine: EngineProcess, shape: LoadShape, sweep: list[int], args: argparse.Namespace) -> str:
    source = MetricsEndpoint(engine.url)
    actuator = KvtuneAdminActuator(engine.url, TOKEN)
    load = BackgroundLoad(engine.url, shape).start()
    rows: list[Measured] = []
    try:
        for value in sweep:
            actuator.apply("max_num_seqs", value)
            time.sleep(args.settle)
            rows.append(measure(source, args.measure, value))
            print(
                f"static max_num_seqs {value}: {rows[-1].goodput:.0f} tokens/s, {rows[-1].preemptions:.0f} preemptions"
            )
        actuator.apply("max_num_seqs", args.start)
        time.sleep(args.settle)
        start_row = measure(source, args.measure, args.start)
        policy = TuningPolicy(mode=Mode.APPLY, evaluation_window_s=args.evaluation_window,
                              cooldown_s=args.evaluation_window)  # fmt: skip
        ticks: list[Tick] = []
        stop = threading.Event()
        began = time.time()
        loop = threading.Thread(
            target=run_loop, args=(source, actuator, policy, args.interval, stop, ticks.append)
        )
        loop.start()
        time.sleep(args.tune_seconds)
        converged = actuator.current().values.get("max_num_seqs")
        steady = measure(source, 2 * args.measure, converged or 0)
        stop.set()
        loop.join(30)
    finally:
        tally = load.stop()
    changes = [(t.at, change) for t in ticks for change, outcome in t.applied if outcome.ok]
    last_change = changes[-1][0] - began if changes else 0.0
    intervals = math.ceil(last_change / args.evaluation_window) if changes else 0
    clean = [row for row in rows if row.preemptions == 0]
    best = max(clean, key=lambda row: row.goodput) if clean else None
    ratio = steady.goodput / best.goodput if best else float("nan")
    trail = " → ".join([str(args.start)] + [str(change.value) for _, change in changes])
    lines = [
        "## Tuner (`kvtune bench tuner`)",
        "",
        f"Method: one `kvtune serve` (tiny model, KV pool {args.kv_cache_tokens:,} tokens, 1 torch thread) under "
        f"{shape.clients} closed-loop clients (prompt {args.prompt_len}, output {args.output_len} tokens, "
        f"ignore_eos). Static sweep through the admin API: {args.settle:g} s settle, {args.measure:g} s measured "
        f"per value; goodput = generated tokens/s from the engine's counters. Then max_num_seqs {args.start} and "
        f"`kvtune operator --local` logic (interval {args.interval:g} s, evaluation window "
        f"{args.evaluation_window:g} s) for {args.tune_seconds:g} s; steady state measured over "
        f"{2 * args.measure:g} s after that with the tuner still running.",
        f"Machine: {machine_description()}. Revision: {git_revision()}.",
        "",
        "| max_num_seqs (static) | goodput tokens/s | preemptions |",
        "|---:|---:|---:|",
        *(f"| {r.max_num_seqs} | {r.goodput:.0f} | {r.preemptions:.0f} |" for r in [*rows, start_row]),
        "",
        "| tuner | value |",
        "|---|---|",
        f"| trail | {trail} |",
        f"| converged max_num_seqs | {converged} |",
        f"| sweep-best (zero preemptions) | {best.max_num_seqs if best else 'none'} at "
        f"{best.goodput if best else float('nan'):.0f} tokens/s |",
        f"| steady-state goodput | {steady.goodput:.0f} tokens/s ({ratio:.0%} of sweep-best; goal ≥ 95%) |",
        f"| intervals to converge | {intervals} evaluation windows ({last_change:.0f} s; goal ≤ 5) |",
        f"| preemptions after convergence | {steady.preemptions:.0f} over {2 * args.measure:g} s (goal 0) |",
        f"| requests | {tally.completed} completed, {len(tally.failures)} failed |",
    ]
    return "\n".join(lines)
