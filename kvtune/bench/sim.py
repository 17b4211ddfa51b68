"""`kvtune bench sim`: simulator steps per second for each allocation policy.

A pool of 25,000 blocks of 16 tokens under the seed's workload (about 95 resident sequences when paged),
3,000 steps, the median of several runs. There is no peer to run beside it: the seed's own simulation is a
web page, not a program; the figure that matters is that `kvtune sim --table seed` stays interactive.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
from dataclasses import replace

from kvtune.bench.benchmarks_md import git_revision, machine_description, record_section
from kvtune.core.allocators import POLICIES
from kvtune.sim.scenarios import seed_config
from kvtune.sim.seed_table import seed_figures
from kvtune.sim.simulator import simulate

POOL_BLOCKS = 25_000


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repeats", type=int, default=5, help="runs per policy (median reported)")
    p.add_argument("--no-record", action="store_true", help="print only; leave BENCHMARKS.md alone")


def run(args: argparse.Namespace) -> int:
    rows = []
    for policy in POLICIES:
        cfg = replace(seed_config(policy=policy), pool_tokens=POOL_BLOCKS * 16)
        results = [simulate(replace(cfg, seed=s)) for s in range(args.repeats)]
        rows.append(
            (
                policy,
                statistics.median(r.steps_per_second for r in results),
                statistics.fmean(r.resident_sequences for r in results),
                statistics.median(r.steps_per_second * r.resident_sequences for r in results),
            )
        )
    started = time.perf_counter()
    seed_figures(seeds=5)
    table_seconds = time.perf_counter() - started
    lines = [
        "| policy | steps/s (median) | resident sequences | sequence-steps/s |",
        "|---|---:|---:|---:|",
        *(f"| {p} | {sps:,.0f} | {res:.1f} | {sss:,.0f} |" for p, sps, res, sss in rows),
        "",
        f"`kvtune sim --table seed` (11 runs × 5 seeds, all cores): {table_seconds:.1f} s wall.",
    ]
    table = "\n".join(lines)
    print(table)
    if not args.no_record:
        body = "\n".join(
            [
                "## Simulator speed (`kvtune bench sim`)",
                "",
                f"Method: the seed workload on a pool of {POOL_BLOCKS:,} blocks × 16 tokens, 3,000 steps per run, "
                f"{args.repeats} runs per policy with different random seeds, median steps per second "
                "(single process). No peer: the seed's simulation is not a runnable program.",
                f"Machine: {machine_description()}. Revision {git_revision()}, {datetime.date.today()}.",
                "",
                table,
            ]
        )
        record_section("sim-speed", body)
    return 0
