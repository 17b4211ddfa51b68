"""Where a live `kvtune serve` spends its time under `kvtune bench engine`'s batch, stage by stage.

    PYTHONPATH=. .venv/bin/python scripts/profile_live_server.py [--model tiny|small] [--dtype bfloat16]
        [--py-spy SECONDS] [--out FILE.json] [any other `kvtune bench engine` workload flag]

It starts `kvtune serve` exactly as `kvtune bench engine` does (the same flags, through `serve_argv`), but
through this file, which first wraps the engine's stages in timers; then it sends the benchmark's batch
(`run_batch`, the same request bodies), stops the server and prints where the engine thread's time went:
- each step's stages: scheduler, batch building, the linear layers, the attention kernels (decode and
  prefill calls apart), the KV write (with RoPE where the fused CPU ops run), the fused norms and SiLU,
  the rest of the model's ops (the torch norms, RoPE, SiLU, residuals, casts, their dispatch), sampling,
  output append and detokenizing, and the Python rest of the step;
- the same time split between decode, first prefill and recompute (prefill chunks of a request that was
  preempted): the decode kernel's time is decode's; the prefill kernel's is split between prefill and
  recompute chunks by their query-key pairs (the kernel's work); the linears, the other model ops, the KV
  write and batch building by tokens (their cost is per token); sampling and appending are per step.
With `--py-spy SECONDS` it also samples every thread of the server with py-spy (pip install py-spy) from
10 s into the batch, to show what the event loop (HTTP, tokenizing) takes beside the engine thread.
The timers add two clock reads per wrapped call (about 30 per layer step): well under 1% of a step.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import collections
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

STAGES = (
    "schedule", "build_batch", "linears", "attn_decode", "attn_prefill", "kv_write", "fused_norm_silu",
    "other_model_ops", "sample", "append", "python_rest",
)  # fmt: skip


def serve_with_timers(out_path: Path, serve_argv: list[str]) -> int:
    """Run `kvtune serve serve_argv` in this process with stage timers; write the per-step records at exit."""
    import torch

    import kvtune.engine.loop.llm_engine as engine_module
    import kvtune.engine.loop.output as output_module
    import kvtune.engine.model.model_runner as runner_module
    import kvtune.kernels.cpu_backend as cpu_backend
    from kvtune.cli import main
    from kvtune.engine.model.widened_linear import WidenedLinear

    try:  # the fused ops and packed linears exist from issue 29 on; older trees profile without them
        from kvtune.engine.model.packed_linear import PackedLinear
        from kvtune.kernels.model_ops import FusedOps
    except ImportError:
        # a stand-in with the wrapped methods, never instantiated, so the wrapping below runs unchanged
        absent = {
            name: lambda self: None
            for name in ("forward", "rms_norm", "add_rms_norm", "silu_mul", "rope_write")
        }
        PackedLinear = FusedOps = type("Absent", (), absent)

    steps: list[dict[str, object]] = []
    current: dict[str, float] = collections.defaultdict(float)
    chunks_of_step: list[tuple[str, int, int]] = []  # (kind, new tokens, context) of each prefill chunk

    def timed(label: str, fn):  # type: ignore[no-untyped-def]
        def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                current[label] += time.perf_counter() - start

        return wrapper

    cpu_backend.decode = timed("attn_decode", cpu_backend.decode)
    cpu_backend.prefill = timed("attn_prefill", cpu_backend.prefill)
    cpu_backend.write_kv = timed("kv_write", cpu_backend.write_kv)
    runner_module.build_batch = timed("build_batch", runner_module.build_batch)
    for cls in (torch.nn.Linear, WidenedLinear, PackedLinear):
        cls.forward = timed("linears", cls.forward)  # type: ignore[method-assign]
    for name in ("rms_norm", "add_rms_norm", "silu_mul"):
        setattr(FusedOps, name, timed("fused_norm_silu", getattr(FusedOps, name)))
    FusedOps.rope_write = timed("kv_write", FusedOps.rope_write)  # type: ignore[method-assign]
    runner = runner_module.ModelRunner
    runner._run_model = timed("forward", runner._run_model)  # type: ignore[method-assign]
    runner.sample = timed("sample", runner.sample)  # type: ignore[method-assign]
    engine_cls = engine_module.LLMEngine
    scheduler_cls = engine_module.Scheduler
    scheduler_cls.schedule = timed("schedule", scheduler_cls.schedule)  # type: ignore[method-assign]
    # a step's tokens: the scheduler appends them once a step, the output processor detokenizes and stops
    scheduler_cls.update_from_output = timed("append", scheduler_cls.update_from_output)  # type: ignore[method-assign]
    output_cls = output_module.OutputProcessor
    output_cls.process = timed("append", output_cls.process)  # type: ignore[method-assign]

    original_chunks = engine_cls._chunks

    def chunks(self, reqs, counts):  # type: ignore[no-untyped-def]
        chunks_of_step.clear()
        decode = prefill = recompute = 0
        for req, count in zip(reqs, counts, strict=True):
            context = req.num_computed_tokens - count
            if count == 1 and req.output_token_ids and context + 1 == req.num_tokens:
                decode += 1
                continue
            kind = "recompute" if req.num_preemptions else "prefill"
            chunks_of_step.append((kind, count, context))
            if kind == "recompute":
                recompute += count
            else:
                prefill += count
        current["decode_tokens"] = decode
        current["prefill_tokens"] = prefill
        current["recompute_tokens"] = recompute
        return original_chunks(self, reqs, counts)

    engine_cls._chunks = chunks  # type: ignore[method-assign]
    original_step = engine_cls.step

    def step(self):  # type: ignore[no-untyped-def]
        current.clear()
        start = time.perf_counter()
        result = original_step(self)
        current["step"] = time.perf_counter() - start
        current["t"] = start
        if current.get("forward"):
            pairs = {"prefill": 0.0, "recompute": 0.0}
            for kind, count, context in chunks_of_step:
                pairs[kind] += count * context + count * (count + 1) / 2
            current["prefill_pairs"] = pairs["prefill"]
            current["recompute_pairs"] = pairs["recompute"]
            steps.append(dict(current))
        return result

    engine_cls.step = step  # type: ignore[method-assign]

    def dump() -> None:
        out_path.write_text(json.dumps(steps))

    # uvicorn restores this handler after its graceful shutdown and raises the signal again: dump, then exit.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    atexit.register(dump)
    return main(["serve", *serve_argv])


def _share(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def _stages(s: dict[str, float]) -> dict[str, float]:
    g = collections.defaultdict(float, s)
    model = g["forward"] - g["build_batch"]
    other = model - g["linears"] - g["attn_decode"] - g["attn_prefill"] - g["kv_write"] - g["fused_norm_silu"]
    rest = g["step"] - g["schedule"] - g["forward"] - g["sample"] - g["append"]
    return dict(g, other_model_ops=other, python_rest=rest)


def per_step_kind(steps: list[dict[str, float]]) -> str:
    """Mean ms of each stage in decode-only steps and in steps with prefill or recompute chunks."""
    kinds: dict[str, list[dict[str, float]]] = {"decode only": [], "with prefill or recompute": []}
    for s in steps:
        only = s.get("prefill_tokens", 0) + s.get("recompute_tokens", 0) == 0
        kinds["decode only" if only else "with prefill or recompute"].append(_stages(s))
    header = "| stage, mean ms per step | " + " | ".join(f"{k} ({len(v)})" for k, v in kinds.items()) + " |"
    lines = [header, "|---|---:|---:|"]
    for stage in (*STAGES, "step", "decode_tokens", "prefill_tokens", "recompute_tokens"):
        scale = 1.0 if stage.endswith("_tokens") else 1000.0
        cells = [
            f"{sum(v[stage] for v in rows) / len(rows) * scale:.2f}" if rows else "-"
            for rows in kinds.values()
        ]
        lines.append(f"| {stage.replace('_', ' ')} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summarise(steps: list[dict[str, float]], batch_wall: float) -> str:
    """The stage table and the decode / prefill / recompute table, in markdown."""
    total: dict[str, float] = collections.defaultdict(float)
    phase: dict[str, float] = collections.defaultdict(float)
    kinds = collections.Counter()
    for s in steps:
        values = _stages(s)
        g, other, rest = values, values["other_model_ops"], values["python_rest"]
        for stage in (*STAGES, "step"):
            total[stage] += values[stage]
        tokens = g["decode_tokens"] + g["prefill_tokens"] + g["recompute_tokens"]
        per_token = g["linears"] + other + g["kv_write"] + g["fused_norm_silu"] + g["build_batch"]
        for name in ("decode", "prefill", "recompute"):
            phase[name] += per_token * g[f"{name}_tokens"] / tokens
            phase[f"{name}_tokens"] += g[f"{name}_tokens"]
        phase["decode"] += g["attn_decode"]
        pairs = g["prefill_pairs"] + g["recompute_pairs"]
        for name in ("prefill", "recompute"):
            phase[name] += g["attn_prefill"] * g[f"{name}_pairs"] / pairs if pairs else 0.0
            phase[f"{name}_attn"] += g["attn_prefill"] * g[f"{name}_pairs"] / pairs if pairs else 0.0
        phase["per_step"] += g["schedule"] + g["sample"] + g["append"] + rest
        kind = "decode only" if tokens == g["decode_tokens"] else "with prefill or recompute"
        kinds[kind] += 1
        total[f"time {kind}"] += g["step"]
    busy = total["step"]
    per_kind = per_step_kind(steps)
    lines = [
        f"Steps: {len(steps)} ({kinds['decode only']} decode only, {kinds['with prefill or recompute']} with "
        f"prefill or recompute chunks); engine thread in steps {busy:.1f} s of the batch's {batch_wall:.1f} s "
        f"({_share(busy, batch_wall)}).",
        "",
        "| stage | s | of step time |",
        "|---|---:|---:|",
    ]
    for stage in STAGES:
        lines.append(f"| {stage.replace('_', ' ')} | {total[stage]:.2f} | {_share(total[stage], busy)} |")
    for kind in ("decode only", "with prefill or recompute"):
        count = kinds[kind]
        mean = total[f"time {kind}"] / count * 1000 if count else 0.0
        lines.append(f"| (steps {kind}: {count}, mean {mean:.1f} ms) | {total[f'time {kind}']:.2f} | "
                     f"{_share(total[f'time {kind}'], busy)} |")  # fmt: skip
    lines += ["", per_kind]
    lines += [
        "",
        "| phase | tokens | s | of step time | of which attention (s) |",
        "|---|---:|---:|---:|---:|",
    ]
    attention = {
        "decode": total["attn_decode"],
        "prefill": phase["prefill_attn"],
        "recompute": phase["recompute_attn"],
    }
    for name in ("decode", "prefill", "recompute"):
        lines.append(
            f"| {name} | {phase[f'{name}_tokens']:,.0f} | {phase[name]:.2f} | {_share(phase[name], busy)} | "
            f"{attention[name]:.2f} |"
        )
    lines.append(
        f"| per step (scheduler, sampling, append, Python) | | {phase['per_step']:.2f} | "
        f"{_share(phase['per_step'], busy)} | |"
    )
    return "\n".join(lines)


def py_spy_threads(pid: int, seconds: int, raw_path: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            str(Path(sys.executable).parent / "py-spy"),
            "record", "--pid", str(pid), "--duration", str(seconds), "--rate", "200", "--threads",
            "--idle", "--format", "raw", "--output", str(raw_path), "--nonblocking",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip


def thread_shares(raw_path: Path) -> str:
    """Per thread: samples and the share of them not waiting (idle frames: select/poll/wait/acquire)."""
    # A thread is idle where its innermost Python frame is a blocking call, or its loop's own frame (uvloop
    # runs the event loop in C, so an idle event loop shows Runner.run innermost).
    idle_marks = ("select", "poll", "wait", "acquire", "sleep", "_worker", "epoll", "Runner.run")
    per_thread: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for line in raw_path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        frames = stack.split(";")
        thread = frames[0]
        innermost = frames[-1].split(" (")[0] if frames else ""
        count = int(count_text)
        per_thread[thread][0] += count
        if not any(mark in innermost for mark in idle_marks):
            per_thread[thread][1] += count
    rows = ["| thread | samples | busy |", "|---|---:|---:|"]
    for thread, (samples, busy) in sorted(per_thread.items(), key=lambda kv: -kv[1][0]):
        rows.append(f"| {thread} | {samples} | {_share(busy, samples)} |")
    return "\n".join(rows)


def drive(argv: list[str]) -> int:
    from kvtune.bench import engine as bench
    from kvtune.bench.benchmarks_md import machine_description
    from kvtune.harness.load import LoadResult, run_batch
    from kvtune.harness.local_http import free_port
    from kvtune.harness.server import ServerProcess

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench.add_arguments(parser)
    parser.add_argument("--py-spy", type=int, default=0, help="seconds of py-spy sampling of every thread")
    parser.add_argument("--out", type=Path, default=Path("profile-live.json"))
    args = bench.apply_workload_defaults(parser.parse_args(argv))
    bench.validate(args)
    model_dir = bench.ensure_model(args.model_dir or bench.default_model_dir(args.model), args.model)
    port = free_port()
    serve = bench.cpu_serve_argv(args, model_dir, port)
    serve_args = serve[serve.index("serve") + 1 :]
    steps_path = args.out.with_suffix(".steps.json")
    command = [sys.executable, __file__, "--serve", str(steps_path), *serve_args]
    log_path = args.out.with_suffix(".log")
    print(f"machine: {machine_description()}; load average {os.getloadavg()[0]:.2f}", file=sys.stderr)
    with ServerProcess(command, port, log_path) as server:
        server.wait_ready(args.boot_timeout)
        raw_path = args.out.with_suffix(".pyspy.txt")
        spies: list[subprocess.Popen[bytes]] = []

        async def batch() -> LoadResult:
            task = asyncio.create_task(run_batch(server.url, bench.SERVED_MODEL_NAME, bench.load_spec(args)))
            if args.py_spy:
                await asyncio.sleep(10)
                spies.append(py_spy_threads(server.process.pid, args.py_spy, raw_path))
            return await task

        load_before = os.getloadavg()[0]
        result = asyncio.run(batch())
        load_after = os.getloadavg()[0]
        for spy in spies:
            spy.wait()
    steps = json.loads(steps_path.read_text())
    report = summarise(steps, result.duration_s)
    header = (
        f"{args.model} model, {args.dtype}: {result.completed} requests, {result.generated_tokens:,} tokens in "
        f"{result.duration_s:.1f} s ({result.generated_tokens_per_s:,.1f} tokens/s, with the timers), "
        f"{result.preemptions} preemptions; load average {load_before:.2f} -> {load_after:.2f}"
    )
    text = header + "\n\n" + report
    if args.py_spy and raw_path.exists():
        text += (
            "\n\npy-spy, every thread (" + str(args.py_spy) + " s at 200 Hz):\n\n" + thread_shares(raw_path)
        )
    print(text)
    args.out.write_text(json.dumps({"report": text, "steps": len(steps)}))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--serve":
        sys.exit(serve_with_timers(Path(sys.argv[2]), sys.argv[3:]))
    sys.exit(drive(sys.argv[1:]))
