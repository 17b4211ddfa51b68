"""How many torch (intra-op) threads `kvtune serve` computes on by default: every core but one.

The engine's step and the HTTP side (event loop, tokenizing, detokenizing) share the process. With one torch
thread per core, every parallel region waits for its slowest thread, and on a small or shared machine that
thread is often descheduled by the event loop or a neighbour: measured on a 2-core AMD EPYC (AVX-512 with
AVX512-BF16, no AMX) at a load average of 3-6, the small model's bfloat16 GEMMs ran at 5-70 GFLOP/s on 2
threads against 100-150 on 1 (BENCHMARKS.md, issue 29). vLLM's CPU build makes the same choice: it
reserves a core for its API server process. No torch import here, so the benchmarks can name the default.
"""

from __future__ import annotations

import os


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity, which taskset and cgroup cpusets narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no sched_getaffinity (macOS)
        return os.cpu_count() or 1


def default_compute_threads(cores: int) -> int:
    """Every core but one, kept for the HTTP side; one thread on a single core."""
    return max(1, cores - 1)
