"""kvtune serve's default torch thread count: every core but one (the HTTP side keeps it), 1 on one core."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from kvtune.engine import command as serve
from kvtune.engine.loop.compute_threads import (
    allowed_cores,
    available_cores,
    default_compute_threads,
    engine_cores,
    pin_current_thread,
)


@pytest.mark.parametrize(("cores", "threads"), [(1, 1), (2, 1), (3, 2), (64, 63)])
def test_every_core_but_one_and_never_none(cores: int, threads: int) -> None:
    assert default_compute_threads(cores) == threads


@pytest.mark.skipif(shutil.which("taskset") is None, reason="taskset (util-linux) is not installed")
def test_available_cores_follow_the_affinity_a_process_is_given() -> None:
    code = "from kvtune.engine.loop.compute_threads import available_cores; print(available_cores())"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = subprocess.run(
        ["taskset", "-c", "0", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    assert out.stdout.strip() == "1"


@pytest.mark.parametrize(
    ("cores", "threads", "pinned"),
    [([0, 1], 1, {1}), ([0, 1], 2, None), ([0, 1, 2, 3], 3, {1, 2, 3}), ([4, 7], 1, {7}), ([3], 1, None)],
)
def test_the_engine_takes_the_last_cores_and_leaves_the_first(
    cores: list[int], threads: int, pinned: set[int] | None
) -> None:
    assert engine_cores(cores, threads) == (None if pinned is None else frozenset(pinned))


needs_two_cores = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(allowed_cores()) < 2, reason="needs Linux and 2 cores"
)


@needs_two_cores
def test_pinning_binds_the_calling_thread_only() -> None:
    target = frozenset(allowed_cores()[-1:])
    seen: list[set[int]] = []

    def pinned_thread() -> None:
        pin_current_thread(target)
        seen.append(os.sched_getaffinity(0))

    before = os.sched_getaffinity(0)
    thread = threading.Thread(target=pinned_thread)
    thread.start()
    thread.join()
    assert seen == [set(target)]
    assert os.sched_getaffinity(0) == before


@needs_two_cores
def test_a_served_engine_thread_runs_on_the_engine_cores(tiny_dir: Path) -> None:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    before = torch.get_num_threads()
    built = serve.build_server(parser.parse_args(["--model", str(tiny_dir), "--threads", "1"]))
    built.async_engine.start()
    try:
        on_engine = built.async_engine.submit(lambda _engine: os.sched_getaffinity(0)).result(30.0)
        assert on_engine == {allowed_cores()[-1]}
        assert os.sched_getaffinity(0) == set(allowed_cores())  # this thread (the event loop's) is free
    finally:
        built.async_engine.shutdown()
        torch.set_num_threads(before)


def _threads_of(args: list[str], tiny_dir: Path) -> tuple[int, int]:
    """(the engine thread's torch threads, the building thread's) of a server built with `args`."""
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    built = serve.build_server(parser.parse_args(["--model", str(tiny_dir), *args]))
    built.async_engine.start()
    try:
        on_engine = built.async_engine.submit(lambda _engine: torch.get_num_threads()).result(30.0)
        return on_engine, torch.get_num_threads()
    finally:
        built.async_engine.shutdown()


def test_serve_computes_on_the_engine_thread_only(tiny_dir: Path) -> None:
    """The engine thread takes the default or --threads; the thread that built the server (the event loop's)
    stays on one, so no second OpenMP team idles beside the engine's (which would make libgomp sleep at every
    barrier instead of spinning)."""
    before = torch.get_num_threads()
    try:
        assert _threads_of([], tiny_dir) == (default_compute_threads(available_cores()), 1)
        assert _threads_of(["--threads", "3"], tiny_dir) == (3, 1)
    finally:
        torch.set_num_threads(before)
