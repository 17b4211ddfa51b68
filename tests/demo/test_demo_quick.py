"""`kvtune demo --quick` end to end, as a subprocess: the ladder's order, preemptions gone at the end, the
report's files, and no child process or open port left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from kvtune.demo.run import QUICK
from kvtune.demo.timeline import RUNGS
from tests.demo.leftovers import alive, port_open

DEMO_TIMEOUT_S = 540  # catches a hang only: about 2.5 min on 2 busy cores


def first_seen_at(summary: dict[str, Any], rung: str) -> float:
    return min(a["time"] for a in summary["actions"] if a["rung"] == rung)


def test_demo_quick_walks_the_ladder_and_leaves_nothing(tmp_path: Path) -> None:
    out = tmp_path / "report"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run(
        [sys.executable, "-m", "kvtune.cli", "demo", "--quick", "--out", str(out)],
        capture_output=True, text=True, timeout=DEMO_TIMEOUT_S, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1].startswith("report: ")

    summary = json.loads((out / "summary.json").read_text())
    first_seen = [a["rung"] for a in summary["actions"]]
    order = [rung for i, rung in enumerate(first_seen) if rung not in first_seen[:i]]
    assert order == list(RUNGS)
    before, after = summary["before"], summary["after"]
    # the engine in trouble, watched for the plan's stretch before the operator may act, on any CPU
    assert before["preemptions"] >= QUICK.before_preemptions and before["preemptions_per_minute"] > 0
    assert before["window_s"] >= QUICK.before_windows * QUICK.evaluation_s - 1  # samples land about 1 s apart
    assert before["t_to"] <= first_seen_at(summary, "cap_max_tokens")
    assert after["preemptions"] == 0 and after["window_s"] >= QUICK.settle_s - 1
    failed = sum(n for causes in summary["failures"].values() for n in causes.values())
    assert failed == json.loads((out / "timeline.json").read_text())["meta"]["requests_failed"]
    for name in ("index.html", "summary.json"):
        assert (out / name).is_file()
    assert list(out.glob("*.png"))

    timeline = json.loads((out / "timeline.json").read_text())
    pids = [int(p) for p in (out / "children.txt").read_text().split()]
    assert pids == timeline["meta"]["engine_pids"] and len(pids) == 2  # the first engine and the fp8 one
    assert not [pid for pid in pids if alive(pid)]
    assert not port_open(timeline["meta"]["port"])
