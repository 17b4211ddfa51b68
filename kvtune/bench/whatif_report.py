"""The what-if benchmark's report: each workload's predictions beside what was observed, and the summary over
workloads, from the results `kvtune bench whatif` stores (one JSON file per workload)."""

from __future__ import annotations

import argparse
import math
import statistics
from dataclasses import dataclass
from typing import Any

from kvtune.bench.benchmarks_md import machine_description
from kvtune.bench.whatif_window import window_from_json
from kvtune.bench.workloads import Workload
from kvtune.core.step_time import (
    PRIOR_PREFILL_TOKEN_IN_SEQUENCES,
    PRIOR_STEP_IN_SEQUENCES,
    OperatingPoint,
    fit_step_time,
)
from kvtune.core.whatif import DEFAULT_RISK_MARGIN, Candidate, Prediction, effective, simulate
from kvtune.core.workload_fit import FittedWorkload, fit_workload
from kvtune.harness.engine_process import ENGINE_THREADS

Result = dict[str, Any]  # one workload's run, as stored in its JSON file
CALIBRATION = ("default", "wide-prompts")  # the step-time prior's shape was fitted to these (step_time.py)


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
        f"**{w['name']}**: {Workload.from_record(w).describe()}; "
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
        f"Sweep-best {_best_text(result)}{_confirmed_text(result)}. NoPreemption picks: "
        + "; ".join(_replay_text(replay_verdict(result, i)) for i in range(len(result["picks"])))
        + f". Decision time (fit + {result['timing']['candidates']:.0f} candidates): "
        f"{result['timing']['wall_s'] * 1e3:.0f} ms wall, {result['timing']['cpu_s'] * 1e3:.0f} ms CPU. "
        f"Load average {result['load'][0][0]:.1f} → {result['load'][1][0]:.1f}; {result['minutes']:.1f} min; "
        f"{result['requests']['completed']} requests completed, {result['requests']['failed']} failed.",
        "",
    ]
    return out


def _best_text(result: Result) -> str:
    """The sweep-best, and the values measured below the sweep when none of it stayed clean."""
    below = result.get("below", {})
    added = (
        " (none of the sweep stayed clean; below it: "
        + ", ".join(f"{v} ({sum(w['preemptions'] for w in ws):.0f} preemptions)" for v, ws in below.items())
        + ")"
        if below
        else ""
    )
    best = result["sweep_best"]
    if best is None:
        return f"none: no value of the sweep nor below it, down to 1, stayed clean{added}"
    return f"{best}{added}"


def _confirmed_text(result: Result) -> str:
    confirmed = result.get("confirmed", {})
    if not confirmed:
        return ""
    seen = ", ".join(f"{v} ({w['preemptions']:.0f} in {w['seconds']:.0f} s)" for v, w in confirmed.items())
    return f" (confirming windows, preemptions: {seen})"


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


def report(results: list[Result], args: argparse.Namespace, method: str) -> str:
    """The section: `method` (the command's own account of what it does), then the summary and each workload."""
    return "\n".join(
        [
            "## What-if predictions against a live engine (`kvtune bench whatif`)",
            "",
            f"Method: {method} Each static window: {args.settle:g} s settle, "
            f"{args.measure:g} s measured; confirming windows {args.confirm:g} s; fit window {args.fit_seconds:g} s; "
            f"{args.rounds} alternating rounds. "
            f"Engine: `kvtune serve`, tiny model, {ENGINE_THREADS} torch thread; load: "
            "`kvtune.harness.load.BackgroundLoad`, closed loop, random token-id prompts, ignore_eos.",
            f"Machine: {machine_description()}, shared with other jobs (load averages below). Revision "
            f"{', '.join(sorted({str(r['revision']) for r in results}))}.",
            "",
            *summary_lines(results),
            "",
            *(line for result in results for line in workload_lines(result)),
        ]
    )
