"""Helpers for running the `kvtune` command the way a user does: a subprocess, stdout, stderr, exit code."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]


def kvtune(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvtune.cli", *args], capture_output=True, text=True, timeout=timeout, cwd=REPO
    )


def kvtune_json(*args: str) -> Any:
    done = kvtune(*args, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.fixture(scope="session")
def seed_table() -> list[dict[str, Any]]:
    """The seed table, computed once per test session (it is the slowest thing the simulator does)."""
    rows: list[dict[str, Any]] = kvtune_json("sim", "--table", "seed")
    return rows
