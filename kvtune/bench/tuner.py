"""`kvtune bench tuner`: how good is the max_num_seqs the tuner converges to?

On one live engine (tiny model, a pool small enough to preempt) under a steady closed-loop workload:

1. a static sweep of max_num_seqs values through the admin API, in two passes (rising, then falling); each
   value is measured for goodput and preemptions, and the sweep-best is the best goodput among values with
   zero preemptions in both windows (one 6 s window missed a marginal value's rare preemptions, which then
   showed in the alternating rounds and made the "best" a value the tuner rightly rejects);
2. a too-high start, then the local-mode tuner (the same `decide` the operator runs) until it stops
   changing the value; the steady state is measured with the tuner still running (preemptions there are
   the "preemptions after convergence");
3. with the tuner stopped, the converged value and the sweep-best value measured alternately as static
   settings, several rounds, medians: the ratio compares like with like under the same machine noise (on
   a shared 2-core box one measurement swings by tens of percent). A sweep-best that preempts in these
   rounds was a marginal value the sweep's two windows missed: the next clean value replaces it.

Goodput is the engine's generation-tokens counter per second: a preempted request keeps its output and
recomputes prompt + output (as vLLM), so no counted token is thrown away, and the counter moves every step
where finished requests' totals move in lumps. 'delivered' (finished requests' generation tokens, from the
request-generation-tokens histogram's sum) is shown beside it as a cross-check.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from kvtune.bench.benchmarks_md import git_revision, machine_description, record_section
from kvtune.contract.metrics import GENERATION_TOKENS, PREEMPTIONS, REQUEST_GENERATION_TOKENS
from kvtune.core.predict import Forecast
from kvtune.errors import KvtuneError
from kvtune.harness.engine_process import (
    ENGINE_THREADS,
    start_engine,
    write_tiny_model_in_subprocess,
)
from kvtune.harness.load import BackgroundLoad, LoadShape
from kvtune.harness.server import ServerProcess
from kvtune.operator.decide.loop import Tick, run_loop
from kvtune.operator.decide.policy import Mode, TuningPolicy
from kvtune.operator.decide.sample import NoData, Sample
from kvtune.operator.io.actuators import KvtuneAdminActuator
from kvtune.operator.io.sources import MetricsEndpoint

TOKEN = "bench-tuner-token"


@dataclass(frozen=True)
class Measured:
    max_num_seqs: int
    goodput: float  # generation tokens per second (the engine's counter)
    delivered: float  # generation tokens of finished requests per second
    preemptions: float
    per_cpu_s: float = float("nan")  # generation tokens per CPU-second of the engine process
    seconds: float = float("nan")  # the window's measured span


def combine(a: Measured, b: Measured) -> Measured:
    """Two windows of one static value: mean rates, and every preemption either saw."""
    return Measured(
        a.max_num_seqs,
        (a.goodput + b.goodput) / 2,
        (a.delivered + b.delivered) / 2,
        a.preemptions + b.preemptions,
        (a.per_cpu_s + b.per_cpu_s) / 2,
        a.seconds + b.seconds,
    )


def time_weighted(windows: list[Measured]) -> tuple[float, float, float]:
    """One value's goodput and goodput per engine CPU-second over all its windows, each weighted by its
    span, and the total span: a 300 s confirming window outweighs a 6 s round fifty to one, as it should
    (one value's 6 s rounds spread by a third on this machine, BENCHMARKS.md)."""
    spans = [w.seconds for w in windows]
    total = sum(spans)
    if not windows or not total > 0:
        return float("nan"), float("nan"), 0.0
    goodput = sum(w.goodput * w.seconds for w in windows) / total
    per_cpu = sum(w.per_cpu_s * w.seconds for w in windows) / total
    return goodput, per_cpu, total


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (Linux /proc), NaN where unreadable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _read(source: MetricsEndpoint) -> Sample:
    sample = source.read()
    if isinstance(sample, NoData):
        raise KvtuneError("the engine's /metrics stopped answering")
    return sample


def _delivered(sample: Sample) -> float:
    histogram = sample.histograms.get(REQUEST_GENERATION_TOKENS)
    return histogram.total if histogram is not None else 0.0


def measure(source: MetricsEndpoint, seconds: float, max_num_seqs: int, pid: int = 0) -> Measured:
    first, cpu_first = _read(source), cpu_seconds(pid)
    time.sleep(seconds)
    last, cpu_last = _read(source), cpu_seconds(pid)
    span = last.timestamp - first.timestamp
    generated = last.counters[GENERATION_TOKENS] - first.counters[GENERATION_TOKENS]
    preempted = last.counters[PREEMPTIONS] - first.counters[PREEMPTIONS]
    cpu = cpu_last - cpu_first
    per_cpu = generated / cpu if cpu > 0 else float("nan")
    return Measured(
        max_num_seqs,
        generated / span,
        (_delivered(last) - _delivered(first)) / span,
        preempted,
        per_cpu,
        span,
    )


def intervals_to_converge(changes_at: list[float], began: float, window: float) -> int:
    """Evaluation windows from the tuner's start until the value stopped changing for good: the window
    the last change fell in (0 when it never changed)."""
    if not changes_at:
        return 0
    return int((changes_at[-1] - began) // window) + 1


@dataclass(frozen=True)
class Workload:
    """A named workload: the pool, the load and where the tuner starts, with a sweep around its optimum."""

    kv_cache_tokens: int
    clients: int
    prompt_len: str
    output_len: str
    start: int
    sweep: str
    why: str


# Three pool-to-footprint ratios (pool / mean full footprint about 9, 13 and 4.6): the tuner must converge on
# each, not on one workload it was tuned against.
WORKLOADS = {
    "default": Workload(4096, 16, "200:400", "100:200", 64, "4,6,7,8,9,10,12,16",
                        "the benchmark's first workload"),
    "wide-prompts": Workload(6144, 24, "150:450", "80:240", 48, "8,10,11,12,13,14,16",
                             "issue 15's workload: a larger pool, prompts spread three to one"),
    "long-outputs": Workload(2048, 8, "100:300", "150:350", 32, "2,3,4,5,6,8",
                             "a pool of few requests whose outputs outgrow their prompts"),
}  # fmt: skip
WORKLOAD_FLAGS = ("kv_cache_tokens", "clients", "prompt_len", "output_len", "start", "sweep")
# a clean value is one the pager stays quiet for: KVCachePreemptions fires on any preemption in 5 minutes,
# and values at the edge preempt a few times in that (wide-prompts' 13: 17 in 300 s) but not in seconds
CONFIRM_S = 300.0
RANDOM_SEED = 28  # issue 28's three seeded random workloads (kvtune.bench.whatif.random_workloads)


def all_workloads() -> dict[str, Workload]:
    """The named workloads, issue 28's (a workload the tuner had not seen) and its three seeded random ones
    (pool ÷ mean footprint spread over 3-20, prompt-heavy to output-heavy), the same the what-if benchmark
    measures."""
    from kvtune.bench.whatif import named_workloads, random_workloads  # it imports this module

    found = dict(WORKLOADS)
    for w in [named_workloads()["issue-28"], *random_workloads(RANDOM_SEED)]:
        found[w.name] = Workload(
            w.kv_cache_tokens, w.clients, f"{w.prompt_len[0]}:{w.prompt_len[1]}",
            f"{w.output_len[0]}:{w.output_len[1]}", w.start, ",".join(str(v) for v in w.sweep),
            "issue 28's workload, one the tuner had not seen" if w.name == "issue-28" else
            f"seeded random workload (seed {RANDOM_SEED}): {w.describe()}",
        )  # fmt: skip
    return found


def section_name(workload: str) -> str:
    """The BENCHMARKS.md section a workload's run rewrites (the default keeps the section it always had)."""
    return "tuner" if workload == "default" else f"tuner-{workload}"


def apply_workload(args: argparse.Namespace) -> argparse.Namespace:
    """Fill every workload flag left unset from the named preset; a flag given explicitly wins."""
    preset = all_workloads()[args.workload]
    for name in WORKLOAD_FLAGS:
        if getattr(args, name) is None:
            setattr(args, name, getattr(preset, name))
    return args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", choices=sorted(all_workloads()), default="default",
                        help="a named workload (its pool, load, start and sweep); the flags below override it")  # fmt: skip
    parser.add_argument("--sweep", help="static max_num_seqs values (default: the workload's)")
    parser.add_argument("--start", type=int, help="the too-high max_num_seqs the tuner starts at")
    parser.add_argument("--kv-cache-tokens", type=int)
    parser.add_argument("--clients", type=int)
    parser.add_argument("--prompt-len")
    parser.add_argument("--output-len")
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


def method_text(args: argparse.Namespace, shape: LoadShape) -> str:
    """The section's method paragraph, every figure taken from the run's arguments."""
    return (
        f"Method: one `kvtune serve` (tiny model, KV pool {args.kv_cache_tokens:,} tokens, {ENGINE_THREADS} "
        f"torch thread{'s' if ENGINE_THREADS != 1 else ''}) under {shape.clients} closed-loop clients (random "
        f"token-id prompts {args.prompt_len}, outputs {args.output_len} tokens, ignore_eos). "
        f"{workload_text(args.kv_cache_tokens, shape)} Goodput = the "
        "engine's generation-tokens counter per second (a preempted request keeps its output, so no counted "
        "token is thrown away); 'delivered' = generation tokens of finished requests per second (histogram "
        "sum), a cross-check that moves in lumps; 'per engine CPU-s' = generation tokens per CPU-second the "
        "engine process used (utime+stime), which discounts the time the shared box took the core away — "
        "the engine is always busy under this load, so on a quiet machine the two agree. Every static "
        f"measurement: set max_num_seqs through the admin API, {args.settle:g} s settle, {args.measure:g} s "
        "measured. (1) Static sweep in two passes (rising, then falling; the table shows mean rates and the "
        "preemptions of both windows); sweep-best = best goodput among values with zero preemptions in both. "
        f"(2) max_num_seqs {args.start}, then `kvtune operator --local` logic (interval {args.interval:g} s, "
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
        "clean value of the sweep replaces it and the rounds are run again. A tuner that settles on the "
        "sweep-best value itself reaches 100% of it; its rounds against itself are then shown as the noise."
    )


def _range(text: str) -> tuple[int, int]:
    low, high = (int(part) for part in text.split(":"))
    return low, high


def run(args: argparse.Namespace) -> int:
    args = apply_workload(args)
    sweep = [int(v) for v in args.sweep.split(",")]
    shape = LoadShape(args.clients, _range(args.prompt_len), _range(args.output_len))
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        token_file = folder / "token"
        token_file.write_text(TOKEN)
        model = write_tiny_model_in_subprocess(folder / "tiny")
        engine = start_engine(model, token_file, folder / "engine.log", "--kv-cache-tokens",
                              str(args.kv_cache_tokens), "--max-num-seqs", str(args.start))  # fmt: skip
        try:
            result = _bench(engine, shape, sweep, args)
        finally:
            engine.stop()
    print(result)
    if not args.no_record:
        record_section(section_name(args.workload), result)
    return 0


def _static(actuator: KvtuneAdminActuator, source: MetricsEndpoint, value: int, args: argparse.Namespace,
            label: str, pid: int, seconds: float | None = None) -> Measured:  # fmt: skip
    actuator.apply("max_num_seqs", value)
    time.sleep(args.settle)
    row = measure(source, args.measure if seconds is None else seconds, value, pid)
    print(f"{label} max_num_seqs {value}: goodput {row.goodput:.0f} tokens/s (delivered {row.delivered:.0f}, {row.per_cpu_s:.0f} per engine CPU-s), "
          f"{row.preemptions:.0f} preemptions", flush=True)  # fmt: skip
    return row


def _next_reference(clean: list[Measured], disqualified: list[tuple[int, float, str]]) -> Measured | None:
    """The best goodput among the sweep's clean values not yet disqualified: the reference."""
    dropped = {value for value, _, _ in disqualified}
    left = [row for row in clean if row.max_num_seqs not in dropped]
    return max(left, key=lambda row: row.goodput) if left else None


def _row(r: Measured) -> str:
    return f"| {r.max_num_seqs} | {r.goodput:.0f} | {r.delivered:.0f} | {r.per_cpu_s:.0f} | {r.preemptions:.0f} |"


def prediction_rows(
    ticks: list[Tick], began: float, steady: Measured, steady_s: float, converged_goodput: float
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
        error = f.goodput / converged_goodput - 1 if converged_goodput > 0 else float("nan")
        rows.append(
            f"| last forecast against the outcome | {f.value}: predicted {f.preemptions_per_min:.1f}/min, observed "
            f"{steady.preemptions / steady_s * 60:.1f}/min over the {steady_s:g} s steady window; goodput "
            f"predicted {f.goodput:.0f}, measured {converged_goodput:.0f} tokens/s (its windows, span-weighted; "
            f"prediction error {error:+.0%}) |"
        )
    rows.append(
        f"| fell back to measured stepping | {'yes' if last.stepping else 'no'} ({last.misses} misses) |"
    )
    return rows


def _bench(engine: ServerProcess, shape: LoadShape, sweep: list[int], args: argparse.Namespace) -> str:
    source = MetricsEndpoint(engine.url)
    actuator = KvtuneAdminActuator(engine.url, TOKEN)
    pid = engine.process.pid
    load_before = os.getloadavg()
    started = time.monotonic()
    load = BackgroundLoad(engine.url, shape).start()
    try:
        # two passes, up then down: one window of a few seconds can miss a value's rare preemption
        rising = [_static(actuator, source, value, args, "static", pid) for value in sweep]
        falling = {value: _static(actuator, source, value, args, "static", pid) for value in reversed(sweep)}
        rows = [combine(row, falling[row.max_num_seqs]) for row in rising]
        start_row = _static(actuator, source, args.start, args, "start", pid)
        clean = [row for row in rows if row.preemptions == 0]
        best = max(clean, key=lambda row: row.goodput) if clean else None
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
            steady = measure(source, 2 * args.measure, converged or 0, pid)
        finally:
            stop.set()
            loop.join(30)
        at_tune_end = converged
        converged = actuator.current().values.get("max_num_seqs")  # the tuner may still have moved it
        print(
            f"tuner: {at_tune_end} after {args.tune_seconds:g} s, {converged} after the steady window",
            flush=True,
        )
        pairs: list[tuple[Measured, Measured]] = []
        disqualified: list[tuple[int, float, str]] = []  # sweep-bests that preempted, and where
        confirmed: dict[int, Measured] = {}  # the long windows: the sweep-bests tried and the converged value
        while best is not None and isinstance(converged, int):
            value = best.max_num_seqs
            if args.confirm > 0 and value not in confirmed:
                confirmed[value] = _static(
                    actuator, source, value, args, "confirm", pid, seconds=args.confirm
                )
                if confirmed[value].preemptions > 0 and value != converged:
                    print(f"sweep-best {value} preempted {confirmed[value].preemptions:.0f} times in its "
                          f"{args.confirm:g} s confirming window: the next clean value is the reference", flush=True)  # fmt: skip
                    disqualified.append(
                        (value, confirmed[value].preemptions, f"its {args.confirm:g} s confirming window")
                    )
                    best = _next_reference(clean, disqualified)
                    continue
            pairs = []
            for i in range(args.rounds):
                first, second = (
                    (converged, best.max_num_seqs) if i % 2 == 0 else (best.max_num_seqs, converged)
                )
                a = _static(actuator, source, first, args, f"round {i + 1}", pid)
                b = _static(actuator, source, second, args, f"round {i + 1}", pid)
                pairs.append((a, b) if first == converged else (b, a))
            # the sweep's two windows can miss a marginal value's preemptions (6 s each); more windows that
            # show them make it no zero-preemption value: the next clean value is the reference instead
            shown = sum(b.preemptions for _, b in pairs)
            if shown == 0 or best.max_num_seqs == converged:
                break
            print(f"sweep-best {best.max_num_seqs} preempted {shown:.0f} times in its alternating rounds: "
                  "not a zero-preemption value; the next clean value is the reference", flush=True)  # fmt: skip
            disqualified.append((best.max_num_seqs, shown, "its alternating rounds"))
            best = _next_reference(clean, disqualified)
        if args.confirm > 0 and isinstance(converged, int) and converged not in confirmed:
            confirmed[converged] = _static(
                actuator, source, converged, args, "confirm", pid, seconds=args.confirm
            )
    finally:
        tally = load.stop()
    load_after = os.getloadavg()
    minutes = (time.monotonic() - started) / 60
    changes = [(t.at, change) for t in ticks for change, outcome in t.applied if outcome.ok]
    intervals = intervals_to_converge([at for at, _ in changes], began, args.evaluation_window)
    last_change = changes[-1][0] - began if changes else 0.0
    trail = " → ".join([str(args.start)] + [f"{change.value} ({at - began:.0f} s)" for at, change in changes])
    conv_med = statistics.median(c.goodput for c, _ in pairs) if pairs else float("nan")
    best_med = statistics.median(b.goodput for _, b in pairs) if pairs else float("nan")
    ratio = conv_med / best_med if pairs and best_med > 0 else float("nan")
    conv_cpu = statistics.median(c.per_cpu_s for c, _ in pairs) if pairs else float("nan")
    best_cpu = statistics.median(b.per_cpu_s for _, b in pairs) if pairs else float("nan")
    same_value = best is not None and converged == best.max_num_seqs
    conv_tw, conv_tw_cpu, conv_s = time_weighted(
        [c for c, _ in pairs] + ([confirmed[converged]] if converged in confirmed else [])
    )
    best_tw, best_tw_cpu, best_s = time_weighted(
        [b for _, b in pairs]
        + ([confirmed[best.max_num_seqs]] if best and best.max_num_seqs in confirmed else [])
    )
    weighted = conv_tw / best_tw if best_tw > 0 else float("nan")
    # on the sweep-best value itself both columns measure the converged value: both count as after
    alt_pre = sum(c.preemptions + (b.preemptions if same_value else 0) for c, b in pairs)
    confirm_pre = (
        confirmed[converged].preemptions if isinstance(converged, int) and converged in confirmed else 0.0
    )
    footprint = _mean(shape.prompt_len) + _mean(shape.output_len)
    clean_after = steady.preemptions == 0 and alt_pre == 0 and confirm_pre == 0
    dropped = "".join(
        f"; {value} dropped: it preempted {shown:.0f} times in {where}"
        for value, shown, where in disqualified
    )
    # The tuner settling on the sweep-best value itself reaches 100% of it by definition; the alternating
    # rounds then compare a setting with itself, and their ratio is the machine's noise, shown beside.
    reached = 1.0 if same_value else weighted
    reached_text = (
        f"100% (the sweep-best value itself; its alternating rounds against itself: {ratio:.0%}, noise)"
        if same_value
        else f"{weighted:.0%} over every window (rounds' medians {ratio:.0%})"
    )
    goal = 5 if args.no_predict else 3  # issue 28: predicting, ≤ 3 windows
    verdict = (
        f"workload {args.workload}: pool ÷ mean footprint {args.kv_cache_tokens / footprint:.1f}; "
        f"windows to converge {intervals} (goal ≤ {goal}); converged {converged}, sweep-best "
        f"{best.max_num_seqs if best else 'none'}; goodput ÷ sweep-best {reached_text} (goal ≥ 95%); "
        f"preemptions after {steady.preemptions + alt_pre + confirm_pre:.0f} (goal 0): "
        + ("met" if intervals <= goal and reached >= 0.95 and clean_after else "NOT met")
    )
    predictions = prediction_rows(ticks, began, steady, 2 * args.measure, conv_tw)
    in_confirm = (
        f", {confirm_pre:.0f} in its {args.confirm:g} s confirming window"
        if isinstance(converged, int) and converged in confirmed
        else ""
    )
    confirm_text = ", ".join(f"{v}: {m.preemptions:.0f} in {args.confirm:g} s" for v, m in confirmed.items())
    confirm_text = confirm_text or "none"
    print(verdict, flush=True)
    lines = [
        f"## Tuner, workload {args.workload} (`kvtune bench tuner --workload {args.workload}`)",
        "",
        f"Workload {args.workload}: {all_workloads()[args.workload].why}; KV pool {args.kv_cache_tokens:,} tokens ÷ "
        f"mean full footprint {footprint:.0f} tokens = {args.kv_cache_tokens / footprint:.1f}.",
        "",
        method_text(args, shape),
        f"Machine: {machine_description()}, shared (another benchmark may be running). "
        f"Revision: {git_revision()}. Load average (1/5/15 min) at start "
        f"{load_before[0]:.2f}/{load_before[1]:.2f}/{load_before[2]:.2f}, at end "
        f"{load_after[0]:.2f}/{load_after[1]:.2f}/{load_after[2]:.2f}. Run took {minutes:.1f} min.",
        "",
        "| max_num_seqs (static sweep, 2 passes) | goodput tokens/s | delivered tokens/s | tokens per engine CPU-s | "
        "preemptions |",
        "|---:|---:|---:|---:|---:|",
        *(_row(r) for r in [*rows, start_row]),
        "",
        "| alternating round | converged: goodput, per CPU-s (preemptions) | sweep-best: goodput, per CPU-s "
        "(preemptions) |",
        "|---:|---:|---:|",
        *(
            f"| {i + 1} | {c.goodput:.0f}, {c.per_cpu_s:.0f} ({c.preemptions:.0f}) | "
            f"{b.goodput:.0f}, {b.per_cpu_s:.0f} ({b.preemptions:.0f}) |"
            for i, (c, b) in enumerate(pairs)
        ),
        f"| median | {conv_med:.0f}, {conv_cpu:.0f} | {best_med:.0f}, {best_cpu:.0f} |",
        "",
        "| tuner | value |",
        "|---|---|",
        f"| trail (time of each change since the tuner started) | {trail} |",
        f"| converged max_num_seqs (when the tuner stopped) | {converged} ({at_tune_end} before the steady window) |",
        f"| sweep-best (zero preemptions) | {best.max_num_seqs if best else 'none'}{dropped} |",
        f"| goodput ÷ sweep-best | {weighted:.0%} wall-clock, {conv_tw_cpu / best_tw_cpu:.0%} per engine "
        f"CPU-second over every window of each value after the tuner stopped ({conv_s:.0f} s against "
        f"{best_s:.0f} s, span-weighted); the alternating rounds' medians alone: {ratio:.0%} and "
        f"{conv_cpu / best_cpu:.0%} (goal ≥ 95%) |",
        f"| windows to converge | {intervals} evaluation windows (last change at {last_change:.0f} s; "
        f"goal ≤ {goal}) |",
        f"| preemptions after convergence | {steady.preemptions:.0f} over the {2 * args.measure:g} s steady "
        f"window with the tuner running, {alt_pre:.0f} in the converged value's alternating windows"
        f"{in_confirm} (goal 0) |",
        f"| confirming windows (preemptions) | {confirm_text} |",
        f"| steady-state goodput (tuner running) | {steady.goodput:.0f} tokens/s |",
        f"| requests | {tally.completed} completed, {len(tally.failures)} failed |",
        *predictions,
        f"| verdict | {verdict} |",
    ]
    return "\n".join(lines)
