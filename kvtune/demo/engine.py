"""The demo's engine: `kvtune serve --tiny` as a `ServerProcess` (its own process group, so stopping it
stops everything it started), on a port checked free first; a boot that fails is one clear line."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path

from kvtune.errors import KvtuneError
from kvtune.harness.server import ServerProcess, cli_argv

BOOT_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 3.0  # uvicorn waits for open streams; the demo's clients retry
MODEL_NAME = "tiny"


def check_port_free(port: int) -> None:
    """One clear line when something already listens on `port` (the engine would fail later, less clearly)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no use
        try:
            sock.bind(("127.0.0.1", port))
        except OSError as err:
            raise KvtuneError(
                f"port {port} is in use ({err.strerror}): pass --port with a free one"
            ) from None


@dataclass(frozen=True)
class EngineSpec:
    port: int
    token_file: Path
    log: Path
    kv_cache_memory_bytes: int
    max_num_seqs: int
    dtype: str
    threads: int

    def command(self, kv_cache_dtype: str) -> list[str]:
        return cli_argv(
            "serve", "--tiny", "--served-model-name", MODEL_NAME, "--port", str(self.port),
            "--admin-token-file", str(self.token_file), "--log-stats-interval", "0",
            "--threads", str(self.threads), "--dtype", self.dtype,
            "--kv-cache-memory-bytes", str(self.kv_cache_memory_bytes), "--kv-cache-dtype", kv_cache_dtype,
            "--max-num-seqs", str(self.max_num_seqs), "--max-waiting-requests", "-1",
        )  # fmt: skip


class Engine:
    """One running engine process (a `ServerProcess`); `stop()` ends its whole process group."""

    def __init__(self, spec: EngineSpec, kv_cache_dtype: str) -> None:
        self.spec = spec
        self.kv_cache_dtype = kv_cache_dtype
        check_port_free(spec.port)
        self.server = ServerProcess(spec.command(kv_cache_dtype), spec.port, spec.log, name="the engine",
                                    append=True, header=False)  # fmt: skip
        self.url = self.server.url
        try:
            self.server.wait_ready(BOOT_TIMEOUT_S)
        except KvtuneError:
            self.stop()
            if self.server.process.poll() is not None:
                raise KvtuneError(f"the engine exited while booting: {last_line(spec.log)}") from None
            raise KvtuneError(
                f"the engine did not answer within {BOOT_TIMEOUT_S:.0f} s (log: {spec.log})"
            ) from None
        except BaseException:
            self.stop()
            raise

    @property
    def pid(self) -> int:
        return self.server.process.pid

    def stop(self) -> None:
        self.server.stop(STOP_TIMEOUT_S)


def last_line(log: Path) -> str:
    """The engine's last log line (its error), with the make target when a build step is what is missing."""
    try:
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        lines = []
    line = lines[-1].strip() if lines else f"no output (log: {log})"
    if "kernel" in line.lower() and ("build" in line.lower() or "not found" in line.lower()):
        line += " (run `make demo` or `make unit`: the Makefile's $(STAMP) step builds the CPU kernel)"
    return line
