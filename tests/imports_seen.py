"""Which heavy packages a `kvtune` subprocess imported, read from Python's own import log (`-X importtime`).

The operator's image carries no torch and no web server: `kvtune operator`, `kvtune doctor` and `kvtune sim`
must run without importing them, which only a fresh process can show (the test process has them loaded).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "fastapi", "uvicorn")


def run_kvtune(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`python -X importtime -m kvtune.cli ARGS` from the repository root; stderr holds the import log."""
    return subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "kvtune.cli", *args],
        capture_output=True, text=True, timeout=timeout, cwd=REPO,
    )  # fmt: skip


def heavy_imports(import_log: str) -> set[str]:
    """The HEAVY top-level packages named in an `-X importtime` log ("import time: self | cumulative | name")."""
    seen = set()
    for line in import_log.splitlines():
        if line.startswith("import time:") and "|" in line:
            name = line.rsplit("|", 1)[1].strip()
            if name.split(".")[0] in HEAVY:
                seen.add(name.split(".")[0])
    return seen


def user_output(stderr: str) -> str:
    """stderr without the import log: what a user of the command would see."""
    return "\n".join(line for line in stderr.splitlines() if not line.startswith("import time:"))
