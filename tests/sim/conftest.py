"""Helpers for running the `kvtune` command the way a user does: a subprocess, stdout, stderr, exit code."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.imports_seen import run_kvtune, user_output

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
def seed_table_run() -> subprocess.CompletedProcess[str]:
    """`kvtune sim --table seed --json`, run once per test session (it is the slowest thing the simulator
    does), with Python's import log on stderr so the no-torch check can read it too."""
    done = run_kvtune("sim", "--table", "seed", "--json")
    assert done.returncode == 0, user_output(done.stderr)
    return done


@pytest.fixture(scope="session")
def seed_table(seed_table_run: subprocess.CompletedProcess[str]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = json.loads(seed_table_run.stdout)
    return rows
