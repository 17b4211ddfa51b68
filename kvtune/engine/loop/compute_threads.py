"""How many torch (intra-op) threads `kvtune serve` computes on by default: every core but one.

The engine's step and the HTTP side (event loop, tokenizing, detokenizing) share the process. With one torch
thread per core, every parallel region waits for its slowest thread, and on a small or shared machine that
thread is often descheduled by the event loop or a neighbour: measured on a 2-core AMD EPYC (AVX-512 with
AVX512-BF16, no AMX) at a load average of 3-6, the small model's bfloat16 GEMMs ran at 5-70 GFLOP/s on 2
threads against 100-150 on 1 (BENCHMARKS.md, issue 29). vLLM's CPU build makes the same choice: it
reserves a core for its API server process. Like vLLM's binding, the engine thread (and the torch threads it
starts) is pinned to the compute cores: under the same load, the small model's live batch ran at 50.9 and
43.4 tokens/s pinned against 41.0 and 30.4 unpinned (alternating rounds, load average 8-22). On a quiet
machine the kept core idles through most steps, so by default each step size is also timed on every core and
runs there where that is faster (model.step_threads). No torch import here, so the benchmarks can name the
default.
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


def allowed_cores() -> list[int]:
    """The cores this process may run on, in order (every core where affinity cannot be read)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # no sched_getaffinity (macOS)
        return list(range(os.cpu_count() or 1))


def engine_cores(cores: list[int], threads: int) -> frozenset[int] | None:
    """The cores the engine thread (and the torch threads it starts) is pinned to: the last `threads` of
    `cores`, the first being left to the HTTP side; None (no pinning) where the threads take every core."""
    if threads >= len(cores):
        return None
    return frozenset(cores[-threads:])


def pin_current_thread(cores: frozenset[int] | None) -> None:
    """Pin the calling thread to `cores` (Linux: sched_setaffinity of pid 0 is the calling thread); the
    threads it starts later, such as torch's OpenMP pool, inherit the mask. No-op for None or off Linux."""
    if cores is None or not hasattr(os, "sched_setaffinity"):
        return
    os.sched_setaffinity(0, cores)
