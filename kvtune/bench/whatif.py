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
   issue-28's edge); a value that preempts there is no clean value, and the sweep-best is chosen again;
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
import math
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from kvtune.bench.benchmarks_md import git_revision, machine_description, record_section
from kvtune.bench.tuner import TOKEN, WORKLOADS, cpu_seconds
from kvtune.bench.whatif_window import Reading, coarsen, metrics_window, window_from_json
from kvtune.core.objectives import Pick, no_preemption
from kvtune.core.predict import Objective, plan
from kvtune.core.step_time import (
    PRIOR_PREFILL_TOKEN_IN_SEQUENCES,
    PRIOR_STEP_IN_SEQUENCES,
    OperatingPoint,
    fit_step_time,
)
from kvtune.core.whatif import (
    DEFAULT_RISK_MARGIN,
    EDGE_SEEDS,
    Candidate,
    Prediction,
    decision_table,
    effective,
    predictions_for,
    simulate,
    what_if,
)
from kvtune.core.workload_fit import (
    FittedWorkload,
    Insufficient,
    MetricsWindow,
    fit_workload,
    operating_point,
)
from kvtune.errors import KvtuneError
from kvtune.harness.engine_process import (
    ENGINE_THREADS,
    start_engine,
    write_tiny_model_in_subprocess,
)
from kvtune.harness.load import BackgroundLoad, LoadShape
from kvtune.harness.server import ServerProcess
from kvtune.operator.decide.sample import NoData, sample_from_series
from kvtune.operator.io.actuators import KvtuneAdminActuator
from kvtune.operator.io.sources import MetricsEndpoint

Result = dict[str, Any]  # one workload's run, as stored in its JSON file
SECTION = "whatif"


@dataclass(frozen=True)
class Workload:
    name: str
    kv_cache_tokens: int
    clients: int
    prompt_len: tuple[int, int]
    output_len: tuple[int, int]
    start: int
    sweep: tuple[int, ...]

    @property
    def footprint(self) -> float:
        return sum(self.prompt_len) / 2 + sum(self.output_len) / 2

    @property
    def ratio(self) -> float:
        return self.kv_cache_tokens / self.footprint

    @property
    def prompt_share(self) -> float:
        return sum(self.prompt_len) / 2 / self.footprint

    def describe(self) -> str:
        return (
            f"pool {self.kv_cache_tokens:,}, {self.clients} clients, prompts {self.prompt_len[0]}:{self.prompt_len[1]}, "
            f"outputs {self.output_len[0]}:{self.output_len[1]} (pool ÷ mean footprint {self.ratio:.1f}, "
            f"prompt share {self.prompt_share:.0%})"
        )


def _span(text: str) -> tuple[int, int]:
    low, high = (int(v) for v in text.split(":"))
    return low, high


def named_workloads() -> dict[str, Workload]:
    """The tuner benchmark's named workloads, and issue 28's (a workload the tuner had not seen)."""
    found = {
        name: Workload(name, w.kv_cache_tokens, w.clients, _span(w.prompt_len), _span(w.output_len), w.start,
                       tuple(int(v) for v in w.sweep.split(",")))
        for name, w in WORKLOADS.items()
    }  # fmt: skip
    found["issue-28"] = Workload(
        "issue-28", 10240, 40, (600, 1400), (40, 400), 96, (4, 6, 8, 10, 12, 14, 16, 20)
    )
    return found


def random_workloads(seed: int, count: int = 3) -> list[Workload]:
    """`count` seeded workloads spread over pool ÷ mean footprint 3 to 20 (one per equal slice of that
    range, in log scale) and over prompt shares from output-heavy (0.2) to prompt-heavy (0.8), each slice
    of both ranges used once, paired at random. Clients over-subscribe the pool by half; the sweep spans
    0.4-1.6× the pool's mean-footprint capacity; the start is twice the clients."""
    rng = random.Random(seed)
    ratio_slices = [(3 * (20 / 3) ** (i / count), 3 * (20 / 3) ** ((i + 1) / count)) for i in range(count)]
    share_slices = [(0.2 + 0.6 * i / count, 0.2 + 0.6 * (i + 1) / count) for i in range(count)]
    rng.shuffle(share_slices)
    found = []
    for i, ((r_low, r_high), (s_low, s_high)) in enumerate(zip(ratio_slices, share_slices, strict=True)):
        ratio = math.exp(rng.uniform(math.log(r_low), math.log(r_high)))
        share = rng.uniform(s_low, s_high)
        footprint = rng.uniform(300, 900)
        prompt, output = share * footprint, (1 - share) * footprint
        spread = rng.uniform(0.3, 0.6)  # each length uniform on mean × (1 ± spread)
        prompt_len = (max(1, round(prompt * (1 - spread))), round(prompt * (1 + spread)))
        output_len = (max(1, round(output * (1 - spread))), round(output * (1 + spread)))
        pool = max(16, round(ratio * footprint / 16) * 16)
        pool = max(pool, (prompt_len[1] + output_len[1] + 32) // 16 * 16)
        capacity = pool / (sum(prompt_len) / 2 + sum(output_len) / 2)
        clients = max(4, math.ceil(1.5 * capacity))
        sweep = sorted({max(1, round(capacity * f)) for f in (0.4, 0.6, 0.8, 0.9, 1.0, 1.1, 1.25, 1.6)})
        found.append(Workload(f"random-{seed}-{i + 1}", pool, clients, prompt_len, output_len, 2 * clients,
                              tuple(sweep)))  # fmt: skip
    return found


@dataclass(frozen=True)
class Window:
    """One measured window of a static value."""

    max_num_seqs: int
    seconds: float
    goodput: float
    per_cpu_s: float
    preemptions: float
    point: OperatingPoint | None
    cpu_share: float  # engine CPU-seconds per second of the window


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
ATTEMPTS = 3  # a machine shared with other jobs can starve the engine past one HTTP timeout
HTTP_TIMEOUT_S = 30.0


def margins(args: argparse.Namespace) -> list[float]:
    return [float(m) for m in dict.fromkeys(args.risk_margins.split(","))]


def _read(source: MetricsEndpoint) -> Reading:
    series = source.series()
    for _ in range(ATTEMPTS - 1):
        if not isinstance(series, NoData):
            break
        series = source.series()
    if isinstance(series, NoData):
        raise KvtuneError(f"the engine's /metrics stopped answering: {series.reason}")
    sample = sample_from_series(series, time.time(), source.url)
    if isinstance(sample, NoData):
        raise KvtuneError(f"the engine's /metrics held nothing the operator reads: {sample.reason}")
    return Reading(sample, tuple(series))


def _scraped(source: MetricsEndpoint, seconds: float) -> list[Reading]:
    readings = [_read(source)]
    began = time.monotonic()
    while time.monotonic() - began < seconds:
        time.sleep(max(0.0, min(1.0, seconds - (time.monotonic() - began))))
        readings.append(_read(source))
    return readings


def _measure(engine: ServerProcess, source: MetricsEndpoint, value: int, seconds: float) -> Window:
    cpu_before = cpu_seconds(engine.process.pid)
    readings = _scraped(source, seconds)
    cpu = cpu_seconds(engine.process.pid) - cpu_before
    window = metrics_window(readings)
    first, last = window.scrapes[0], window.scrapes[-1]
    span = last.at - first.at
    generated = last.generated_tokens - first.generated_tokens
    point = None
    if window.prompt_len and window.output_len and window.prompt_len.count and window.output_len.count:
        mean_prompt = window.prompt_len.total / window.prompt_len.count
        mean_output = window.output_len.total / window.output_len.count
        point = operating_point(window.scrapes, mean_prompt, mean_output, 0.0, window.inter_token_latency)
    return Window(value, span, generated / span, generated / cpu if cpu > 0 else math.nan,
                  last.preemptions - first.preemptions, point, cpu / span)  # fmt: skip


def _static(engine: ServerProcess, source: MetricsEndpoint, actuator: KvtuneAdminActuator, value: int,
            args: argparse.Namespace, label: str, seconds: float | None = None) -> Window:  # fmt: skip
    outcome = actuator.apply("max_num_seqs", value)
    for _ in range(ATTEMPTS - 1):
        if outcome.ok:
            break
        outcome = actuator.apply("max_num_seqs", value)
    if not outcome.ok:
        raise KvtuneError(f"setting max_num_seqs {value} failed: {outcome.error}")
    time.sleep(args.settle)
    row = _measure(engine, source, value, args.measure if seconds is None else seconds)
    print(f"  {label} {value}: goodput {row.goodput:.0f} tokens/s ({row.per_cpu_s:.0f} per engine CPU-s), "
          f"{row.preemptions:.0f} preemptions", flush=True)  # fmt: skip
    return row


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
    engine: ServerProcess, source: MetricsEndpoint, workload: Workload, args: argparse.Namespace
) -> tuple[list[Reading], MetricsWindow, FittedWorkload, float]:
    """Settle, then scrape the fit window (extended by half its length while the fit finds it
    insufficient, as an operator waits for more evidence); the engine's CPU share over it."""
    time.sleep(2 * args.settle)
    cpu_before = cpu_seconds(engine.process.pid)
    readings = _scraped(source, args.fit_seconds)
    window = metrics_window(readings)
    fit = fit_workload(window)
    while isinstance(fit, Insufficient) and len(readings) < 4 * args.fit_seconds:
        print(f"  fit window extended: {fit}", flush=True)
        readings += _scraped(source, args.fit_seconds / 2)[1:]
        window = metrics_window(readings)
        fit = fit_workload(window)
    if isinstance(fit, Insufficient):
        raise KvtuneError(f"workload {workload.name}: the fit window was not enough: {fit}")
    span = readings[-1].sample.timestamp - readings[0].sample.timestamp
    print(f"  fit: {fit.summary()}", flush=True)
    return readings, window, fit, (cpu_seconds(engine.process.pid) - cpu_before) / span


def _with_engine(workload: Workload, run: Callable[[ServerProcess], Result]) -> Result:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "token").write_text(TOKEN)
        model = write_tiny_model_in_subprocess(folder / "tiny")
        engine = start_engine(model, folder / "token", folder / "engine.log", "--kv-cache-tokens",
                              str(workload.kv_cache_tokens), "--max-num-seqs", str(workload.start))  # fmt: skip
        try:
            return run(engine)
        finally:
            engine.stop()


def run_workload(workload: Workload, args: argparse.Namespace) -> Result:
    shape = LoadShape(workload.clients, workload.prompt_len, workload.output_len)
    return _with_engine(workload, lambda engine: _bench(engine, workload, shape, args))


def _bench(engine: ServerProcess, workload: Workload, shape: LoadShape, args: argparse.Namespace) -> Result:
    source = MetricsEndpoint(engine.url, timeout=HTTP_TIMEOUT_S)
    actuator = KvtuneAdminActuator(engine.url, TOKEN, timeout=HTTP_TIMEOUT_S)
    load_before = os.getloadavg()
    began = time.monotonic()
    print(f"workload {workload.name}: {workload.describe()}", flush=True)
    load = BackgroundLoad(engine.url, shape).start()
    try:
        readings, window, fit, fit_cpu_share = _fit_window(engine, source, workload, args)
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
        rising = [_static(engine, source, actuator, v, args, "static") for v in values]
        falling = {v: _static(engine, source, actuator, v, args, "static") for v in reversed(values)}
        confirmed = confirm_clean(rising, falling, lambda v: _static(
            engine, source, actuator, v, args, "confirm", seconds=args.confirm))  # fmt: skip
        best = sweep_best(rising, falling, confirmed)
        rounds: dict[int, list[tuple[Window, Window]]] = {}
        for value in sorted({p.max_num_seqs for p in picks.values() if p.max_num_seqs is not None}):
            if best is None or value == best:
                continue
            rounds[value] = []
            for i in range(args.rounds):
                order = (value, best) if i % 2 == 0 else (best, value)
                got = {v: _static(engine, source, actuator, v, args, f"round {i + 1}") for v in order}
                rounds[value].append((got[value], got[best]))
    finally:
        tally = load.stop()
    load_after = os.getloadavg()
    timing = _timing(window)
    return {
        "workload": asdict(workload),
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
        "rising": [asdict(r) for r in rising],
        "falling": [asdict(falling[v]) for v in values],
        "confirmed": {str(v): asdict(w) for v, w in confirmed.items()},
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


def sweep_best(rising: list[Window], falling: dict[int, Window], confirmed: dict[int, Window]) -> int | None:
    """The best goodput (both passes summed) among values no window saw preempt."""
    clean = [r for r in rising if r.preemptions == 0 and falling[r.max_num_seqs].preemptions == 0
             and (r.max_num_seqs not in confirmed or confirmed[r.max_num_seqs].preemptions == 0)]  # fmt: skip
    if not clean:
        return None
    return max(clean, key=lambda r: r.goodput + falling[r.max_num_seqs].goodput).max_num_seqs


def confirm_clean(
    rising: list[Window], falling: dict[int, Window], measure: Callable[[int], Window]
) -> dict[int, Window]:
    """One long window for each value around the sweep-best that its two short windows saw clean, the
    sweep-best chosen again until every value around it is confirmed (each value once)."""
    confirmed: dict[int, Window] = {}
    values = [r.max_num_seqs for r in rising]
    seen = {r.max_num_seqs: r.preemptions + falling[r.max_num_seqs].preemptions for r in rising}
    while (best := sweep_best(rising, falling, confirmed)) is not None:
        i = values.index(best)
        todo = [v for v in values[max(0, i - 1) : i + 2] if seen[v] == 0 and v not in confirmed]
        if not todo:
            return confirmed
        for value in todo:
            confirmed[value] = measure(value)
    return confirmed


def _prediction(p: Prediction) -> dict[str, Any]:
    return asdict(p)


# --- the report ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Compared:
    """One sweep value: prediction beside observation."""

    max_num_seqs: int
    predicted_per_min: float
    expected_in_span: float  # preemptions, per generated token, times the tokens the windows generated
    chance: float  # that the windows see at least one preemption, from the run's own bursts
    observed: float
    span_s: float
    predicted_goodput: float
    observed_goodput: float
    predicted_per_cpu: float
    observed_per_cpu: float

    @property
    def agrees(self) -> bool:
        return (self.chance >= 0.5) == (self.observed > 0)

    @property
    def agrees_plain(self) -> bool:
        return (self.predicted_per_min > 0) == (self.observed > 0)

    @property
    def goodput_error(self) -> float:
        return self.predicted_goodput / self.observed_goodput - 1

    @property
    def per_cpu_error(self) -> float:
        return self.predicted_per_cpu / self.observed_per_cpu - 1


def prediction_from_json(data: dict[str, Any]) -> Prediction:
    fields = {**data, "candidate": Candidate(**data["candidate"])}
    fields["preemption_steps"] = tuple(data.get("preemption_steps", ()))
    return Prediction(**fields)


def compare(result: Result, coarse: bool = False) -> list[Compared]:
    """Each sweep value's prediction against its two windows. The windows are measured in steps of the
    predicted run (tokens they generated ÷ the run's tokens per step), so a machine slowed by other jobs
    does not count against the prediction, and the chance of a preemption in each is read off the run's
    own preemptions (`Prediction.chance_of_preemption`): predicted nonzero when at least one is more
    likely than not."""
    rows_in = result["predicted_coarse" if coarse else "predicted"]
    predicted = {int(p["candidate"]["max_num_seqs"]): prediction_from_json(p) for p in rows_in}
    share = float(result["fit_cpu_share"])
    confirmed = result.get("confirmed", {})
    rows = []
    for up, down in zip(result["rising"], result["falling"], strict=True):
        value = int(up["max_num_seqs"])
        p = predicted[value]
        windows = [up, down] + ([confirmed[str(value)]] if str(value) in confirmed else [])
        span = sum(w["seconds"] for w in windows)
        observed_goodput = sum(w["goodput"] * w["seconds"] for w in windows) / span
        per_step = p.tokens / p.steps if p.steps else 1.0
        clear = 1.0
        for w in windows:
            clear *= 1.0 - p.chance_of_preemption(w["goodput"] * w["seconds"] / per_step)
        expected = p.preemptions / p.tokens * observed_goodput * span if p.tokens else 0.0
        rows.append(
            Compared(
                value,
                p.preemptions_per_min,
                expected,
                1.0 - clear,
                sum(w["preemptions"] for w in windows),
                span,
                p.goodput,
                observed_goodput,
                p.goodput / share if share > 0 else math.nan,
                sum(w["per_cpu_s"] * w["seconds"] for w in windows) / span,
            )
        )
    return rows


def _pct(x: float) -> str:
    return f"{x:+.0%}" if math.isfinite(x) else "n/a"


def _median_ratio(rounds: list[list[dict[str, Any]]], key: str) -> float:
    picked = statistics.median(float(a[key]) for a, _ in rounds)
    return picked / statistics.median(float(b[key]) for _, b in rounds)


@dataclass(frozen=True)
class Replay:
    """The NoPreemption pick against the sweep-best: goodput ratios of the alternating rounds' medians
    (wall-clock, and per engine CPU-second) and the preemptions seen at the pick (sweep and rounds)."""

    text: str
    wall: float | None
    per_cpu: float | None
    preemptions: float

    def met(self, per_cpu: bool) -> bool:
        ratio = self.per_cpu if per_cpu else self.wall
        return ratio is not None and ratio >= 0.95 and self.preemptions == 0


def replay_verdict(result: Result, margin_index: int = 0) -> Replay:
    """The replay of the pick made at one of the run's risk margins (the first: the default's)."""
    margin, pick = result["picks"][margin_index][:2]
    best = result["sweep_best"]
    rows = {int(r["max_num_seqs"]): (r, d) for r, d in zip(result["rising"], result["falling"], strict=True)}
    confirmed = result.get("confirmed", {})
    if pick is None:
        return Replay(f"margin {margin:g}: no pick", None, None, math.nan)
    if best is None:
        return Replay(f"margin {margin:g}: pick {pick}; no sweep value was clean", None, None, math.nan)
    pre = 0.0
    if int(pick) in rows:
        up, down = rows[int(pick)]
        pre += up["preemptions"] + down["preemptions"]
        pre += confirmed[str(pick)]["preemptions"] if str(pick) in confirmed else 0.0
    if pick == best:
        return Replay(f"margin {margin:g}: pick {pick} = sweep-best", 1.0, 1.0, pre)
    rounds = result["rounds"][str(pick)]
    pre += sum(a["preemptions"] for a, _ in rounds)
    wall, per_cpu = _median_ratio(rounds, "goodput"), _median_ratio(rounds, "per_cpu_s")
    return Replay(f"margin {margin:g}: pick {pick} vs sweep-best {best}", wall, per_cpu, pre)


def cpu_points(result: Result) -> list[OperatingPoint]:
    """The sweep windows' operating points in engine CPU-seconds per step (wall step time × the engine's
    CPU share): the engine's own cost, without what the shared machine's other jobs took."""
    points = []
    for w in [*result["rising"], *result["falling"]]:
        share = w["goodput"] / w["per_cpu_s"] if w["per_cpu_s"] > 0 else 0.0
        if w["point"] is not None and share > 0:
            p = w["point"]
            points.append(OperatingPoint(p["batch"], p["prefill_per_step"], p["step_seconds"] * share))
    return points


def shape_text(results: list[Result]) -> str:
    """The step-time split each workload's sweep windows fit (in engine CPU-s), beside the prior's."""
    steps, prefills = [], []
    for result in results:
        model = fit_step_time(cpu_points(result))
        if model is not None and model.per_sequence_s > 0:
            steps.append(model.per_step_s / model.per_sequence_s)
            prefills.append(model.per_prefill_token_s / model.per_sequence_s)
    if not steps:
        return "no split could be fitted"
    return (
        f"a step's fixed cost = {statistics.median(steps):.0f} sequences (median over workloads; "
        f"{min(steps):.0f}-{max(steps):.0f}), a prefill token = {statistics.median(prefills):.2f} of one "
        f"({min(prefills):.2f}-{max(prefills):.2f}); the prior the predictions used: {PRIOR_STEP_IN_SEQUENCES:g} "
        f"and {PRIOR_PREFILL_TOKEN_IN_SEQUENCES:g} (`kvtune.core.step_time`)"
    )


@dataclass(frozen=True)
class SelfCheck:
    """The fit window replayed at its own setting: prediction and observation from the same seconds, so
    no drift of the machine between windows enters (preemptions per 1,000 generated tokens; goodput)."""

    predicted_per_k: float
    observed_per_k: float
    predicted_goodput: float
    observed_goodput: float


def self_check(result: Result) -> SelfCheck:
    fit = fit_workload(window_from_json(result["window"]))
    assert isinstance(fit, FittedWorkload)
    p = simulate(fit, effective(fit, Candidate(fit.settings.max_num_seqs)))
    seen = fit.observed
    generated = seen.goodput * seen.seconds
    observed_per_k = 1000 * seen.preemptions_per_min / 60 * seen.seconds / generated if generated else 0.0
    return SelfCheck(
        1000 * p.preemptions / p.tokens if p.tokens else 0.0, observed_per_k, p.goodput, seen.goodput
    )


def _replay_text(replay: Replay) -> str:
    if replay.wall is None or replay.per_cpu is None:
        return replay.text
    return (
        f"{replay.text}, goodput {replay.wall:.0%} of the sweep-best wall-clock, {replay.per_cpu:.0%} per "
        f"engine CPU-s, {replay.preemptions:.0f} preemptions at the pick"
    )


def workload_lines(result: Result) -> list[str]:
    w = result["workload"]
    rows = compare(result)
    coarse = {r.max_num_seqs: r for r in compare(result, coarse=True)}
    own = self_check(result)
    out = [
        f"**{w['name']}**: {Workload(**{**w, 'prompt_len': tuple(w['prompt_len']), 'output_len': tuple(w['output_len']), 'sweep': tuple(w['sweep'])}).describe()}; "
        f"fit at max_num_seqs {w['start']}: {result['fit']}. Step time: {result['step_time']}. The fit "
        f"window replayed at its own setting: {own.predicted_per_k:.2f} preemptions per 1,000 generated tokens "
        f"predicted, {own.observed_per_k:.2f} observed; goodput {own.predicted_goodput:.0f} predicted, "
        f"{own.observed_goodput:.0f} observed ({_pct(own.predicted_goodput / own.observed_goodput - 1)}).",
        "",
        "| max_num_seqs | predicted preemptions/min at the fit's speed | expected in the windows, chance of ≥ 1 | "
        "observed preemptions (windows' s) | agree | from 1-2-5 buckets: predicted/min, chance, agree | "
        "predicted goodput | observed goodput (error) | per engine CPU-s: predicted, observed (error) |",
        "|---:|---:|---:|---:|:---:|---:|---:|---:|---:|",
        *(
            f"| {r.max_num_seqs} | {r.predicted_per_min:.1f} | {r.expected_in_span:.1f}, {r.chance:.0%} | "
            f"{r.observed:.0f} ({r.span_s:.0f}) | {'yes' if r.agrees else 'NO'} | "
            f"{coarse[r.max_num_seqs].predicted_per_min:.1f}, {coarse[r.max_num_seqs].chance:.0%}, "
            f"{'yes' if coarse[r.max_num_seqs].agrees else 'NO'} | {r.predicted_goodput:.0f} | "
            f"{r.observed_goodput:.0f} ({_pct(r.goodput_error)}) | {r.predicted_per_cpu:.0f}, "
            f"{r.observed_per_cpu:.0f} ({_pct(r.per_cpu_error)}) |"
            for r in rows
        ),
        "",
        f"Sweep-best {result['sweep_best']}{_confirmed_text(result)}. NoPreemption picks: "
        + "; ".join(_replay_text(replay_verdict(result, i)) for i in range(len(result["picks"])))
        + f". Decision time (fit + {result['timing']['candidates']:.0f} candidates): "
        f"{result['timing']['wall_s'] * 1e3:.0f} ms wall, {result['timing']['cpu_s'] * 1e3:.0f} ms CPU. "
        f"Load average {result['load'][0][0]:.1f} → {result['load'][1][0]:.1f}; {result['minutes']:.1f} min; "
        f"{result['requests']['completed']} requests completed, {result['requests']['failed']} failed.",
        "",
    ]
    return out


def _confirmed_text(result: Result) -> str:
    confirmed = result.get("confirmed", {})
    if not confirmed:
        return ""
    seen = ", ".join(f"{v} ({w['preemptions']:.0f} in {w['seconds']:.0f} s)" for v, w in confirmed.items())
    return f" (confirming windows, preemptions: {seen})"


CALIBRATION = ("default", "wide-prompts")  # the step-time prior's shape was fitted to these (step_time.py)


def shape_errors(rows: list[Compared]) -> list[float]:
    """Per engine CPU-s errors of one workload after dividing out their median ratio: how well the
    prediction ranks the settings (what a decision between them needs), apart from its overall scale,
    which a machine whose speed drifts between the fit window and the measured ones moves as a whole."""
    ratios = [r.predicted_per_cpu / r.observed_per_cpu for r in rows if math.isfinite(r.per_cpu_error)]
    if not ratios:
        return []
    middle = statistics.median(ratios)
    return [ratio / middle - 1 for ratio in ratios]


def _errors(results: list[Result]) -> str:
    rows = [r for result in results for r in compare(result)]
    if not rows:
        return "none"
    wall = [abs(r.goodput_error) for r in rows]
    cpu = [abs(r.per_cpu_error) for r in rows if math.isfinite(r.per_cpu_error)]
    shape = [abs(e) for result in results for e in shape_errors(compare(result))]
    return (
        f"wall-clock {statistics.median(wall):.0%} (max {max(wall):.0%}); per engine CPU-s "
        f"{statistics.median(cpu):.0%} (max {max(cpu):.0%}); per engine CPU-s with each workload's common "
        f"scale divided out {statistics.median(shape):.0%} (max {max(shape):.0%})"
    )


def _ratio_text(checks: list[SelfCheck], what: str) -> str:
    if what == "goodput":
        ratios = [c.predicted_goodput / c.observed_goodput for c in checks if c.observed_goodput > 0]
    else:
        ratios = [c.predicted_per_k / c.observed_per_k for c in checks if c.observed_per_k > 0]
        zeros = sum(1 for c in checks if c.observed_per_k == 0)
        if zeros:
            agreeing = sum(1 for c in checks if c.observed_per_k == 0 and c.predicted_per_k == 0)
            return (
                f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}); {zeros} windows saw "
                f"none, of which {agreeing} predicted none"
                if ratios
                else f"{zeros} windows saw none, {agreeing} predicted none"
            )
    return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})" if ratios else "n/a"


def _run_seeds_rows(results: list[Result]) -> list[str]:
    """Where the predictions were made again with more seeds: the agreement of the run's own, beside."""
    if not all("predicted_run" in r for r in results):
        return []
    runs = [{**r, "predicted": r["predicted_run"]} for r in results]
    rows = [c for r in runs for c in compare(r)]
    near = [c for r in runs for c in around_best(r, compare(r))]
    seeds = ", ".join(sorted({str(r["seeds_run"]) for r in results}))
    return [
        f"| the same from the run's own predictions ({seeds} seeds pooled; the figures above: "
        f"{results[0]['seeds']} seeds, made again from each stored fit window) | all values "
        f"{sum(c.agrees for c in rows) / len(rows):.0%}; around the sweep-best "
        f"{sum(c.agrees for c in near) / max(1, len(near)):.0%} |"
    ]


def _widened(results: list[Result], index: int) -> str:
    """How the margin asked was widened over each workload's fit (the tuner's `Objective.for_fit`)."""
    used = [float(r["picks"][index][3]) for r in results if len(r["picks"][index]) > 3]
    margin = float(results[0]["picks"][index][0])
    default = " (the default)" if margin == DEFAULT_RISK_MARGIN else ""
    if not used or margin == 0:
        return default
    return f"{default}, widened to the fit's error as the tuner does: {min(used):.1%}-{max(used):.1%}"


def around_best(result: Result, rows: list[Compared]) -> list[Compared]:
    """The sweep-best and the sweep values on either side of it (3, or 2 at an end of the sweep): the
    static values a tuner's decision is about."""
    ordered = sorted(rows, key=lambda r: r.max_num_seqs)
    values = [r.max_num_seqs for r in ordered]
    best = result["sweep_best"]
    if best not in values:
        return []
    i = values.index(best)
    return ordered[max(0, i - 1) : i + 2]


def summary_lines(results: list[Result]) -> list[str]:
    rows = [r for result in results for r in compare(result)]
    near = [r for result in results for r in around_best(result, compare(result))]
    coarse = [r for result in results for r in compare(result, coarse=True)]
    agree = sum(r.agrees for r in rows) / len(rows)
    agree_plain = sum(r.agrees_plain for r in rows) / len(rows)
    agree_coarse = sum(r.agrees for r in coarse) / len(coarse)
    margins_run = [float(entry[0]) for entry in results[0]["picks"]]
    replay_rows = []
    for i, margin in enumerate(margins_run):
        replays = [replay_verdict(result, i) for result in results]
        good_wall = sum(1 for r in replays if r.met(per_cpu=False))
        good_cpu = sum(1 for r in replays if r.met(per_cpu=True))
        clean = sum(1 for r in replays if r.preemptions == 0)
        replay_rows.append(
            f"| NoPreemption pick at risk margin {margin:g}{_widened(results, i)}: "
            f"replays with 0 preemptions at ≥ 95% of the sweep-best (alternating medians) | **{good_cpu} of "
            f"{len(results)} per engine CPU-s, {good_wall} of {len(results)} wall-clock** (0 preemptions at the "
            f"pick: {clean} of {len(results)}) |"
        )
    timings = [result["timing"] for result in results]
    calibration = [r for r in results if r["workload"]["name"] in CALIBRATION]
    validation = [r for r in results if r["workload"]["name"] not in CALIBRATION]
    wall = [t["wall_s"] for t in timings]
    own = [self_check(result) for result in results]
    return [
        "| figure | value |",
        "|---|---|",
        f"| workloads | {len(results)} ({', '.join(str(r['workload']['name']) for r in results)}) |",
        f"| sweep values compared | {len(rows)} |",
        f"| zero-vs-nonzero agreement, predicted vs observed preemptions (goal ≥ 90%) | **{agree:.0%}** (plain "
        f"rate > 0: {agree_plain:.0%}; the same fit from vLLM's 1-2-5 buckets: {agree_coarse:.0%}) |",
        f"| the same over each workload's sweep-best and the sweep values on either side of it ({len(near)} "
        f"values; goal ≥ 90%) | **{sum(r.agrees for r in near) / max(1, len(near)):.0%}** |",
        *_run_seeds_rows(results),
        f"| goodput prediction error over those values, median abs: wall-clock, per engine CPU-s | "
        f"{statistics.median(abs(r.predicted_goodput / r.observed_goodput - 1) for r in near):.0%}, "
        f"{statistics.median(abs(r.predicted_per_cpu / r.observed_per_cpu - 1) for r in near):.0%} |",
        f"| the fit window replayed at its own setting (no machine drift between windows): preemptions per "
        f"1,000 generated tokens, predicted ÷ observed, median (range) | {_ratio_text(own, 'preemptions')} |",
        f"| the same: goodput, predicted ÷ observed, median (range) | {_ratio_text(own, 'goodput')} |",
        f"| goodput prediction error, median abs, workloads the step-time prior was shaped on | {_errors(calibration)} |",
        f"| goodput prediction error, median abs, the other workloads | {_errors(validation)} |",
        *replay_rows,
        f"| decision time: the fit + its decision table (max_num_seqs values and FP8, refined at the edge), median over "
        f"workloads | {statistics.median(wall) * 1e3:.0f} ms wall (max {max(wall) * 1e3:.0f}), "
        f"{statistics.median(t['cpu_s'] for t in timings) * 1e3:.0f} ms CPU; goal < 1 s |",
        f"| the step-time split each workload's sweep windows fit, in engine CPU-s | {shape_text(results)} |",
    ]


def report(results: list[Result], args: argparse.Namespace) -> str:
    return "\n".join(
        [
            "## What-if predictions against a live engine (`kvtune bench whatif`)",
            "",
            f"Method: {__doc__.split(chr(10) + chr(10), 1)[1].strip()} Each static window: {args.settle:g} s settle, "
            f"{args.measure:g} s measured; confirming windows {args.confirm:g} s; fit window {args.fit_seconds:g} s; "
            f"{args.rounds} alternating rounds. "
            f"Engine: `kvtune serve`, tiny model, {ENGINE_THREADS} torch thread; load: "
            "`kvtune.bench.load.BackgroundLoad`, closed loop, random token-id prompts, ignore_eos.",
            f"Machine: {machine_description()}, shared with other jobs (load averages below). Revision "
            f"{', '.join(sorted({str(r['revision']) for r in results}))}.",
            "",
            *summary_lines(results),
            "",
            *(line for result in results for line in workload_lines(result)),
        ]
    )


def run(args: argparse.Namespace) -> int:
    folder = Path(args.results)
    folder.mkdir(parents=True, exist_ok=True)
    named = named_workloads()
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
    body = report(results, args)
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
def _edge(engine: ServerProcess, workload: Workload, args: argparse.Namespace) -> Result:
    """Fit, find the NoPreemption edge at margin 0 (its values decided on the pooled seeds), then measure
    the two values on either side of it for `args.edge_seconds` each: preemptions per generated token over
    a window long enough to see a rare one, which two short sweep windows can miss."""
    source = MetricsEndpoint(engine.url, timeout=HTTP_TIMEOUT_S)
    actuator = KvtuneAdminActuator(engine.url, TOKEN, timeout=HTTP_TIMEOUT_S)
    load_before = os.getloadavg()
    print(f"workload {workload.name} (edge): {workload.describe()}", flush=True)
    load = BackgroundLoad(
        engine.url, LoadShape(workload.clients, workload.prompt_len, workload.output_len)
    ).start()
    try:
        _, window, fit, _ = _fit_window(engine, source, workload, args)
        table = predictions_for(decision_table(fit, risk_margin=0.0), fp8=False)
        pick = no_preemption(table, 0.0).max_num_seqs or 1
        rows = []
        for value in (pick, pick + 1):
            predicted = next(p for p in table if p.candidate.max_num_seqs == value)
            measured = _static(
                engine,
                source,
                actuator,
                value,
                argparse.Namespace(**{**vars(args), "measure": args.edge_seconds}),
                "edge",
            )
            tokens = measured.goodput * measured.seconds
            rows.append({"max_num_seqs": value, "predicted_per_k": 1000 * predicted.preemptions / max(1, predicted.tokens),
                         "predicted_seeds": predicted.seeds, "observed": measured.preemptions, "tokens": tokens,
                         "seconds": measured.seconds})  # fmt: skip
            print(f"  edge {value}: predicted {rows[-1]['predicted_per_k']:.2f} per 1,000 tokens, observed "
                  f"{measured.preemptions:.0f} in {tokens:,.0f} tokens", flush=True)  # fmt: skip
    finally:
        load.stop()
    return {"workload": asdict(workload), "window": asdict(window), "rows": rows, "revision": git_revision(),
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
