"""`kvtune bench tuner`: how good is the max_num_seqs the tuner converges to?

On one live engine (tiny model, a pool small enough to preempt) under a steady closed-loop workload from the
bench's catalog (`kvtune.bench.workloads`; flags make another, named for what it is):

1. a static sweep of max_num_seqs values through the admin API, in two passes (rising, then falling); each
   value is measured for goodput and preemptions, and the sweep-best is the best goodput among values with
   zero preemptions in every window (one 6 s window missed a marginal value's rare preemptions, which then
   showed in the alternating rounds and made the "best" a value the tuner rightly rejects);
2. a too-high start, then the local-mode tuner (the same `decide` the operator runs) until it stops
   changing the value; the steady state is measured with the tuner still running (preemptions there are
   the "preemptions after convergence");
3. with the tuner stopped, the sweep-best confirmed over one long window, then it and the converged value
   measured alternately as static settings, several rounds: the ratio compares like with like under the
   same machine noise (on a shared 2-core box one measurement swings by tens of percent). A sweep-best that
   preempts in its confirming window or these rounds was a marginal value the sweep's two windows missed:
   the next clean value replaces it, and where no value of the sweep stays clean the sweep goes on below it
   (`kvtune.bench.sweep`, the one rule the what-if benchmark uses too).

Goodput is the engine's generation-tokens counter per second: a preempted request keeps its output and
recomputes prompt + output (as vLLM), so no counted token is thrown away, and the counter moves every step
where finished requests' totals move in lumps. 'delivered' (finished requests' generation tokens, from the
request-generation-tokens histogram's sum) is shown beside it as a cross-check.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvtune.bench.benchmarks_md import git_revision, machine_description, record_section
from kvtune.bench.sweep import (
    TOKEN,
    LiveEngine,
    Sweep,
    Window,
    confirmed_best,
    engine_for,
    measure_sweep,
    static_window,
    time_weighted,
)
from kvtune.bench.workloads import Workload, catalog, from_flags, span_text
from kvtune.core.predict import Forecast
from kvtune.harness.engine_process import ENGINE_THREADS
from kvtune.harness.load import BackgroundLoad, LoadShape
from kvtune.harness.server import ServerProcess
from kvtune.operator.decide.loop import Tick, run_loop
from kvtune.operator.decide.policy import Mode, TuningPolicy
from kvtune.operator.io.actuators import KvtuneAdminActuator
from kvtune.operator.io.sources import MetricsEndpoint

# a clean value is one the pager stays quiet for: KVCachePreemptions fires on any preemption in 5 minutes,
# and values at the edge preempt a few times in that (wide-prompts' 13: 17 in 300 s) but not in seconds
CONFIRM_S = 300.0
WORKLOAD_FLAGS = ("kv_cache_tokens", "clients", "prompt_len", "output_len", "start", "sweep")


def intervals_to_converge(changes_at: list[float], began: float, window: float) -> int:
    """Evaluation windows from the tuner's start until the value stopped changing for good: the window
    the last change fell in (0 when it never changed)."""
    if not changes_at:
        return 0
    return int((changes_at[-1] - began) // window) + 1


def chosen_workload(args: argparse.Namespace) -> Workload:
    """The named workload with every workload flag given put over it (`workloads.from_flags`)."""
    return from_flags(catalog()[args.workload], **{name: getattr(args, name) for name in WORKLOAD_FLAGS})


def section_name(workload: str) -> str:
    """The BENCHMARKS.md section a workload's run rewrites (the default keeps the section it always had)."""
    return "tuner" if workload == "default" else f"tuner-{workload}"


def command_text(args: argparse.Namespace) -> str:
    """The command that ran, as a reader would type it: the named workload and each workload flag given (the
    default's name left out beside flags, which it only fills in)."""
    given = [f"--{name.replace('_', '-')} {getattr(args, name)}" for name in WORKLOAD_FLAGS
             if getattr(args, name) is not None]  # fmt: skip
    named = [] if given and args.workload == "default" else [f"--workload {args.workload}"]
    return " ".join(["kvtune bench tuner", *named, *given])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", choices=sorted(catalog()), default="default",
                        help="a named workload (its pool, load, start and sweep); the flags below override it, and "
                             "a workload whose pool or load they change is named from them")  # fmt: skip
    parser.add_argument(
        "--sweep", help="static max_num_seqs values, comma-separated (default: the workload's)"
    )
    parser.add_argument("--start", type=int, help="the too-high max_num_seqs the tuner starts at")
    parser.add_argument("--kv-cache-tokens", type=int)
    parser.add_argument("--clients", type=int)
    parser.add_argument("--prompt-len", help="LO:HI tokens")
    parser.add_argument("--output-len", help="LO:HI tokens")
    parser.add_argument("--settle", type=float, default=3.0, help="seconds after a change before measuring")
    parser.add_argument("--measure", type=float, default=6.0, help="seconds each measurement spans")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds, converged vs sweep-best")
    parser.add_argument("--confirm", type=float, default=CONFIRM_S,
                        help="seconds of the window that confirms the sweep-best and the converged value clean "
                             "(default: the preemption alert's 5 minutes; 0: none)")  # fmt: skip
    parser.add_argument("--interval", type=float, default=1.0, help="tuner sampling interval")
    parser.add_argument("--evaluation-window", type=float, default=3.0)
    parser.add_argument("--tune-seconds", type=float, default=30.0, help="how long the tuner runs first")
    parser.add_argument("--no-predict", action="store_true",
                        help="measured stepping only (the tuner before issue 28), for comparison")  # fmt: skip
    parser.add_argument("--no-record", action="store_true", help="do not write BENCHMARKS.md")


def _mean(span: tuple[int, int]) -> float:
    return (span[0] + span[1]) / 2


def workload_text(kv_cache_tokens: int, shape: LoadShape) -> str:
    """Why this workload makes max_num_seqs bind (or that it does not), from the run's own figures: how many
    requests at their full length (prompt + output) the pool holds against the number of clients."""
    prompt, output = _mean(shape.prompt_len), _mean(shape.output_len)
    longest = shape.prompt_len[1] + shape.output_len[1]
    shortest = shape.prompt_len[0] + shape.output_len[0]
    holds = kv_cache_tokens / (prompt + output)
    pool = (
        f"the pool holds about {holds:.0f} such requests at their full length (pool ÷ mean footprint "
        f"{holds:.1f}; {kv_cache_tokens // longest} "
        f"of the longest, {kv_cache_tokens // shortest} of the shortest)"
    )
    if shape.clients > holds:
        load = f"so {shape.clients} clients over-subscribe it and max_num_seqs is the binding knob."
    else:
        load = f"so {shape.clients} clients do not over-subscribe it and max_num_seqs need not bind."
    if prompt >= output:
        cost = (
            f"Prompts ({prompt:.0f} tokens on average) are long against the outputs ({output:.0f}) so that a "
            "preemption (the victim recomputes prompt + output so far) costs real work"
        )
    else:
        cost = (
            f"Prompts ({prompt:.0f} tokens on average) are short against the outputs ({output:.0f}), so a "
            "preemption (the victim recomputes prompt + output so far) costs mostly the output so far"
        )
    return f"{cost}, and {pool}, {load}"


def method_text(args: argparse.Namespace, workload: Workload) -> str:
    """The section's method paragraph, every figure taken from the run's workload and arguments."""
    shape = workload.load
    return (
        f"Method: one `kvtune serve` (tiny model, KV pool {workload.kv_cache_tokens:,} tokens, {ENGINE_THREADS} "
        f"torch thread{'s' if ENGINE_THREADS != 1 else ''}) under {shape.clients} closed-loop clients (random "
        f"token-id prompts {span_text(shape.prompt_len)}, outputs {span_text(shape.output_len)} tokens, "
        f"ignore_eos). {workload_text(workload.kv_cache_tokens, shape)} Goodput = the "
        "engine's generation-tokens counter per second (a preempted request keeps its output, so no counted "
        "token is thrown away); 'delivered' = generation tokens of finished requests per second (histogram "
        "sum), a cross-check that moves in lumps; 'per engine CPU-s' = generation tokens per CPU-second the "
        "engine process used (utime+stime), which discounts the time the shared box took the core away — "
        "the engine is always busy under this load, so on a quiet machine the two agree. Every static "
        f"measurement: set max_num_seqs through the admin API, {args.settle:g} s settle, {args.measure:g} s "
        "measured. (1) Static sweep in two passes (rising, then falling; the table shows mean rates and the "
        "preemptions of both windows); sweep-best = best goodput among values with zero preemptions in both. "
        f"(2) max_num_seqs {workload.start}, then `kvtune operator --local` logic (interval {args.interval:g} s, "
        f"evaluation window and cooldown {args.evaluation_window:g} s) for {args.tune_seconds:g} s, then a "
        f"{2 * args.measure:g} s steady-state window with the tuner still running. Windows to converge = "
        "evaluation windows from the tuner's start to the one holding its last change. (3) Tuner stopped; "
        f"converged and sweep-best values measured alternately, {args.rounds} rounds. Before its rounds the "
        f"sweep-best is confirmed in one {args.confirm:g} s window (the preemption alert's span: a value that "
        "preempts in it would page), and so is the converged value (its preemptions there count as after "
        "convergence). The ratio: each value's goodput over all its windows after the tuner stopped (its "
        "confirming window and its rounds, weighted by their spans), since one value's 6 s rounds spread by "
        "a third; the rounds' medians are shown beside. A sweep-best that "
        "preempts in its confirming window or its alternating rounds is no zero-preemption value: the next "
        "clean value of the sweep replaces it and the rounds are run again; where no value of the sweep stays "
        "clean, the sweep goes on below its lowest value, one value at a time (two windows each), to 1 if need "
        "be. A tuner that settles on the sweep-best value itself reaches 100% of it; its rounds against itself "
        "are then shown as the noise."
    )


def run(args: argparse.Namespace) -> int:
    workload = chosen_workload(args)
    with engine_for(workload) as engine:
        result = _bench(engine, workload, args)
    print(result)
    if not args.no_record:
        record_section(section_name(workload.name), result)
    return 0


def _row(r: Window, below: bool = False) -> str:
    value = f"{r.max_num_seqs} (below the sweep)" if below else str(r.max_num_seqs)
    return f"| {value} | {r.goodput:.0f} | {r.delivered:.0f} | {r.per_cpu_s:.0f} | {r.preemptions:.0f} |"


def percent(ratio: float) -> str:
    """A ratio as a percentage; a ratio of nothing (no windows on one side) is said, never printed as nan%."""
    return f"{ratio:.0%}" if math.isfinite(ratio) else "not measured"


def prediction_rows(
    ticks: list[Tick], began: float, steady: Window, steady_s: float, converged_goodput: float
) -> list[str]:
    """The tuner's forecasts beside what followed: each value it jumped to with its predicted preemptions and
    goodput, the verdicts of the windows after, and the steady window's and the converged value's windows'
    outcome against the last forecast."""
    forecasts: list[tuple[float, Forecast]] = []
    verdicts: list[tuple[float, str]] = []
    for tick in ticks:
        prediction = tick.state.prediction
        f = prediction.forecast
        if f is not None and (not forecasts or forecasts[-1][1] != f):
            forecasts.append((tick.at - began, f))
        if prediction.verdict and (not verdicts or verdicts[-1][1] != prediction.verdict):
            verdicts.append((tick.at - began, prediction.verdict))
    if not ticks or not (forecasts or verdicts):
        return ["| predictions | none made (measured stepping) |"]
    last = ticks[-1].state.prediction
    rows = [
        f"| forecast ({at:.0f} s) | {f.current} → {f.value}: predicted {f.preemptions_per_min:.1f} preemptions/min, "
        f"goodput {f.goodput:.0f} tokens/s, p95 queue wait {f.p95_wait_s:.2f} s (at {f.current}: "
        f"{f.current_preemptions_per_min:.1f}/min, {f.current_goodput:.0f} tokens/s); fit: {f.workload} |"
        for at, f in forecasts
    ]
    rows += [f"| verdict ({at:.0f} s) | {text} |" for at, text in verdicts]
    if forecasts:
        f = forecasts[-1][1]
        error = f"{f.goodput / converged_goodput - 1:+.0%}" if converged_goodput > 0 else "not measured"
        rows.append(
            f"| last forecast against the outcome | {f.value}: predicted {f.preemptions_per_min:.1f}/min, observed "
            f"{steady.preemptions / steady_s * 60:.1f}/min over the {steady_s:g} s steady window; goodput "
            f"predicted {f.goodput:.0f}, measured {converged_goodput:.0f} tokens/s (its windows, span-weighted; "
            f"prediction error {error}) |"
        )
    rows.append(
        f"| fell back to measured stepping | {'yes' if last.stepping else 'no'} ({last.misses} misses) |"
    )
    return rows


def _bench(server: ServerProcess, workload: Workload, args: argparse.Namespace) -> str:
    source = MetricsEndpoint(server.url)
    actuator = KvtuneAdminActuator(server.url, TOKEN)
    live = LiveEngine.of(server)

    def measure(value: int, seconds: float, label: str) -> Window:
        return static_window(live, value, seconds, settle=args.settle, label=label)

    load_before = os.getloadavg()
    started = time.monotonic()
    load = BackgroundLoad(server.url, workload.load).start()
    try:
        sweep = measure_sweep(workload.sweep, measure, args.measure)
        start_row = measure(workload.start, args.measure, "start")
        policy = TuningPolicy(mode=Mode.APPLY, evaluation_window_s=args.evaluation_window,
                              cooldown_s=args.evaluation_window, predict=not args.no_predict)  # fmt: skip
        ticks: list[Tick] = []
        stop = threading.Event()
        began = time.time()

        def on_tick(tick: Tick) -> None:
            ticks.append(tick)
            verdict = tick.state.prediction.verdict
            if verdict and (len(ticks) < 2 or ticks[-2].state.prediction.verdict != verdict):
                print(f"  tuner {tick.at - began:5.1f} s: prediction: {verdict}", flush=True)
            for change, outcome in tick.applied:
                print(f"  tuner {tick.at - began:5.1f} s: {change.before} -> {change.value} "
                      f"({'ok' if outcome.ok else outcome.error}): {change.reason}", flush=True)  # fmt: skip

        loop = threading.Thread(
            target=run_loop, args=(source, actuator, policy, args.interval, stop, on_tick)
        )
        loop.start()
        try:
            time.sleep(args.tune_seconds)
            converged = actuator.current().values.get("max_num_seqs")
            steady = live.window(converged or 0, 2 * args.measure)
        finally:
            stop.set()
            loop.join(30)
        at_tune_end = converged
        converged = actuator.current().values.get("max_num_seqs")  # the tuner may still have moved it
        print(
            f"tuner: {at_tune_end} after {args.tune_seconds:g} s, {converged} after the steady window",
            flush=True,
        )
        best, pairs = reference(sweep, measure, converged, args)
        if args.confirm > 0 and isinstance(converged, int) and converged not in sweep.confirmed:
            sweep.confirmed[converged] = measure(converged, args.confirm, "confirm")
    finally:
        tally = load.stop()
    measured = TunerRun(sweep, start_row, ticks, began, steady, at_tune_end, converged, best, pairs,
                        tally.completed, len(tally.failures), load_before, os.getloadavg(),
                        (time.monotonic() - started) / 60)  # fmt: skip
    return section(measured, workload, args)


@dataclass(frozen=True)
class TunerRun:
    """What one run measured: the sweep's windows, the tuner's ticks and the reference's rounds."""

    sweep: Sweep
    start_row: Window
    ticks: list[Tick]
    began: float  # when the tuner started (time.time())
    steady: Window  # the steady window with the tuner running
    at_tune_end: int | None  # max_num_seqs when the tuner's time was up
    converged: int | None  # and after the steady window
    best: int | None  # the sweep-best (`sweep.confirmed_best`), None when no value down to 1 stayed clean
    pairs: list[tuple[Window, Window]]  # (converged, sweep-best) per alternating round
    completed: int
    failed: int
    load_before: tuple[float, float, float]
    load_after: tuple[float, float, float]
    minutes: float


def section(run: TunerRun, workload: Workload, args: argparse.Namespace) -> str:
    """The BENCHMARKS.md section of one run; a ratio with nothing on one side is said, never printed as nan%."""
    sweep, ticks, began, steady, pairs = run.sweep, run.ticks, run.began, run.steady, run.pairs
    converged, at_tune_end, best, start_row = run.converged, run.at_tune_end, run.best, run.start_row
    load_before, load_after, minutes = run.load_before, run.load_after, run.minutes
    changes = [(t.at, change) for t in ticks for change, outcome in t.applied if outcome.ok]
    intervals = intervals_to_converge([at for at, _ in changes], began, args.evaluation_window)
    last_change = changes[-1][0] - began if changes else 0.0
    trail = " → ".join(
        [str(workload.start)] + [f"{change.value} ({at - began:.0f} s)" for at, change in changes]
    )
    confirmed = sweep.confirmed
    conv_med = statistics.median(c.goodput for c, _ in pairs) if pairs else math.nan
    best_med = statistics.median(b.goodput for _, b in pairs) if pairs else math.nan
    ratio = conv_med / best_med if pairs and best_med > 0 else math.nan
    conv_cpu = statistics.median(c.per_cpu_s for c, _ in pairs) if pairs else math.nan
    best_cpu = statistics.median(b.per_cpu_s for _, b in pairs) if pairs else math.nan
    same_value = best is not None and converged == best
    conv_tw, conv_tw_cpu, conv_s = time_weighted(
        [c for c, _ in pairs] + ([confirmed[converged]] if converged in confirmed else [])
    )
    best_tw, best_tw_cpu, best_s = time_weighted(
        [b for _, b in pairs] + ([confirmed[best]] if best is not None and best in confirmed else [])
    )
    weighted = conv_tw / best_tw if best_tw > 0 else math.nan
    # on the sweep-best value itself both columns measure the converged value: both count as after
    alt_pre = sum(c.preemptions + (b.preemptions if same_value else 0) for c, b in pairs)
    confirm_pre = (
        confirmed[converged].preemptions if isinstance(converged, int) and converged in confirmed else 0.0
    )
    footprint = workload.footprint
    pool = workload.kv_cache_tokens
    clean_after = steady.preemptions == 0 and alt_pre == 0 and confirm_pre == 0
    dropped = "".join(
        f"; {value} dropped: it preempted {shown:.0f} times in {where}"
        for value, shown, where in sweep.dropped
    )
    below = (
        f"; none of the sweep stayed clean: it went on below it ({', '.join(map(str, sweep.below))})"
        if sweep.below and best is not None
        else ""
    )
    # The tuner settling on the sweep-best value itself reaches 100% of it by definition; the alternating
    # rounds then compare a setting with itself, and their ratio is the machine's noise, shown beside.
    reached = 1.0 if same_value else weighted
    if best is None:
        reached_text = "not measured: no value of the sweep nor below it, down to 1, stayed clean"
    elif same_value:
        reached_text = f"100% (the sweep-best value itself; its alternating rounds against itself: {percent(ratio)}, noise)"
    else:
        reached_text = f"{percent(weighted)} over every window (rounds' medians {percent(ratio)})"
    best_text = (
        str(best) if best is not None else "none: every value of the sweep and below it, down to 1, preempted"
    )
    goal = 5 if args.no_predict else 3  # issue 28: predicting, ≤ 3 windows
    met = best is not None and intervals <= goal and reached >= 0.95 and clean_after
    verdict = (
        f"workload {workload.name}: pool ÷ mean footprint {pool / footprint:.1f}; "
        f"windows to converge {intervals} (goal ≤ {goal}); converged {converged}, "
        f"{f'sweep-best {best}' if best is not None else 'no clean sweep-best'}; goodput ÷ sweep-best "
        f"{reached_text} (goal ≥ 95%); "
        f"preemptions after {steady.preemptions + alt_pre + confirm_pre:.0f} (goal 0): "
        + ("met" if met else "NOT met")
    )
    predictions = prediction_rows(ticks, began, steady, 2 * args.measure, conv_tw)
    in_confirm = (
        f", {confirm_pre:.0f} in its {args.confirm:g} s confirming window"
        if isinstance(converged, int) and converged in confirmed
        else ""
    )
    confirm_text = ", ".join(f"{v}: {m.preemptions:.0f} in {args.confirm:g} s" for v, m in confirmed.items())
    confirm_text = confirm_text or "none"
    if best is None:
        ratio_row = "| goodput ÷ sweep-best | not measured: there is no clean value to compare with |"
    else:
        ratio_row = (
            f"| goodput ÷ sweep-best | {percent(weighted)} wall-clock, {percent(conv_tw_cpu / best_tw_cpu)} per "
            f"engine CPU-second over every window of each value after the tuner stopped ({conv_s:.0f} s against "
            f"{best_s:.0f} s, span-weighted); the alternating rounds' medians alone: {percent(ratio)} and "
            f"{percent(conv_cpu / best_cpu)} (goal ≥ 95%) |"
        )
    print(verdict, flush=True)
    lines = [
        f"## Tuner, workload {workload.name} (`{command_text(args)}`)",
        "",
        f"Workload {workload.name}: {workload.why}; KV pool {pool:,} tokens ÷ "
        f"mean full footprint {footprint:.0f} tokens = {pool / footprint:.1f}.",
        "",
        method_text(args, workload),
        f"Machine: {machine_description()}, shared (another benchmark may be running). "
        f"Revision: {git_revision()}. Load average (1/5/15 min) at start "
        f"{load_before[0]:.2f}/{load_before[1]:.2f}/{load_before[2]:.2f}, at end "
        f"{load_after[0]:.2f}/{load_after[1]:.2f}/{load_after[2]:.2f}. Run took {minutes:.1f} min.",
        "",
        "| max_num_seqs (static sweep, 2 passes) | goodput tokens/s | delivered tokens/s | tokens per engine CPU-s | "
        "preemptions |",
        "|---:|---:|---:|---:|---:|",
        *(_row(r, below=r.max_num_seqs in sweep.below) for r in sweep.rows()),
        _row(start_row),
        "",
        "| alternating round | converged: goodput, per CPU-s (preemptions) | sweep-best: goodput, per CPU-s "
        "(preemptions) |",
        "|---:|---:|---:|",
        *(
            f"| {i + 1} | {c.goodput:.0f}, {c.per_cpu_s:.0f} ({c.preemptions:.0f}) | "
            f"{b.goodput:.0f}, {b.per_cpu_s:.0f} ({b.preemptions:.0f}) |"
            for i, (c, b) in enumerate(pairs)
        ),
        *(
            [f"| median | {conv_med:.0f}, {conv_cpu:.0f} | {best_med:.0f}, {best_cpu:.0f} |"]
            if pairs
            else ["| none | no clean reference to alternate with | |"]
        ),
        "",
        "| tuner | value |",
        "|---|---|",
        f"| trail (time of each change since the tuner started) | {trail} |",
        f"| converged max_num_seqs (when the tuner stopped) | {converged} ({at_tune_end} before the steady window) |",
        f"| sweep-best (zero preemptions) | {best_text}{below}{dropped} |",
        ratio_row,
        f"| windows to converge | {intervals} evaluation windows (last change at {last_change:.0f} s; "
        f"goal ≤ {goal}) |",
        f"| preemptions after convergence | {steady.preemptions:.0f} over the {2 * args.measure:g} s steady "
        f"window with the tuner running, {alt_pre:.0f} in the converged value's alternating windows"
        f"{in_confirm} (goal 0) |",
        f"| confirming windows (preemptions) | {confirm_text} |",
        f"| steady-state goodput (tuner running) | {steady.goodput:.0f} tokens/s |",
        f"| requests | {run.completed} completed, {run.failed} failed |",
        *predictions,
        f"| verdict | {verdict} |",
    ]
    return "\n".join(lines)


def reference(
    sweep: Sweep,
    measure: Callable[[int, float, str], Window],
    converged: int | None,
    args: argparse.Namespace,
) -> tuple[int | None, list[tuple[Window, Window]]]:
    """The sweep-best (`sweep.confirmed_best`) and its alternating rounds against the converged value, (converged,
    sweep-best) per round. A sweep-best that preempts in its rounds is no zero-preemption value: the rule chooses
    again and the rounds are run again."""
    if not isinstance(converged, int):
        return sweep.best(), []
    while (best := confirmed_best(sweep, measure, args.measure, args.confirm)) is not None:
        pairs = []
        for i in range(args.rounds):
            first, second = (converged, best) if i % 2 == 0 else (best, converged)
            a = measure(first, args.measure, f"round {i + 1}")
            b = measure(second, args.measure, f"round {i + 1}")
            pairs.append((a, b) if first == converged else (b, a))
        if best == converged:
            return best, pairs
        sweep.add_later(best, [b for _, b in pairs], "its alternating rounds")
        if sweep.clean(best):
            return best, pairs
        print(f"sweep-best {best} preempted in its alternating rounds: not a zero-preemption value; the next "
              "clean value is the reference", flush=True)  # fmt: skip
    return None, []
