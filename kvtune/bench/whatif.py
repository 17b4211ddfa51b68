"""`kvtune bench whatif`: are the what-if model's predictions right on a live engine?

For each workload, one `kvtune serve` (tiny model) under a closed-loop load:

1. at a too-high max_num_seqs (where a tuner starts), a fit window: /metrics scraped every second, read
   with the operator's parser, fitted (`kvtune.core.workload_fit`; a window the fit finds insufficient is
   extended by half its length at a time, as an operator would wait for more evidence) and replayed
   through the what-if model (`kvtune.core.whatif`) for every sweep value — the prediction made before
   acting;
2. every sweep value measured as a static setting through the admin API, in two passes (rising, then
   falling), each a settle and a measured window scraped every second;
3. the sweep-best (best goodput among values with no preemption in either pass) and its neighbours that
   saw none confirmed in one long window each: two short windows cannot tell a value that preempts a few
   times a minute, in bursts, from one that never does (the engine was replayed to do exactly that at
   issue-28's edge); a value that preempts there is no clean value, and the sweep-best is chosen again (where
   no value of the sweep stays clean, the sweep goes on below it, to 1 if need be: `kvtune.bench.sweep`, the
   tuner benchmark's rule too);
4. the NoPreemption picks (`kvtune.core.objectives`, at each risk margin asked) and the sweep-best (best
   goodput among clean values) measured alternately, medians: does the pick replay with zero preemptions
   at ≥ 95% of the sweep-best?

Reported: zero-vs-nonzero agreement of predicted and observed preemptions per sweep value. The observed
windows (two, and the long one where a value was confirmed) are measured in steps of the predicted run (the tokens they generated ÷ the run's tokens
per step), so the shared machine's speed in a window does not count against the prediction; the
prediction says nonzero when at least one preemption in such windows is more likely than not, read off
the predicted run's own preemptions (they come in bursts, which a rate hides; `--seeds` seeds pooled per
sweep value); the plain predicted rate > 0 is shown beside. Also: the fit window replayed at its own setting
(prediction and observation over the same seconds); the goodput prediction's error (wall-clock; per
engine CPU-second, the prediction divided by the engine's CPU share in the fit window against tokens per
CPU-second measured, which takes out what the shared machine's other jobs did to the wall clock; and the
latter with each workload's common scale divided out, which is what ranking the settings needs); the
decision's time; and the same predictions from vLLM's 1-2-5 buckets (the engine's buckets coarsened).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from kvtune.bench.benchmarks_md import git_revision, machine_description, record_section
from kvtune.bench.sweep import (
    LiveEngine,
    Window,
    confirmed_best,
    cpu_seconds,
    engine_for,
    measure_sweep,
    static_window,
)
from kvtune.bench.whatif_report import Result, report, workload_lines
from kvtune.bench.whatif_window import Reading, coarsen, metrics_window, window_from_json
from kvtune.bench.workloads import NAMED, Workload, random_workloads
from kvtune.core.objectives import Pick, no_preemption
from kvtune.core.predict import Objective, plan
from kvtune.core.whatif import (
    DEFAULT_RISK_MARGIN,
    EDGE_SEEDS,
    Candidate,
    Prediction,
    decision_table,
    predictions_for,
    what_if,
)
from kvtune.core.workload_fit import FittedWorkload, Insufficient, MetricsWindow, fit_workload
from kvtune.errors import KvtuneError
from kvtune.harness.load import BackgroundLoad
from kvtune.harness.server import ServerProcess

SECTION = "whatif"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workloads", default="default,wide-prompts,long-outputs,issue-28,random",
                        help="comma-separated: named workloads, `random` for the seeded random ones, or one of "
                             "them by name (random-SEED-N)")  # fmt: skip
    parser.add_argument("--random-seed", type=int, default=28)
    parser.add_argument("--fit-seconds", type=float, default=12.0, help="the fit window's span")
    parser.add_argument("--settle", type=float, default=3.0, help="seconds after a change before measuring")
    parser.add_argument("--measure", type=float, default=6.0, help="seconds each measured window spans")
    parser.add_argument("--confirm", type=float, default=60.0,
                        help="seconds of the one long window that confirms the sweep-best and its neighbours clean")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds, pick vs sweep-best")
    parser.add_argument("--risk-margins", default=f"0,{DEFAULT_RISK_MARGIN:g}",
                        help="NoPreemption risk margins whose picks are replayed; above 0 each is widened to the "
                             "fit's error as the tuner does (Objective.for_fit)")  # fmt: skip
    parser.add_argument("--seeds", type=int, default=SWEEP_SEEDS, help="what-if seeds pooled per sweep value")
    parser.add_argument("--repredict", action="store_true",
                        help="with --summary-only: the sweep's predictions again from each stored fit window, "
                             "with --seeds seeds (deterministic in the window: what a run would have predicted)")  # fmt: skip
    parser.add_argument("--results", default="out/whatif", help="folder for each workload's JSON result")
    parser.add_argument("--summary-only", action="store_true", help="rebuild the section from --results")
    parser.add_argument("--edge-seconds", type=float, default=0.0,
                        help="instead of the sweep: measure the NoPreemption edge (the last value predicted safe "
                             "and the first predicted to preempt) for this many seconds each; own section")  # fmt: skip
    parser.add_argument("--timing-only", action="store_true",
                        help="time the decision (fit + decision table) on the fit windows stored in --results, "
                             "no engine; records its own section")  # fmt: skip
    parser.add_argument("--no-record", action="store_true", help="do not write BENCHMARKS.md")


# seeds pooled per sweep value: the values near the edge preempt a few times a minute in bursts, and 4
# seeds (the tuner's, EDGE_SEEDS, within its decision time) put the chance of a window seeing one anywhere
# between 0 and 100% on the same fit; 16 read it to about ±15%
SWEEP_SEEDS = 16


def margins(args: argparse.Namespace) -> list[float]:
    return [float(m) for m in dict.fromkeys(args.risk_margins.split(","))]


def _timing(fit_input: MetricsWindow, repeats: int = 5) -> dict[str, float]:
    """Median wall and CPU seconds of one decision: the fit, and its decision table (`decision_table`)."""
    walls, cpus, fits, rows = [], [], [], 0
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.thread_time()
        fit = fit_workload(fit_input)
        fitted = time.perf_counter()
        assert isinstance(fit, FittedWorkload)
        table = decision_table(fit)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.thread_time() - cpu)
        fits.append(fitted - wall)
        rows = len(table)
    return {"wall_s": statistics.median(walls), "cpu_s": statistics.median(cpus),
            "fit_s": statistics.median(fits), "candidates": float(rows)}  # fmt: skip


def _plan_timing(fit_input: MetricsWindow, repeats: int = 5) -> dict[str, float]:
    """Median wall and CPU seconds of the tuner's own decision: the fit and `kvtune.core.predict.plan` (the
    16-bit rows, the NoPreemption pick, the value in force simulated beside it)."""
    walls, cpus = [], []
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.thread_time()
        fit = fit_workload(fit_input)
        assert isinstance(fit, FittedWorkload)
        plan(fit, fit.settings.max_num_seqs, Objective())
        walls.append(time.perf_counter() - wall)
        cpus.append(time.thread_time() - cpu)
    return {"wall_s": statistics.median(walls), "cpu_s": statistics.median(cpus)}


def _fit_window(
    live: LiveEngine, workload: Workload, args: argparse.Namespace
) -> tuple[list[Reading], MetricsWindow, FittedWorkload, float]:
    """Settle, then scrape the fit window (extended by half its length while the fit finds it
    insufficient, as an operator waits for more evidence); the engine's CPU share over it."""
    time.sleep(2 * args.settle)
    cpu_before = cpu_seconds(live.pid)
    readings = live.scraped(args.fit_seconds)
    window = metrics_window(readings)
    fit = fit_workload(window)
    while isinstance(fit, Insufficient) and len(readings) < 4 * args.fit_seconds:
        print(f"  fit window extended: {fit}", flush=True)
        readings += live.scraped(args.fit_seconds / 2)[1:]
        window = metrics_window(readings)
        fit = fit_workload(window)
    if isinstance(fit, Insufficient):
        raise KvtuneError(f"workload {workload.name}: the fit window was not enough: {fit}")
    span = readings[-1].sample.timestamp - readings[0].sample.timestamp
    print(f"  fit: {fit.summary()}", flush=True)
    return readings, window, fit, (cpu_seconds(live.pid) - cpu_before) / span


def _with_engine(workload: Workload, run: Callable[[LiveEngine, ServerProcess], Result]) -> Result:
    with engine_for(workload) as engine:
        return run(LiveEngine.of(engine), engine)


def run_workload(workload: Workload, args: argparse.Namespace) -> Result:
    return _with_engine(workload, lambda live, engine: _bench(live, engine, workload, args))


def _bench(live: LiveEngine, engine: ServerProcess, workload: Workload, args: argparse.Namespace) -> Result:
    def measure(value: int, seconds: float, label: str) -> Window:
        return static_window(live, value, seconds, settle=args.settle, label=label)

    load_before = os.getloadavg()
    began = time.monotonic()
    print(f"workload {workload.name}: {workload.describe()}", flush=True)
    load = BackgroundLoad(engine.url, workload.load).start()
    try:
        readings, window, fit, fit_cpu_share = _fit_window(live, workload, args)
        coarse = fit_workload(metrics_window(readings, vllm_buckets=True))
        if isinstance(coarse, Insufficient):
            raise KvtuneError(
                f"workload {workload.name}: the fit window was not enough in 1-2-5 buckets: {coarse}"
            )
        values = sorted(set(workload.sweep))
        table, coarse_table = sweep_predictions(fit, coarse, values, args.seeds)
        # the margin in force: above 0, widened to the fit's error as the tuner widens it
        used = {m: Objective(risk_margin=m).for_fit(fit).risk_margin if m > 0 else 0.0 for m in margins(args)}
        picks = {margin: _pick(fit, used[margin]) for margin in margins(args)}
        for p in table:
            print(f"  predicted {p.candidate.max_num_seqs}: {p.preemptions_per_min:.1f} preemptions/min, "
                  f"goodput {p.goodput:.0f}, p95 wait {p.p95_queue_wait_s:.2f} s, peak KV {p.peak_kv_usage:.0%}",
                  flush=True)  # fmt: skip
        for margin, pick in picks.items():
            print(
                f"  NoPreemption pick at margin {margin:g}: {pick.max_num_seqs} ({pick.reason})", flush=True
            )
        sweep = measure_sweep(values, measure, args.measure)
        best = confirmed_best(sweep, measure, args.measure, args.confirm, neighbours=True)
        rounds: dict[int, list[tuple[Window, Window]]] = {}
        for value in sorted({p.max_num_seqs for p in picks.values() if p.max_num_seqs is not None}):
            if best is None or value == best:
                continue
            rounds[value] = []
            for i in range(args.rounds):
                order = (value, best) if i % 2 == 0 else (best, value)
                got = {v: measure(v, args.measure, f"round {i + 1}") for v in order}
                rounds[value].append((got[value], got[best]))
    finally:
        tally = load.stop()
    load_after = os.getloadavg()
    timing = _timing(window)
    return {
        "workload": workload.record(),
        "fit": fit.summary(),
        "window": asdict(window),
        "fit_coarse": coarse.summary(),
        "fit_cpu_share": fit_cpu_share,
        "observed_at_start": asdict(fit.observed),
        "step_time": fit.step_time.describe(),
        "predicted": [_prediction(p) for p in table],
        "predicted_coarse": [_prediction(p) for p in coarse_table],
        "seeds": args.seeds,
        "picks": [[margin, pick.max_num_seqs, pick.reason, used[margin]] for margin, pick in picks.items()],
        "rising": [asdict(sweep.passes[v][0]) for v in values],
        "falling": [asdict(sweep.passes[v][1]) for v in values],
        "below": {str(v): [asdict(w) for w in sweep.passes[v]] for v in sweep.below},
        "confirmed": {str(v): asdict(w) for v, w in sweep.confirmed.items()},
        "sweep_best": best,
        "rounds": {str(v): [[asdict(a), asdict(b)] for a, b in pairs] for v, pairs in rounds.items()},
        "timing": timing,
        "requests": {"completed": tally.completed, "failed": len(tally.failures)},
        "load": [list(load_before), list(load_after)],
        "minutes": (time.monotonic() - began) / 60,
        "revision": git_revision(),
    }


def sweep_predictions(
    fit: FittedWorkload, coarse: FittedWorkload, values: list[int], seeds: int
) -> tuple[tuple[Prediction, ...], tuple[Prediction, ...]]:
    """Every sweep value predicted from the fit and from the same window in vLLM's 1-2-5 buckets."""
    candidates = [Candidate(v) for v in values]
    return what_if(fit, candidates, seeds=seeds), what_if(coarse, candidates, seeds=seeds)


def repredicted(result: Result, seeds: int) -> Result:
    """A stored result with its sweep predictions made again from its own fit window with `seeds` seeds."""
    window = window_from_json(result["window"])
    coarse_window = replace(
        window, prompt_len=coarsen(window.prompt_len), output_len=coarsen(window.output_len)
    )
    fit, coarse = fit_workload(window), fit_workload(coarse_window)
    if isinstance(fit, Insufficient) or isinstance(coarse, Insufficient):
        raise KvtuneError(f"workload {result['workload']['name']}: the stored window no longer fits: {fit}")
    values = sorted({int(r["max_num_seqs"]) for r in result["rising"]})
    table, coarse_table = sweep_predictions(fit, coarse, values, seeds)
    run = {} if "predicted_run" in result else {"predicted_run": result["predicted"],
                                                "seeds_run": result.get("seeds", EDGE_SEEDS)}  # fmt: skip
    return {**result, **run, "predicted": [_prediction(p) for p in table],
            "predicted_coarse": [_prediction(p) for p in coarse_table], "seeds": seeds}  # fmt: skip


def _pick(fit: FittedWorkload, margin: float) -> Pick:
    return no_preemption(predictions_for(decision_table(fit, risk_margin=margin), fp8=False), margin)


def _prediction(p: Prediction) -> dict[str, Any]:
    return asdict(p)


def run(args: argparse.Namespace) -> int:
    folder = Path(args.results)
    folder.mkdir(parents=True, exist_ok=True)
    named = NAMED
    chosen: list[Workload] = []
    randoms = {w.name: w for w in random_workloads(args.random_seed)}
    for name in (n.strip() for n in args.workloads.split(",") if n.strip()):
        if name == "random":
            chosen += randoms.values()
        elif name in named or name in randoms:
            chosen.append(named.get(name) or randoms[name])
        else:
            raise KvtuneError(
                f"unknown workload {name!r} (choose from {', '.join([*named, *randoms])}, random)"
            )
    if args.timing_only:
        return timing_only(chosen, folder, args)
    if args.edge_seconds > 0:
        return edge_check(chosen, folder, args)
    if not args.summary_only:
        for workload in chosen:
            result = run_workload(workload, args)
            (folder / f"{workload.name}.json").write_text(json.dumps(result, indent=1))
            print("\n".join(workload_lines(result)), flush=True)
    results = []
    for workload in chosen:
        path = folder / f"{workload.name}.json"
        if not path.exists():
            raise KvtuneError(f"no result for workload {workload.name} in {folder}: run it first")
        result = json.loads(path.read_text())
        if args.repredict:
            result = repredicted(result, args.seeds)
            path.write_text(json.dumps(result, indent=1))
        results.append(result)
    body = report(results, args, __doc__.split("\n\n", 1)[1].strip())
    print(body)
    if not args.no_record:
        record_section(SECTION, body)
    return 0


def timing_only(chosen: list[Workload], folder: Path, args: argparse.Namespace) -> int:
    """The decision's time on each stored fit window, in this process alone (no engine, no load)."""
    load_before = os.getloadavg()
    rows = []
    for workload in chosen:
        path = folder / f"{workload.name}.json"
        if not path.exists():
            raise KvtuneError(f"no result for workload {workload.name} in {folder}: run it first")
        window = window_from_json(json.loads(path.read_text())["window"])
        timing = _timing(window, repeats=7)
        timing |= {f"plan_{k}": v for k, v in _plan_timing(window, repeats=7).items()}
        rows.append((workload.name, timing))
        print(f"{workload.name}: fit {timing['fit_s'] * 1e3:.1f} ms, fit + decision table "
              f"({timing['candidates']:.0f} rows) {timing['wall_s'] * 1e3:.0f} ms wall, "
              f"{timing['cpu_s'] * 1e3:.0f} ms CPU", flush=True)  # fmt: skip
    load_after = os.getloadavg()
    walls = [t["wall_s"] for _, t in rows]
    body = "\n".join(
        [
            "## What-if decision time (`kvtune bench whatif --timing-only`)",
            "",
            "Method: for each workload's stored fit window (from `kvtune bench whatif`), the fit "
            "(`fit_workload`) and its decision table (`decision_table`: the max_num_seqs values and FP8, "
            "refined to one step at the NoPreemption edge) in one process, no engine and no load running; the "
            "median of 7 repeats, wall-clock and the thread's CPU time; beside it, the tuner's own decision "
            "(the fit and `kvtune.core.predict.plan`: the 16-bit rows, the NoPreemption pick and the value in "
            "force simulated beside it), which is what the operator runs per decision. Goal: under 1 s per "
            "decision on 2 cores.",
            f"Machine: {machine_description()}, shared with other jobs: load average (1 min) "
            f"{load_before[0]:.1f} at start, {load_after[0]:.1f} at end. Revision {git_revision()}.",
            "",
            "| workload | rows | fit ms | fit + table, ms wall | ms CPU | the tuner's fit + plan, ms wall | ms CPU |",
            "|---|---:|---:|---:|---:|---:|---:|",
            *(
                f"| {name} | {t['candidates']:.0f} | {t['fit_s'] * 1e3:.1f} | {t['wall_s'] * 1e3:.0f} | "
                f"{t['cpu_s'] * 1e3:.0f} | {t['plan_wall_s'] * 1e3:.0f} | {t['plan_cpu_s'] * 1e3:.0f} |"
                for name, t in rows
            ),
            f"| median | | | {statistics.median(walls) * 1e3:.0f} | "
            f"{statistics.median(t['cpu_s'] for _, t in rows) * 1e3:.0f} | "
            f"{statistics.median(t['plan_wall_s'] for _, t in rows) * 1e3:.0f} | "
            f"{statistics.median(t['plan_cpu_s'] for _, t in rows) * 1e3:.0f} |",
            f"| max | | | {max(walls) * 1e3:.0f} | {max(t['cpu_s'] for _, t in rows) * 1e3:.0f} | "
            f"{max(t['plan_wall_s'] for _, t in rows) * 1e3:.0f} | "
            f"{max(t['plan_cpu_s'] for _, t in rows) * 1e3:.0f} |",
        ]
    )
    print(body)
    if not args.no_record:
        record_section(SECTION + "-timing", body)
    return 0


# --- the edge over long windows ---------------------------------------------------------------------
def _edge(live: LiveEngine, engine: ServerProcess, workload: Workload, args: argparse.Namespace) -> Result:
    """Fit, find the NoPreemption edge at margin 0 (its values decided on the pooled seeds), then measure
    the two values on either side of it for `args.edge_seconds` each: preemptions per generated token over
    a window long enough to see a rare one, which two short sweep windows can miss."""
    load_before = os.getloadavg()
    print(f"workload {workload.name} (edge): {workload.describe()}", flush=True)
    load = BackgroundLoad(engine.url, workload.load).start()
    try:
        _, window, fit, _ = _fit_window(live, workload, args)
        table = predictions_for(decision_table(fit, risk_margin=0.0), fp8=False)
        pick = no_preemption(table, 0.0).max_num_seqs or 1
        rows = []
        for value in (pick, pick + 1):
            predicted = next(p for p in table if p.candidate.max_num_seqs == value)
            measured = static_window(live, value, args.edge_seconds, settle=args.settle, label="edge")
            tokens = measured.goodput * measured.seconds
            rows.append({"max_num_seqs": value, "predicted_per_k": 1000 * predicted.preemptions / max(1, predicted.tokens),
                         "predicted_seeds": predicted.seeds, "observed": measured.preemptions, "tokens": tokens,
                         "seconds": measured.seconds})  # fmt: skip
            print(f"  edge {value}: predicted {rows[-1]['predicted_per_k']:.2f} per 1,000 tokens, observed "
                  f"{measured.preemptions:.0f} in {tokens:,.0f} tokens", flush=True)  # fmt: skip
    finally:
        load.stop()
    return {"workload": workload.record(), "window": asdict(window), "rows": rows, "revision": git_revision(),
            "load": [list(load_before), list(os.getloadavg())]}  # fmt: skip


def edge_check(chosen: list[Workload], folder: Path, args: argparse.Namespace) -> int:
    lines = [
        "## What-if edge over long windows (`kvtune bench whatif --edge-seconds S`)",
        "",
        "Method: per workload, one `kvtune serve` (tiny model) under its closed-loop load, a fit window at the "
        "too-high start, the NoPreemption edge found at risk margin 0 (the last value predicted never to "
        f"preempt, its neighbours decided on {EDGE_SEEDS} seeds pooled), then that value and the next one "
        f"measured as static settings for {args.edge_seconds:g} s each ({args.settle:g} s settle): preemptions "
        "per 1,000 generated tokens predicted (the pooled runs) and observed. Two 8 s sweep windows can miss a "
        "rare preemption; these windows are long enough to see one.",
        f"Machine: {machine_description()}, shared with other jobs (load averages below).",
        "",
        "| workload | max_num_seqs | predicted preemptions per 1,000 tokens | observed: preemptions in tokens (s) | "
        "observed per 1,000 tokens | load average | revision |",
        "|---|---:|---:|---:|---:|---|---|",
    ]
    for workload in chosen:
        path = folder / f"edge-{workload.name}.json"
        if args.summary_only:
            if not path.exists():
                raise KvtuneError(f"no edge result for workload {workload.name} in {folder}: run it first")
            result = json.loads(path.read_text())
        else:
            result = _with_engine(workload, functools.partial(_edge, workload=workload, args=args))
            path.write_text(json.dumps(result, indent=1))
        for row in result["rows"]:
            lines.append(
                f"| {workload.name} | {row['max_num_seqs']} | {row['predicted_per_k']:.2f} | {row['observed']:.0f} in "
                f"{row['tokens']:,.0f} ({row['seconds']:.0f}) | {1000 * row['observed'] / max(1.0, row['tokens']):.2f} | "
                f"{result['load'][0][0]:.1f} → {result['load'][1][0]:.1f} | {result['revision']} |"
            )
    body = "\n".join(lines)
    print(body)
    if not args.no_record:
        record_section(SECTION + "-edge", body)
    return 0
