"""The memory a server holds while it works: the peak of its process group's summed PSS, sampled in the
background during a timed batch.

PSS (proportional set size, from /proc/PID/smaps_rollup) charges each shared page to the processes sharing
it in equal parts, so summing it over a server of several processes (vLLM's API server and engine core, or
kvtune's one process) counts every resident page exactly once: RSS would count the shared libraries and
torch's pages once per process. Linux only; elsewhere the figure is None.
"""

from __future__ import annotations

import threading
from pathlib import Path
from types import TracebackType

PROC = Path("/proc")
SAMPLE_EVERY_S = 0.5


def _group_of(stat_text: str) -> int:
    """The process group id from /proc/PID/stat (the fields after the command name, which may hold spaces)."""
    return int(stat_text.rsplit(")", 1)[1].split()[2])


def _pss_kib(pid_dir: Path) -> int:
    for line in (pid_dir / "smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1])
    return 0


def group_pss_bytes(group: int, proc: Path = PROC) -> int | None:
    """The summed PSS of every process in process group `group`; None when none of them can be read."""
    total, seen = 0, False
    for pid_dir in proc.iterdir():
        if not pid_dir.name.isdigit():
            continue
        try:
            if _group_of((pid_dir / "stat").read_text()) != group:
                continue
            total += _pss_kib(pid_dir) * 1024
            seen = True
        except (OSError, ValueError, IndexError):
            continue  # the process ended between the listing and the read, or is not ours to read
    return total if seen else None


class PeakMemory:
    """`with PeakMemory(pgid) as peak: ...` then `peak.bytes`: the highest group PSS seen while inside."""

    def __init__(self, group: int, every_s: float = SAMPLE_EVERY_S) -> None:
        self.group = group
        self.every_s = every_s
        self.bytes: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="peak-memory", daemon=True)

    def _sample(self) -> None:
        while True:
            now = group_pss_bytes(self.group)
            if now is not None and (self.bytes is None or now > self.bytes):
                self.bytes = now
            if self._stop.wait(self.every_s):
                return

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self._stop.set()
        self._thread.join()
