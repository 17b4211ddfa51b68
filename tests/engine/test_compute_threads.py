"""kvtune serve's default torch thread count: every core but one (the HTTP side keeps it), 1 on one core."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvtune.engine_sidecar import serve
from kvtune.engine_sidecar.compute_threads import available_cores, default_compute_threads


@pytest.mark.parametrize(("cores", "threads"), [(1, 1), (2, 1), (3, 2), (64, 63)])
def test_every_core_but_one_and_never_none(cores: int, threads: int) -> None:
    assert default_compute_threads(cores) == threads


@pytest.mark.skipif(shutil.which("taskset") is None, reason="taskset (util-linux) is not installed")
def test_available_cores_follow_the_affinity_a_process_is_given() -> None:
    code = "from kvtune.engine_sidecar.compute_threads import available_cores; print(available_cores())"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = subprocess.run(
        ["taskset", "-c", "0", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    assert out.stdout.strip() == "1"


def test_serve_without_threads_computes_on_the_default(tiny_dir: Path) -> None:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    before = torch.get_num_threads()
    try:
        serve.build_server(parser.parse_args(["--model", str(tiny_dir)]))
        assert torch.get_num_threads() == default_compute_threads(available_cores())
        serve.build_server(parser.parse_args(["--model", str(tiny_dir), "--threads", "3"]))
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)
