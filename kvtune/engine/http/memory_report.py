"""What the engine process's memory is made of, for a soak that must say whether it levels off and why:
resident memory, the Python heap as tracemalloc traces it (with the allocation sites that hold most),
glibc malloc's own accounting (memory in use against memory its arenas keep free), threads, file
descriptors and garbage-collector counts.

Off by default: tracemalloc slows every allocation. `KVTUNE_TRACEMALLOC=N` (frames per trace, 1 is enough
for sites by line) starts it once the server is built, so it traces what serving allocates and keeps, not
the imports and the model load (a million blocks whose snapshot alone took most of a minute), and serves
the report at `GET /kvtune/memory`; without it the route does not exist.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import threading
import tracemalloc
from pathlib import Path
from typing import Any

TRACEMALLOC_ENV = "KVTUNE_TRACEMALLOC"
MEMORY_PATH = "/kvtune/memory"
TOP_SITES = 25


def tracing_frames() -> int | None:
    """The frames per trace `KVTUNE_TRACEMALLOC` asks for, or None when it is unset or not a number > 0."""
    raw = os.environ.get(TRACEMALLOC_ENV, "").strip()
    return int(raw) if raw.isdigit() and int(raw) > 0 else None


def start_tracing_from_env() -> bool:
    """Start tracemalloc when the environment asks for it; whether the memory report is served."""
    frames = tracing_frames()
    if frames is None:
        return False
    if not tracemalloc.is_tracing():
        tracemalloc.start(frames)
    return True


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
    )]  # fmt: skip


def malloc_stats() -> dict[str, int] | None:
    """glibc's mallinfo2: bytes its arenas took from the system (`arena`), mmapped blocks (`mmapped`), bytes
    in use (`in_use`) and bytes free inside the arenas (`free`); None where there is no glibc >= 2.33."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        call = ctypes.CDLL(name).mallinfo2
    except (OSError, AttributeError):
        return None
    call.restype = _MallInfo2
    info = call()
    return {"arena": info.arena, "mmapped": info.hblkhd, "in_use": info.uordblks, "free": info.fordblks}


def _status(field: str) -> int | None:
    """A `kB` (or count) field of /proc/self/status, as bytes (or a count)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                parts = line.split()
                return int(parts[1]) * (1024 if len(parts) > 2 and parts[2] == "kB" else 1)
    except OSError:
        pass
    return None


def _open_fds() -> int | None:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return None


def memory_report(top: int = TOP_SITES) -> dict[str, Any]:
    """One reading. Taking the tracemalloc snapshot walks every traced block: call it off the event loop."""
    report: dict[str, Any] = {
        "rss_bytes": _status("VmRSS"),
        "rss_peak_bytes": _status("VmHWM"),
        "threads": threading.active_count(),
        "os_threads": _status("Threads"),
        "open_fds": _open_fds(),
        "gc_objects": len(gc.get_objects()),
        "gc_counts": list(gc.get_count()),
        "malloc": malloc_stats(),
        "tracemalloc": None,
    }
    if tracemalloc.is_tracing():
        current, peak = tracemalloc.get_traced_memory()
        snapshot = tracemalloc.take_snapshot().filter_traces(
            [
                tracemalloc.Filter(False, tracemalloc.__file__),
                tracemalloc.Filter(False, "<frozen importlib._bootstrap>"),
            ]
        )
        sites = [
            {"where": f"{stat.traceback[0].filename}:{stat.traceback[0].lineno}", "bytes": stat.size,
             "count": stat.count}
            for stat in snapshot.statistics("lineno")[:top]
        ]  # fmt: skip
        report["tracemalloc"] = {"current_bytes": current, "peak_bytes": peak, "top_sites": sites}
    return report
