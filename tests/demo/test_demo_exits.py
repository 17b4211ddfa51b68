"""How `kvtune demo` ends when it cannot run or is stopped: a port in use and a missing build step are one
clear line; Ctrl-C stops every child and leaves no process and no open port behind."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from kvtune.demo.engine import last_line
from kvtune.harness.local_http import free_port
from tests.demo.leftovers import alive, port_open

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}
DEMO = [sys.executable, "-m", "kvtune.cli", "demo", "--quick"]
# the engine's SIGTERM then SIGKILL (3 s each) and the clients' last requests: seconds, not this
STOP_WITHIN_S = 60


def test_a_port_in_use_is_one_clear_line(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [*DEMO, "--port", str(port), "--out", str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=60,
            env=ENV,
        )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"kvtune: error: port {port} is in use (Address already in use): pass --port with a free one"
    ]


def test_a_missing_kernel_build_names_the_make_target(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    log.write_text(
        "INFO booting\nkvtune: error: the CPU attention kernel is not built: not found in ~/.cache\n\n"
    )
    line = last_line(log)
    assert line.startswith("kvtune: error: the CPU attention kernel is not built")
    assert "`make demo`" in line and "\n" not in line
    assert last_line(tmp_path / "absent.log").startswith("no output (log: ")


def _read_until(process: subprocess.Popen[str], text: str, seconds: float) -> list[str]:
    assert process.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and process.poll() is None:
        ready, _, _ = select.select([process.stdout], [], [], 1.0)
        if ready:
            lines.append(process.stdout.readline())
            if text in lines[-1]:
                return lines
    raise AssertionError(f"{text!r} never printed; got {lines[-5:]}")


def test_ctrl_c_stops_every_child_and_frees_the_port(tmp_path: Path) -> None:
    port = free_port()
    # A terminal's foreground program gets SIGINT at its default; a process started by one that ignores it
    # (pytest after some earlier test) would inherit SIG_IGN, and Python then never raises KeyboardInterrupt.
    process = subprocess.Popen(
        [*DEMO, "--port", str(port), "--out", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    try:
        _read_until(process, "the load is on", 120)  # the engine booted and the clients are sending
        pids = [int(p) for p in (tmp_path / "children.txt").read_text().split()]
        assert len(pids) == 1 and alive(pids[0]) and port_open(port)
        process.send_signal(signal.SIGINT)
        try:
            code = process.wait(STOP_WITHIN_S)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGUSR1)  # the demo dumps every thread's stack: where the stop hung
            time.sleep(3)
            process.kill()
            tail = process.communicate(timeout=30)[0][-6000:]
            raise AssertionError(
                f"the demo did not stop within {STOP_WITHIN_S} s of Ctrl-C:\n{tail}"
            ) from None
        assert code == 130
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        left = (
            [int(p) for p in (tmp_path / "children.txt").read_text().split()]
            if (tmp_path / "children.txt").exists()
            else []
        )
        for pid in left:  # a failed stop must not leave an engine running under the tests that follow
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
    assert not [pid for pid in pids if alive(pid)]
    assert not port_open(port)
