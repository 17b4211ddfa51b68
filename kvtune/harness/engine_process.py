"""Start `kvtune serve` on the tiny model as a `ServerProcess` on a free loopback port (for benchmarks and
tests): the operator reaches engines over HTTP only, so it starts one the same way a user would."""

from __future__ import annotations

import subprocess
from pathlib import Path

from kvtune.harness.local_http import free_port
from kvtune.harness.server import ServerProcess, cli_argv

ENGINE_THREADS = 1  # torch threads of each started engine: several engines and a load share a small machine


def write_tiny_model_in_subprocess(folder: Path, *flags: str) -> Path:
    """`kvtune tiny-model FOLDER [FLAGS]` as a child process, so the caller never imports torch (the
    in-process writer is `kvtune.engine.model.tiny_model.write_tiny_model`)."""
    subprocess.run(cli_argv("tiny-model", str(folder), *flags), check=True, capture_output=True)
    return folder


def start_engine(
    model_dir: Path,
    token_file: Path,
    log: Path,
    *flags: str,
    port: int | None = None,
    host: str = "127.0.0.1",
    boot_timeout: float = 60.0,
    tls: tuple[Path, Path] | None = None,
) -> ServerProcess:
    """`kvtune serve --model DIR` with an admin token, ENGINE_THREADS torch threads and the given flags, on `port`
    (default: a free one; pass the old one to restart an engine where its clients expect it) on `host` (an
    address of its own: the pods of one Service share a port, each on its own address); over HTTPS with
    `tls` (certificate, key), as KServe serves vLLM."""
    port = port or free_port()
    https = ("--ssl-certfile", str(tls[0]), "--ssl-keyfile", str(tls[1])) if tls else ()
    command = cli_argv(
        "serve", "--model", str(model_dir), "--served-model-name", "tiny", "--host", host, "--port", str(port),
        "--threads", str(ENGINE_THREADS), "--admin-token-file", str(token_file), "--log-stats-interval", "0",
        *https, *flags,
    )  # fmt: skip
    return ServerProcess(command, port, log, name="the engine", append=True, host=host, poll_s=0.1,
                         scheme="https" if tls else "http").ready(boot_timeout)  # fmt: skip
