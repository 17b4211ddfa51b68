"""`kvtune bench kernels`: paged decode against the machine's memory bandwidth, recorded in BENCHMARKS.md.

On every machine it runs the CPU backend (section `kernels-cpu`); where CUDA is available it also runs the
Triton kernel (section `kernels-gpu`), and where it is not it says so in one line.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from kvtune.bench.benchmarks_md import record_section
from kvtune.errors import KvtuneError
from kvtune.kernels.backends import unavailable_reason


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, default=64, help="sequences per CPU decode step (default 64)")
    parser.add_argument("--min-context", type=int, default=300, help="shortest CPU context (default 300)")
    parser.add_argument("--max-context", type=int, default=1800, help="longest CPU context (default 1800)")
    parser.add_argument("--repeats", type=int, default=20, help="timed rounds per case (default 20)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=Path("BENCHMARKS.md"), help="file to record tables in")
    parser.add_argument("--no-record", action="store_true", help="print only; leave BENCHMARKS.md alone")
    parser.add_argument("--skip-cpu", action="store_true", help="run only the GPU part")


def run(args: argparse.Namespace) -> int:
    if args.batch < 1 or args.repeats < 1 or not 1 <= args.min_context <= args.max_context:
        raise KvtuneError("need --batch >= 1, --repeats >= 1 and 1 <= --min-context <= --max-context")
    if not args.skip_cpu:
        reason = unavailable_reason("cpu")
        if reason is not None:
            raise KvtuneError(f"cannot benchmark the cpu backend: {reason}")
        from kvtune.bench.kernels_cpu import run_cpu

        printable, section = run_cpu(args.batch, args.min_context, args.max_context, args.repeats, args.seed)
        print(printable)
        if not args.no_record:
            record_section("kernels-cpu", section, args.output)
    if not torch.cuda.is_available():
        print("gpu: no CUDA device here; the kernels-gpu figures wait for a machine that has one")
        return 0
    from kvtune.bench.kernels_gpu import run_gpu

    printable, section = run_gpu(max(50, args.repeats), args.seed)
    print(printable)
    if not args.no_record:
        record_section("kernels-gpu", section, args.output)
    return 0
