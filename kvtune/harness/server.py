"""One launcher for a server the benchmarks, the demo and the tests drive from the outside: a child process
in its own process group, its output in a log, ready once its /health answers, and `cli_argv` to run a
`kvtune` verb with this interpreter."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Self

from kvtune.errors import KvtuneError
from kvtune.harness.local_http import health_ok

LOG_TAIL_CHARS = 3000


def cli_argv(*args: str) -> list[str]:
    """`kvtune ARGS...` as this interpreter runs it (the installed script may be another checkout's)."""
    return [sys.executable, "-m", "kvtune.cli", *args]


def signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def log_tail(path: Path) -> str:
    try:
        return path.read_text(errors="replace")[-LOG_TAIL_CHARS:].strip()
    except OSError:
        return ""


class ServerProcess:
    """A server (`cli_argv("serve", ...)`, a proxy, a relay) as a child in its own process group, so stopping
    it stops everything it started; its output goes to `log_path` (appended to with `append`, as a restart
    does; `header`: the command as its first line). A context manager that stops it."""

    def __init__(
        self, argv: list[str], port: int, log_path: Path, name: str = "kvtune serve", append: bool = False,
        header: bool = True, env: dict[str, str] | None = None, poll_s: float = 0.5, host: str = "127.0.0.1",
        scheme: str = "http",
    ) -> None:  # fmt: skip
        self.name = name  # what error messages call it (the proxy bench starts kvtune proxy and a relay too)
        self.host = host  # the address it listens on: the pods of one Service share a port, each on its own
        self.port = port
        self.scheme = scheme  # https for a server started with a certificate
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("ab" if append else "wb") as log:
            if header:  # the command, first: what a reader of the log needs to run it again
                log.write(("$ " + " ".join(argv) + "\n").encode())
                log.flush()
            self.process = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        self.poll_s = poll_s  # how often readiness is asked

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"

    def log_tail(self) -> str:
        return log_tail(self.log_path)

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not health_ok(self.url):
            code = self.process.poll()
            if code is not None:
                raise KvtuneError(
                    f"{self.name} exited with {code} before it was ready (log: {self.log_path}):\n"
                    f"{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise KvtuneError(
                    f"{self.name} not ready after {timeout_s:.0f} s (log: {self.log_path}):\n{self.log_tail()}"
                )
            time.sleep(self.poll_s)

    def ready(self, timeout_s: float) -> Self:
        """`wait_ready`, stopping the server if it never gets there (or the wait is interrupted): for a
        caller that keeps the server beyond one `with` block."""
        try:
            self.wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM to the group, SIGKILL after `grace_s`; then SIGKILL to whatever the server left in it."""
        if self.process.poll() is None:
            signal_group(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                signal_group(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=grace_s)
        signal_group(self.process.pid, signal.SIGKILL)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
