"""scripts/profile_live_server.py end to end on a small batch: the script is run by hand, so nothing else
would notice when a module it wraps or imports moves (the harness move left it broken for a round)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtune.harness.engine_process import write_tiny_model_in_subprocess

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "profile_live_server.py"

pytestmark = pytest.mark.timeout(600)


def test_profiles_a_live_server_stage_by_stage(tmp_path: Path) -> None:
    tiny_model_dir = write_tiny_model_in_subprocess(tmp_path / "tiny")
    out = tmp_path / "profile.json"
    argv = [
        sys.executable, str(SCRIPT), "--model-dir", str(tiny_model_dir), "--out", str(out),
        "--num-requests", "6", "--prompt-tokens", "40", "80", "--output-tokens", "8", "16",
        "--kv-cache-tokens", "2048", "--max-num-seqs", "4",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    completed = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, check=False)
    assert completed.returncode == 0, completed.stderr[-4000:]
    record = json.loads(out.read_text())
    report = record["report"]
    assert record["steps"] > 0
    assert report.startswith("tiny model, float32: 6 requests")
    for stage in ("| linears |", "| attn decode |", "| attn prefill |", "| sample |"):
        assert stage in report
    assert "| decode |" in report and "| prefill |" in report
