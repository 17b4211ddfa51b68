"""`kvtune bench doctor-vllm`: does `kvtune doctor`'s max_num_seqs fix a real vLLM, without overdoing it?

vLLM's CPU build serves the tiny checkpoint with a KV pool small enough that the saturating workload (a
fixed, seeded request list, every request sent at once) preempts at the original max_num_seqs. While that
first run is under load, the doctor samples vLLM's /metrics (through its Python API, exactly what
`kvtune doctor --metrics-url URL --json` does) and its `lower_max_num_seqs` remedy gives a value. vLLM is
then restarted with that value and the same request list is replayed; original and recommended runs
alternate (one server at a time, a fresh boot per run) and the medians are compared.

Pass: zero preemptions in every recommended run, no request lost, and recommended throughput (generated
tokens/s, median) at least `--min-ratio` of the original's: the value must cure preemption without being
needlessly conservative.

`--after-the-incident`: as a user runs the doctor, after the fact. The first run's load goes to its end
first; then the doctor reads the quiet vLLM, which it must diagnose from the counters since boot (and say
so), and the replays use that recommendation. Recorded in a section of its own.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvtune.bench.benchmarks_md import git_revision, machine_description, record_section
from kvtune.bench.vllm_cpu import (
    DEFAULT_VENV_DIR,
    VllmServerConfig,
    ensure_venv,
    installed_versions,
    start_server,
)
from kvtune.core.predict import Objective
from kvtune.errors import KvtuneError
from kvtune.harness.load import BatchSpec, LoadResult, run_batch
from kvtune.harness.scrape import metric_totals
from kvtune.operator.decide.ladder import plan
from kvtune.operator.decide.policy import TuningPolicy
from kvtune.operator.decide.sample import EngineView
from kvtune.operator.doctor.command import SINCE_BOOT, collect, examine, report
from kvtune.operator.doctor.whatif import what_if_section
from kvtune.operator.io.sources import MetricsEndpoint

ORIGINAL = "original"
RECOMMENDED = "recommended"
SUCCESS_METRIC = "vllm:request_success_total"
SECTION = "doctor-vllm"
SECTION_AFTER = "doctor-vllm-after-the-incident"
SECTION_WHATIF = "doctor-vllm-whatif"


@dataclass(frozen=True)
class Run:
    """One replay of the request list against one freshly booted vLLM."""

    label: str  # ORIGINAL, RECOMMENDED, or "diagnosis" (the run the doctor watched; not in the medians)
    max_num_seqs: int
    completed: int
    failed: int
    generated_tokens: int
    duration_s: float
    tokens_per_s: float
    preemptions: float | None

    @staticmethod
    def of(label: str, max_num_seqs: int, result: LoadResult) -> Run:
        return Run(
            label, max_num_seqs, result.completed, result.failed, result.generated_tokens,
            result.duration_s, result.generated_tokens_per_s, result.preemptions,
        )  # fmt: skip


@dataclass(frozen=True)
class Verdict:
    original_median: float | None
    recommended_median: float | None
    ratio: float | None
    recommended_preemptions: float | None  # summed over the recommended runs; None when unmeasured
    original_preemptions: float | None
    requests_lost: int
    min_ratio: float

    @property
    def cured(self) -> bool:
        return self.recommended_preemptions == 0

    @property
    def fast_enough(self) -> bool:
        return self.ratio is not None and self.ratio >= self.min_ratio

    @property
    def passed(self) -> bool:
        return self.cured and self.fast_enough and self.requests_lost == 0

    def reasons(self) -> list[str]:
        """Why it failed, one phrase each (empty when it passed)."""
        out = []
        if self.recommended_preemptions is None:
            out.append("no preemption figure for the recommended runs")
        elif not self.cured:
            out.append(f"still preempting with the recommended value ({self.recommended_preemptions:.0f})")
        if self.ratio is None:
            out.append("no throughput ratio")
        elif not self.fast_enough:
            out.append(
                f"throughput ratio {self.ratio:.2f} below {self.min_ratio:.2f}: needlessly conservative"
            )
        if self.requests_lost:
            out.append(f"{self.requests_lost} requests failed")
        return out


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _total(values: list[float | None]) -> float | None:
    if not values or any(v is None for v in values):
        return None
    return float(sum(v for v in values if v is not None))


def verdict(runs: list[Run], min_ratio: float = 0.8) -> Verdict:
    """Medians of the alternated original and recommended runs, and the pass/fail figures."""
    original = [r for r in runs if r.label == ORIGINAL]
    recommended = [r for r in runs if r.label == RECOMMENDED]
    original_median = _median([r.tokens_per_s for r in original])
    recommended_median = _median([r.tokens_per_s for r in recommended])
    ratio = None
    if original_median and recommended_median is not None:
        ratio = recommended_median / original_median
    return Verdict(
        original_median=original_median,
        recommended_median=recommended_median,
        ratio=ratio,
        recommended_preemptions=_total([r.preemptions for r in recommended]),
        original_preemptions=_total([r.preemptions for r in original]),
        requests_lost=sum(r.failed for r in runs if r.label in (ORIGINAL, RECOMMENDED)),
        min_ratio=min_ratio,
    )


def recommended_max_num_seqs(doctor_json: dict[str, Any]) -> int | None:
    """The `lower_max_num_seqs` remedy's recommended value, when the doctor says it applies."""
    for remedy in doctor_json.get("remedies", []):
        if remedy.get("remedy") == "lower_max_num_seqs" and remedy.get("applicable"):
            value = remedy.get("recommended")
            return int(value) if isinstance(value, int) else None
    return None


def whatif_max_num_seqs(doctor_json: dict[str, Any]) -> int | None:
    """The what-if table's recommendation (issue 28), when it made one."""
    what_if = doctor_json.get("what_if") or {}
    value = what_if.get("recommended")
    return int(value) if isinstance(value, int) else None


def section_name(after_the_incident: bool, recommend: str = "ladder") -> str:
    if recommend == "whatif":
        return SECTION_WHATIF
    return SECTION_AFTER if after_the_incident else SECTION


def not_looking_back(doctor_json: dict[str, Any]) -> str | None:
    """Why the doctor's report on the quiet vLLM is not a diagnosis from the counters since boot (the
    after-the-incident run's premise), or None when it is."""
    if doctor_json.get("basis") == SINCE_BOOT:
        return None
    notes = doctor_json.get("findings", {}).get("notes", [])
    said = "; ".join(str(note.get("message")) for note in notes) or "no findings"
    return f"the doctor did not diagnose from the counters since boot (status {doctor_json.get('status')}: {said})"


def remedy_evidence(doctor_json: dict[str, Any], name: str = "lower_max_num_seqs") -> str:
    for remedy in doctor_json.get("remedies", []):
        if remedy.get("remedy") == name:
            return str(remedy.get("evidence", ""))
    return ""


def _preemptions(value: float | None) -> str:
    return "n/a" if value is None else f"{value:,.0f}"


def format_runs(runs: list[Run]) -> str:
    lines = [
        "| run | config | max_num_seqs | completed | failed | generated tokens | duration (s) | tokens/s "
        "| preemptions |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for i, r in enumerate(runs):
        lines.append(
            f"| {i} | {r.label} | {r.max_num_seqs} | {r.completed} | {r.failed} | {r.generated_tokens:,} | "
            f"{r.duration_s:,.1f} | {r.tokens_per_s:,.1f} | {_preemptions(r.preemptions)} |"
        )
    return "\n".join(lines)


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def format_verdict(v: Verdict) -> str:
    status = "PASS" if v.passed else "FAIL: " + "; ".join(v.reasons())
    return "\n".join(
        [
            "| figure | value |",
            "|---|---|",
            f"| original tokens/s (median) | {_fmt(v.original_median, ',.1f')} |",
            f"| recommended tokens/s (median) | {_fmt(v.recommended_median, ',.1f')} |",
            f"| ratio (recommended ÷ original; goal ≥ {v.min_ratio:.2f}) | {_fmt(v.ratio, '.2f')} |",
            f"| preemptions, original runs (total) | {_preemptions(v.original_preemptions)} |",
            f"| preemptions, recommended runs (total; goal 0) | {_preemptions(v.recommended_preemptions)} |",
            f"| requests failed | {v.requests_lost} |",
            f"| result | {status} |",
        ]
    )


def schedule(rounds: int) -> list[str]:
    """original, recommended, original, recommended, ...: alternated so drift hits both alike."""
    return [label for _ in range(rounds) for label in (ORIGINAL, RECOMMENDED)]


# ---- the live parts ---------------------------------------------------------------------------------------


def other_vllm_running() -> bool:
    done = subprocess.run(["pgrep", "-f", "vllm.entrypoints"], capture_output=True, text=True, check=False)
    return bool(done.stdout.strip())


def wait_for_no_other_vllm(timeout_s: float, log: Any = print) -> None:
    """One vLLM at a time on this machine: wait while someone else's server runs."""
    deadline = time.monotonic() + timeout_s
    warned = False
    while other_vllm_running():
        if time.monotonic() > deadline:
            raise KvtuneError(
                f"another vLLM server is still running after {timeout_s:.0f} s; not starting ours"
            )
        if not warned:
            log("another vLLM server is running (pgrep -f vllm.entrypoints); waiting for it to finish")
            warned = True
        time.sleep(10.0)


def wait_for_finished(url: str, count: int, timeout_s: float) -> float:
    """Block until vLLM has finished `count` requests (so the doctor's histograms have data)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            done = metric_totals(httpx.get(f"{url}/metrics", timeout=10).text).get(SUCCESS_METRIC, 0.0)
        except (httpx.HTTPError, ValueError):  # unreachable, or a body that is not Prometheus text
            done = 0.0
        if done >= count or time.monotonic() > deadline:
            return done
        time.sleep(1.0)


def run_doctor(url: str, samples: int, window_s: float, known: EngineView) -> dict[str, Any]:
    """What `kvtune doctor --metrics-url URL --json --samples N --window-seconds W` prints, as a dict (on
    a quiet engine, from its counters since boot, as the command does)."""
    taken, failure = collect(MetricsEndpoint(url), samples, window_s)
    found = examine(taken, failure, known, quiet_looks_back=True)
    d, engine = found.diagnosis, found.engine
    # the what-if table as the command prints it (vLLM's CPU build: no CUDA graphs, any value)
    what_if = what_if_section(taken, engine, Objective()) if taken and found.basis != SINCE_BOOT else None
    return report(
        d, engine, plan(d, engine, TuningPolicy()), url, None, found.basis, found.since_boot_seconds,
        what_if=what_if,
    )  # fmt: skip


async def _load_with_doctor(
    url: str, model: str, spec: BatchSpec, args: argparse.Namespace, known: EngineView
) -> tuple[LoadResult, dict[str, Any], float]:
    async def doctor() -> tuple[dict[str, Any], float]:
        finished = await asyncio.to_thread(wait_for_finished, url, args.doctor_after, args.doctor_timeout)
        data = await asyncio.to_thread(run_doctor, url, args.doctor_samples, args.doctor_window, known)
        return data, finished

    result, (data, finished) = await asyncio.gather(run_batch(url, model, spec), doctor())
    return result, data, finished


def _load_then_doctor(
    url: str, model: str, spec: BatchSpec, args: argparse.Namespace, known: EngineView
) -> tuple[LoadResult, dict[str, Any], float]:
    """The load to its end, then the doctor on the quiet server (every request finished by then)."""
    result = asyncio.run(run_batch(url, model, spec))
    finished = wait_for_finished(url, result.completed, 60.0)
    return result, run_doctor(url, args.doctor_samples, args.doctor_window, known), finished


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--venv", type=Path, default=DEFAULT_VENV_DIR)
    parser.add_argument("--kv-cache-tokens", type=int, default=20_480)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=64, help="the original (preempting) value")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--cpu-threads", type=int, default=None, help="default: vLLM's auto binding")
    parser.add_argument("--num-requests", type=int, default=80)
    parser.add_argument("--prompt-tokens", type=int, nargs=2, default=(300, 700))
    parser.add_argument("--output-tokens", type=int, nargs=2, default=(500, 1500))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=2, help="original/recommended pairs, alternated")
    parser.add_argument(
        "--doctor-after", type=int, default=16, help="finished requests before the doctor looks"
    )
    parser.add_argument("--doctor-timeout", type=float, default=600.0)
    parser.add_argument("--doctor-samples", type=int, default=4)
    parser.add_argument("--doctor-window", type=float, default=9.0, help="seconds the doctor's samples span")
    parser.add_argument("--min-ratio", type=float, default=0.8)
    parser.add_argument(
        "--wait-other-vllm", type=float, default=1800.0, help="seconds to wait for one to end"
    )
    parser.add_argument(
        "--after-the-incident",
        action="store_true",
        help="run the first load to its end, then the doctor on the quiet vLLM (from its counters since boot)",
    )
    parser.add_argument(
        "--recommend",
        choices=("ladder", "whatif"),
        default="ladder",
        help="replay the ladder's lower_max_num_seqs value, or the what-if table's recommendation (issue 28; "
        "its own section, with the predicted preemption rate at the original value against the observed)",
    )
    parser.add_argument("--no-record", action="store_true", help="do not write BENCHMARKS.md")


def _replay(
    config: VllmServerConfig, spec: BatchSpec, args: argparse.Namespace, folder: Path, i: int
) -> LoadResult:
    wait_for_no_other_vllm(args.wait_other_vllm)
    with start_server(config, venv_dir=args.venv, log_path=folder / f"vllm-{i}.log") as server:
        return asyncio.run(run_batch(server.url, config.served_model_name, spec))


def run(args: argparse.Namespace) -> int:
    from kvtune.engine.model.tiny_model import write_tiny_model

    if args.rounds < 1:
        raise KvtuneError("--rounds must be at least 1")
    load_before = os.getloadavg()
    spec = BatchSpec(
        num_requests=args.num_requests,
        prompt_tokens=tuple(args.prompt_tokens),
        output_tokens=tuple(args.output_tokens),
        seed=args.seed,
    )
    ensure_venv(args.venv)
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="kvtune-doctor-vllm-") as tmp:
        folder = Path(tmp)
        model_dir = write_tiny_model(folder / "tiny")
        original = VllmServerConfig(
            model_dir=model_dir, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
            max_model_len=args.max_model_len, kv_cache_tokens=args.kv_cache_tokens, cpu_threads=args.cpu_threads,
        )  # fmt: skip
        known = EngineView(max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len)
        wait_for_no_other_vllm(args.wait_other_vllm)
        with start_server(original, venv_dir=args.venv, log_path=folder / "vllm-diagnosis.log") as server:
            if args.after_the_incident:
                result, doctor_json, finished = _load_then_doctor(
                    server.url, original.served_model_name, spec, args, known
                )
            else:
                result, doctor_json, finished = asyncio.run(
                    _load_with_doctor(server.url, original.served_model_name, spec, args, known)
                )
        runs.append(Run.of("diagnosis", args.max_num_seqs, result))
        print(
            f"diagnosis run: {result.generated_tokens_per_s:,.1f} tokens/s, preemptions {result.preemptions}"
        )
        print(f"doctor (after {finished:.0f} finished requests): {remedy_evidence(doctor_json)}")
        if not result.preemptions:
            raise KvtuneError(
                f"the original run did not preempt (KV pool {args.kv_cache_tokens:,} tokens, max_num_seqs "
                f"{args.max_num_seqs}): shrink the pool or add requests"
            )
        value = (
            whatif_max_num_seqs(doctor_json)
            if args.recommend == "whatif"
            else recommended_max_num_seqs(doctor_json)
        )
        problem = not_looking_back(doctor_json) if args.after_the_incident else None
        if value is None or problem is not None:
            body = _section(args, spec, runs, None, doctor_json, finished, load_before, None)
            print(body)
            if not args.no_record:
                record_section(section_name(args.after_the_incident, args.recommend), body)
            print(f"FAIL: {problem or 'the doctor recommended no max_num_seqs although vLLM preempted'}")
            return 1
        print(f"doctor recommends max_num_seqs {args.max_num_seqs} → {value}")
        recommended = dataclasses.replace(original, max_num_seqs=value)
        for i, label in enumerate(schedule(args.rounds), 1):
            config = original if label == ORIGINAL else recommended
            result = _replay(config, spec, args, folder, i)
            runs.append(Run.of(label, config.max_num_seqs, result))
            print(
                f"run {i}: {label} (max_num_seqs {config.max_num_seqs}) {result.generated_tokens_per_s:,.1f} "
                f"tokens/s over {result.duration_s:,.1f} s, preemptions {result.preemptions}, "
                f"{result.failed} failed"
            )
    v = verdict(runs, args.min_ratio)
    body = _section(args, spec, runs, value, doctor_json, finished, load_before, v)
    print(body)
    if not args.no_record:
        record_section(section_name(args.after_the_incident, args.recommend), body)
    return 0 if v.passed and whatif_within(doctor_json, args) is not False else 1


def whatif_within(doctor_json: dict[str, Any], args: argparse.Namespace) -> bool | None:
    """Whether the predicted preemption rate at the original value is within 2x of the doctor window's
    observed one (None when there is no what-if table, or no what-if replay was asked for)."""
    what_if = doctor_json.get("what_if") or {}
    if args.recommend != "whatif" or "current" not in what_if:
        return None
    predicted = float(what_if["current"]["predicted_preemptions_per_min"])
    observed = float(what_if["observed_preemptions_per_min"])
    if observed <= 0:
        return predicted == 0
    return 0.5 <= predicted / observed <= 2.0


def whatif_lines(doctor_json: dict[str, Any], args: argparse.Namespace) -> list[str]:
    """The what-if table the doctor printed, and the 2x check at the original value."""
    what_if = doctor_json.get("what_if")
    if not what_if:
        return []
    if "insufficient" in what_if:
        return ["", f"What-if: no table ({what_if['insufficient']})."]
    current = what_if["current"]
    predicted, observed = current["predicted_preemptions_per_min"], what_if["observed_preemptions_per_min"]
    ratio = predicted / observed if observed > 0 else float("nan")
    within = whatif_within(doctor_json, args)
    return [
        "",
        f"What-if ({what_if['objective']}): fitted workload: {what_if['workload']}. At the original "
        f"max_num_seqs {current['max_num_seqs']}: predicted {predicted:.1f} preemptions/min, observed "
        f"{observed:.1f} in the doctor's window (predicted ÷ observed {ratio:.2f}; goal within 2×"
        + ("" if within is None else f": {'met' if within else 'NOT met'}")
        + f"); goodput predicted {current['predicted_goodput_tokens_per_s']:.0f}, observed "
        f"{what_if['observed_goodput_tokens_per_s']:.0f} tokens/s. Recommendation: max_num_seqs "
        f"{what_if['recommended']} ({what_if['reason']}).",
        "",
        "```",
        *what_if["table"],
        "```",
    ]


def title(after_the_incident: bool, recommend: str = "ladder") -> str:
    if recommend == "whatif":
        return (
            "## `kvtune doctor`'s what-if recommendation against vLLM's CPU build "
            "(`kvtune bench doctor-vllm --recommend whatif`)"
        )
    if after_the_incident:
        return (
            "## `kvtune doctor` after the incident, on a quiet vLLM's CPU build "
            "(`kvtune bench doctor-vllm --after-the-incident`)"
        )
    return "## `kvtune doctor` against vLLM's CPU build (`kvtune bench doctor-vllm`)"


def diagnosis_method(args: argparse.Namespace, finished: float, doctor_json: dict[str, Any]) -> str:
    """How run 0 was diagnosed: mid-run, or after the load ended, from the counters since boot."""
    command = (
        f"`kvtune doctor --metrics-url URL --json --max-num-seqs {args.max_num_seqs} --max-model-len "
        f"{args.max_model_len} --samples {args.doctor_samples} --window-seconds {args.doctor_window:g}`"
    )
    if not args.after_the_incident:
        return (
            f"Run 0 (max_num_seqs {args.max_num_seqs}) is the diagnosis run: once vLLM had finished "
            f"{finished:.0f} requests, `kvtune doctor`'s Python API (as {command}) read vLLM's /metrics mid-run."
        )
    span = doctor_json.get("since_boot_seconds")
    how = (
        f"found nothing moving and diagnosed from the counters since boot ({span / 60:.1f} minutes, "
        "process_start_time_seconds to the reading)"
        if doctor_json.get("basis") == SINCE_BOOT and isinstance(span, int | float)
        else f"did not diagnose from the counters since boot (basis {doctor_json.get('basis')})"
    )
    return (
        f"Run 0 (max_num_seqs {args.max_num_seqs}) is the incident: the load ran to its end ({finished:.0f} "
        f"requests finished); then, with vLLM quiet, `kvtune doctor`'s Python API (as {command}) read its "
        f"/metrics, {how}."
    )


def _section(
    args: argparse.Namespace,
    spec: BatchSpec,
    runs: list[Run],
    value: int | None,
    doctor_json: dict[str, Any],
    finished: float,
    load_before: tuple[float, float, float],
    v: Verdict | None,
) -> str:
    findings = doctor_json.get("findings", {})
    load_after = os.getloadavg()
    versions = installed_versions(args.venv)
    notes = [f"[{n['severity']}] {n['message']} ({n['evidence']})" for n in findings.get("notes", [])]
    lines = [
        title(args.after_the_incident, args.recommend),
        "",
        f"Method: vLLM {versions.get('vllm', '?')} (CPU build, torch {versions.get('torch', '?')}) serves the "
        f"tiny checkpoint with a KV pool of {args.kv_cache_tokens:,} usable tokens (block {args.block_size}, "
        f"max_model_len {args.max_model_len}, CPU threads {args.cpu_threads or 'auto'}). Workload: a fixed "
        f"request list (seed {spec.seed}) of {spec.num_requests} requests sent at once, prompts "
        f"{spec.prompt_tokens[0]}–{spec.prompt_tokens[1]} token ids, outputs {spec.output_tokens[0]}–"
        f"{spec.output_tokens[1]} tokens with ignore_eos. {diagnosis_method(args, finished, doctor_json)} "
        f"Then {args.rounds} alternated pairs of fresh boots replay the same list "
        "at the original and the recommended max_num_seqs; tokens/s = completion tokens ÷ batch wall time, "
        "preemptions = the delta of vllm:num_preemptions_total. Pass: zero preemptions with the recommended "
        f"value and median throughput ≥ {args.min_ratio:.0%} of the original's"
        + (", from a diagnosis of the quiet vLLM's counters since boot." if args.after_the_incident else "."),
        f"Machine: {machine_description()}. Revision {git_revision()}. Load average before "
        f"{load_before[0]:.2f}, after {load_after[0]:.2f} (1 min).",
        "",
        (
            f"Doctor: `lower_max_num_seqs` {args.max_num_seqs} → {recommended_max_num_seqs(doctor_json) or 'none'}; "
            f"what-if {whatif_max_num_seqs(doctor_json) or 'none'}, replayed. Ladder evidence: "
            f"{remedy_evidence(doctor_json)}"
            if args.recommend == "whatif"
            else f"Doctor: `lower_max_num_seqs` {args.max_num_seqs} → {value if value is not None else 'none'}. "
            f"Evidence: {remedy_evidence(doctor_json)}"
        ),
        "",
        f"Doctor findings: preemption rate {_fmt(findings.get('preemption_rate'), '.2f')}/s, KV usage max "
        f"{_fmt(findings.get('kv_usage_max'), '.0%')}, footprint p95 {_fmt(findings.get('footprint_p95'), ',.0f')} "
        f"tokens, mean footprint {_fmt(findings.get('footprint_mean'), ',.0f')} tokens, real concurrency "
        f"ceiling {findings.get('real_concurrency_ceiling')}, running mean "
        f"{_fmt(findings.get('requests_running'), '.1f')}.",
        *(f"- {note}" for note in notes),
        *whatif_lines(doctor_json, args),
        "",
        format_runs(runs),
    ]
    if v is not None:
        lines += ["", format_verdict(v)]
    return "\n".join(lines)
