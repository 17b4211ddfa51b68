"""`python -m kvtune.bench.engine_gpu --device cuda`: the engine end to end on a device, for each model size.

For the tiny and the small checkpoint (`kvtune.engine.model.tiny_model.MODEL_SIZES`, the shapes `kvtune
bench engine --model` uses) it starts `kvtune serve --device DEVICE` as a subprocess, sends a few short
requests untimed (the kernels' first compilation is no part of a rate), then the timed batch from kvtune's
own load generator (`kvtune.harness.load.run_batch`: every request at once, non-streamed, `ignore_eos`), and
records tokens/s. Step 3 of scripts/gpu_check.sh runs it on CUDA, where a lent machine's minutes are few:

- `--seconds` is a budget for the whole run: a model is not started without `MIN_MODEL_SECONDS` left, and
  the boot and the batch of one that is are cut off when the budget runs out (a row then says so);
- SIGTERM (the script's outer `timeout`) stops the servers before exiting: they run in process groups of
  their own, which would otherwise outlive this process and hold the GPU through the next step;
- what comes back is two files in `--out` (a lent machine returns only a few): `engine-gpu.md`, the table,
  and `engine-gpu-servers.log`, every server's log one after the other.

On CPU (`--device cpu`, a handful of short requests) it is this module's own smoke test.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from kvtune.bench.models import (
    MODELS,
    SERVED_MODEL_NAME,
    check_model_shape,
    ensure_model,
    serve_argv,
)
from kvtune.bench.workloads import BURST96_LONG
from kvtune.errors import KvtuneError
from kvtune.harness.load import BatchSpec, LoadResult, run_batch
from kvtune.harness.local_http import free_port
from kvtune.harness.server import ServerProcess

TABLE_FILE = "engine-gpu.md"
LOGS_FILE = "engine-gpu-servers.log"
MIN_MODEL_SECONDS = 30.0  # below this, a model's boot and batch cannot finish: it is reported as not run
STOP_GRACE_S = 10.0
WARMUP = BatchSpec(num_requests=2, prompt_tokens=(32, 64), output_tokens=(8, 8), seed=1)
# what `kvtune serve` imports beyond torch and Triton: a GPU image without them needs wheels in .whl/
SERVER_MODULES = (
    "fastapi",
    "starlette",
    "pydantic",
    "uvicorn",
    "httpx",
    "safetensors",
    "tokenizers",
    "jinja2",
)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m kvtune.bench.engine_gpu", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--device", required=True, help="what kvtune serve runs on: cuda (the check) or cpu")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--out", type=Path, default=Path("gpu-check-out"), help="where the table and logs go")
    parser.add_argument(
        "--model-root", type=Path, help="checkpoint folders (default: a temporary folder; never under --out)"
    )
    parser.add_argument("--seconds", type=float, default=240.0, help="budget for every model together")
    parser.add_argument("--boot-timeout", type=float, default=180.0, help="seconds per server boot, at most")
    parser.add_argument("--num-requests", type=int, default=BURST96_LONG.num_requests)
    parser.add_argument(
        "--prompt-tokens", type=int, nargs=2, default=BURST96_LONG.prompt_tokens, metavar=("LO", "HI")
    )
    parser.add_argument(
        "--output-tokens", type=int, nargs=2, default=BURST96_LONG.output_tokens, metavar=("LO", "HI")
    )
    parser.add_argument("--kv-cache-tokens", type=int, default=BURST96_LONG.kv_cache_tokens)
    parser.add_argument("--block-size", type=int, default=BURST96_LONG.block_size)
    parser.add_argument("--max-num-seqs", type=int, default=BURST96_LONG.max_num_seqs)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--threads", type=int, help="kvtune serve --threads (default: kvtune's own)")
    args = parser.parse_args(list(argv))
    for name in ("prompt_tokens", "output_tokens"):
        low, high = getattr(args, name)
        if not 1 <= low <= high:
            parser.error(f"--{name.replace('_', '-')} needs 1 <= LO <= HI, got {low} {high}")
    if args.prompt_tokens[1] + args.output_tokens[1] > args.max_model_len:
        parser.error("the longest prompt plus the longest output exceeds --max-model-len")
    if args.num_requests < 1:
        parser.error(f"--num-requests must be at least 1, got {args.num_requests}")
    return args


def serve_command(args: argparse.Namespace, model_dir: Path, port: int) -> list[str]:
    """`kvtune serve` on the device, with the batch's pool and scheduler limits."""
    return serve_argv(args, model_dir, port, args.device, args.threads)


@dataclass(frozen=True)
class ModelRun:
    """One model's outcome; `status` is "ok" or why there is no rate."""

    model: str
    parameters: int
    status: str
    boot_s: float = 0.0
    warmup_s: float = 0.0
    result: LoadResult | None = None


class _Budget:
    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return max(0.0, self.deadline - time.monotonic())


def _batch_spec(args: argparse.Namespace, timeout_s: float) -> BatchSpec:
    return BatchSpec(
        num_requests=args.num_requests,
        prompt_tokens=tuple(args.prompt_tokens),
        output_tokens=tuple(args.output_tokens),
        request_timeout_s=max(timeout_s, 1.0),
    )


async def _bounded(url: str, spec: BatchSpec, seconds: float) -> LoadResult | None:
    """The batch, or None when the budget runs out first (the requests are then abandoned)."""
    try:
        return await asyncio.wait_for(run_batch(url, SERVED_MODEL_NAME, spec), timeout=max(seconds, 0.1))
    except TimeoutError:
        return None


def run_model(
    args: argparse.Namespace, model: str, model_root: Path, log_path: Path, budget: _Budget
) -> ModelRun:
    """Write the checkpoint (once), boot the server, warm it up, time the batch; every failure becomes the
    row's status rather than an exception, and the server is stopped whatever happens."""
    from kvtune.engine.model.tiny_model import MODEL_SIZES, parameter_count

    parameters = parameter_count(MODEL_SIZES[model])
    if budget.left() < MIN_MODEL_SECONDS:
        return ModelRun(model, parameters, f"not run: {budget.left():.0f} s of the budget left")
    try:
        model_dir = ensure_model(model_root / model, model)
        check_model_shape(model_dir, model)
    except KvtuneError as err:
        return ModelRun(model, parameters, f"no checkpoint: {err}")
    port = free_port()
    started = time.perf_counter()
    server = ServerProcess(
        serve_command(args, model_dir, port), port, log_path, name=f"kvtune serve ({model})"
    )
    try:
        try:
            server.wait_ready(min(args.boot_timeout, budget.left()))
        except KvtuneError as err:
            last_words = (server.log_tail().splitlines() or [str(err)])[-1]  # the server's own error, usually
            return ModelRun(model, parameters, f"boot failed: {last_words}", time.perf_counter() - started)
        boot_s = time.perf_counter() - started
        print(f"== {model}: ready after {boot_s:.1f} s; warm-up, then the batch", flush=True)
        warmup = asyncio.run(_bounded(server.url, WARMUP, budget.left()))
        warmup_s = time.perf_counter() - started - boot_s
        if warmup is None or warmup.completed < WARMUP.num_requests:
            why = "the budget ran out" if warmup is None else str(warmup.first_error)
            return ModelRun(model, parameters, f"warm-up failed: {why}", boot_s, warmup_s)
        result = asyncio.run(_bounded(server.url, _batch_spec(args, budget.left()), budget.left()))
    finally:
        server.stop(STOP_GRACE_S)
    if result is None:
        return ModelRun(model, parameters, "timed out: the budget ran out during the batch", boot_s, warmup_s)
    status = "ok" if result.failed == 0 else f"{result.failed} failed: {result.first_error}"
    return ModelRun(model, parameters, status, boot_s, warmup_s, result)


def format_table(args: argparse.Namespace, runs: Sequence[ModelRun], device_name: str, revision: str) -> str:
    low_p, high_p = args.prompt_tokens
    low_o, high_o = args.output_tokens
    lines = [
        f"## kvtune serve end to end on {args.device} ({device_name})",
        "",
        f"`python -m kvtune.bench.engine_gpu --device {args.device}` (scripts/gpu_check.sh step 3), revision "
        f"{revision}, {datetime.date.today().isoformat()}. Each model: `kvtune serve --device {args.device} "
        f"--dtype {args.dtype}`, {args.kv_cache_tokens:,} KV tokens, block {args.block_size}, max_num_seqs "
        f"{args.max_num_seqs}, max_num_batched_tokens {args.max_num_batched_tokens}; {args.num_requests} requests "
        f"at once, prompts of {low_p}–{high_p} random token ids, {low_o}–{high_o} output tokens with "
        "`ignore_eos`, greedy, non-streamed (`kvtune.harness.load.run_batch`), after an untimed warm-up of "
        f"{WARMUP.num_requests} short requests. tokens/s = completion tokens ÷ wall time of the batch.",
        "",
        "| model | parameters | completed | generated tokens | batch (s) | tokens/s | boot (s) | warm-up (s) "
        "| preemptions | status |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for run in runs:
        r = run.result
        figures = (
            f"{r.completed} of {r.num_requests} | {r.generated_tokens:,} | {r.duration_s:,.1f} | "
            f"{r.generated_tokens_per_s:,.1f}"
            if r is not None
            else "– | – | – | –"
        )
        preemptions = "n/a" if r is None or r.preemptions is None else f"{r.preemptions:,.0f}"
        lines.append(
            f"| {run.model} | {run.parameters:,} | {figures} | {run.boot_s:.1f} | {run.warmup_s:.1f} | "
            f"{preemptions} | {_cell(run.status)} |"
        )
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    """One table cell: an error's first line, without the pipes that would split it."""
    return (text.splitlines() or [""])[0].replace("|", "/")


def missing_modules() -> list[str]:
    import importlib.util

    return [name for name in SERVER_MODULES if importlib.util.find_spec(name) is None]


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            return str(torch.cuda.get_device_name())
        return "no CUDA device visible"
    from kvtune.bench.benchmarks_md import machine_description

    return machine_description()


def _stop_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds through each server's `with`, which stops its process group


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    budget = _Budget(args.seconds)
    args.out.mkdir(parents=True, exist_ok=True)
    missing = missing_modules()
    if missing:
        message = (
            f"kvtune serve cannot start here: no {', '.join(missing)}. Carry their wheels in .whl/ "
            "(scripts/gpu_check.sh installs them without the network)."
        )
        (args.out / TABLE_FILE).write_text(f"engine end to end on {args.device}: not run. {message}\n")
        print(message, file=sys.stderr)
        return 2
    from kvtune.bench.benchmarks_md import git_revision
    from kvtune.engine.model.tiny_model import MODEL_SIZES, parameter_count

    previous = signal.signal(signal.SIGTERM, _stop_on_sigterm)
    runs: list[ModelRun] = []
    log_paths: list[Path] = []
    with tempfile.TemporaryDirectory(prefix="kvtune-engine-gpu-") as scratch:
        model_root = args.model_root or Path(scratch) / "models"
        try:
            for model in args.models:
                log_paths.append(Path(scratch) / f"kvtune-serve-{model}.log")
                print(f"== {model}: {budget.left():.0f} s of the budget left", flush=True)
                try:
                    run = run_model(args, model, model_root, log_paths[-1], budget)
                except SystemExit:
                    runs.append(ModelRun(model, parameter_count(MODEL_SIZES[model]), "stopped by SIGTERM"))
                    raise
                rate = f"{run.result.generated_tokens_per_s:,.1f} tokens/s" if run.result else "no rate"
                print(f"== {model}: {run.status}, {rate}", flush=True)
                runs.append(run)
        finally:
            signal.signal(signal.SIGTERM, previous)
            _gather_logs(log_paths, args.out / LOGS_FILE)
            table = format_table(args, runs, _device_name(args.device), git_revision())
            (args.out / TABLE_FILE).write_text(table)
            print(table, flush=True)
    return 0 if all(run.status == "ok" for run in runs) else 1


def _gather_logs(paths: Sequence[Path], target: Path) -> None:
    with target.open("w") as out:
        for path in paths:
            out.write(f"===== {path.name} =====\n")
            out.write(
                path.read_text(errors="replace") if path.exists() else "(no log: the server never started)\n"
            )


if __name__ == "__main__":
    sys.exit(main())
