"""What both HTTP fronts (the engine and the proxy) need to stand up a server, without torch: the admin
bearer token read from its file, the uvicorn configuration with the connection deadlines
(`http_connections`), the open-files limit raised to what the system allows, and several uvicorn servers
run together (the API and the admin port).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import resource
from pathlib import Path
from typing import Any

import uvicorn

from kvtune.contract.knobs import CAP_MODES
from kvtune.errors import KvtuneError
from kvtune.front.connections import (
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_IDLE_TIMEOUT_S,
    guarded_protocol,
)

logger = logging.getLogger(__name__)


def token_file_exposure(path: str | Path) -> str | None:
    """A warning when group or others may read the token file (anyone on the host could retune the
    engine), else None."""
    try:
        mode = Path(path).stat().st_mode
    except OSError:
        return None
    if mode & 0o077 == 0:
        return None
    return (
        f"--admin-token-file {path} is readable by group or others (mode {mode & 0o777:o}); "
        f"restrict it with `chmod 600 {path}`"
    )


def read_token_file(path: str | Path) -> str:
    """The admin bearer token: the file's content without surrounding whitespace (it must not be empty).
    Logs a warning when the file is open to group or others."""
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except OSError as err:
        raise KvtuneError(f"--admin-token-file {path}: {err.strerror or err}") from err
    if not token:
        raise KvtuneError(f"--admin-token-file {path} is empty")
    exposure = token_file_exposure(path)
    if exposure is not None:
        logger.warning("%s", exposure)
    return token


def front_config(app: Any, host: str, port: int, args: argparse.Namespace, **extra: Any) -> uvicorn.Config:
    """uvicorn's configuration for one of a front's ports: its connections under the header and idle
    deadlines of `--header-timeout` and `--idle-timeout`, and HTTP/1.0 streams close-delimited."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=guarded_protocol(args.header_timeout, args.idle_timeout),
        timeout_keep_alive=max(1, math.ceil(args.idle_timeout)),  # ours closes first; uvicorn's as a backstop
        log_level="info",
        ssl_certfile=args.ssl_certfile,
        ssl_keyfile=args.ssl_keyfile,
        **extra,
    )


def raise_open_files_limit() -> tuple[int, int]:
    """Raise the soft limit on open files to the hard one (every connection is a file descriptor; Python,
    unlike Go, leaves the soft limit where it found it, often 1,024). Returns (before, after)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError) as err:
            logger.warning("could not raise the open-files limit from %d to %d: %s", soft, wanted, err)
            return soft, soft
        return soft, wanted
    return soft, soft


def log_connection_limits(args: argparse.Namespace) -> None:
    """One boot line: the open-files limit (raised where it could be) and the connection deadlines."""
    before, after = raise_open_files_limit()
    raised = f" (raised from {before:,})" if after != before else ""
    logger.info(
        "open files limit %s%s; a connection idle %.0f s is closed, a request's headers get %.0f s",
        f"{after:,}", raised, args.idle_timeout, args.header_timeout,
    )  # fmt: skip


LOG_FORMAT = "%(levelname)s %(asctime)s [%(name)s] %(message)s"


def admin_token(args: argparse.Namespace) -> str | None:
    """The admin API's token from `--admin-token-file`, or None when the flag is absent (no admin API)."""
    return read_token_file(args.admin_token_file) if args.admin_token_file else None


def serve(server: uvicorn.Server, admin: uvicorn.Server | None, args: argparse.Namespace) -> None:
    """Run the API's server until it stops; with `--admin-port`, the admin API's server beside it."""
    if admin is None:
        server.run()
        return
    logger.info("admin API on http://%s:%d only", args.host, args.admin_port)
    asyncio.run(serve_together(server, admin))


async def serve_together(*servers: uvicorn.Server) -> None:
    """Run the servers on one event loop; when one stops (a signal, a bind failure) the others stop too."""
    tasks = [asyncio.create_task(server.serve()) for server in servers]
    await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for server in servers:
        server.should_exit = True
    await asyncio.gather(*tasks)


def add_front_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags `kvtune serve` and `kvtune proxy` share, spelled and meant the same way in both: the admin
    API, the max_tokens cap, and what the prefix-defeat detector groups by and may show."""
    parser.add_argument("--admin-token-file", help="enables /admin/config, guarded by the token in this file")
    parser.add_argument(
        "--admin-port", type=int, help="serve /admin/config on this port only (default: the main port)"
    )
    parser.add_argument("--max-tokens-cap", type=int, help="server-side cap on every request's max_tokens")
    parser.add_argument(
        "--cap-mode",
        default="clamp",
        choices=CAP_MODES,
        help="a request over --max-tokens-cap: clamp lowers its max_tokens (the response header "
        "X-Kvtune-Max-Tokens says so), reject answers 400; a request without max_tokens gets the cap",
    )
    parser.add_argument(
        "--prefix-key-header",
        metavar="NAME",
        help="group prompts for the prefix-defeat detector by this request header (a tenant), not by model",
    )
    parser.add_argument(
        "--header-timeout",
        type=float,
        default=DEFAULT_HEADER_TIMEOUT_S,
        metavar="S",
        help="seconds a request's headers may take from its first byte; a slower client gets a 408 and the "
        f"connection closes (default {DEFAULT_HEADER_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--idle-timeout",
        type=float,
        default=DEFAULT_IDLE_TIMEOUT_S,
        metavar="S",
        help="seconds a connection may stay open with no request in progress (a new one that sends nothing, "
        f"or a keep-alive one between requests) before it is closed (default {DEFAULT_IDLE_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--ssl-certfile",
        metavar="FILE",
        help="serve HTTPS with this certificate (PEM; with --ssl-keyfile), as vLLM's flag of the same name does",
    )
    parser.add_argument("--ssl-keyfile", metavar="FILE", help="the private key of --ssl-certfile (PEM)")
    parser.add_argument(
        "--prefix-report-text",
        action="store_true",
        help="show the prompt text of varying spans in /kvtune/prefix-report (prompt text is user data: "
        "off by default, the report then holds only positions, lengths and hashes)",
    )


def check_front_arguments(args: argparse.Namespace) -> None:
    """The shared flags' checks (the flags of `add_front_arguments`, the body limit and the ports), one
    clear KvtuneError for the first that is wrong."""
    if args.prefix_key_header is not None and not args.prefix_key_header.strip():
        raise KvtuneError("--prefix-key-header needs a header name")
    for flag, value in (("--header-timeout", args.header_timeout), ("--idle-timeout", args.idle_timeout)):
        if not 0 < value < math.inf:
            raise KvtuneError(f"{flag} must be a positive number of seconds, got {value}")
    if bool(args.ssl_certfile) != bool(args.ssl_keyfile):
        raise KvtuneError(
            "--ssl-certfile and --ssl-keyfile go together: HTTPS needs the certificate and its key"
        )
    for flag, path in (("--ssl-certfile", args.ssl_certfile), ("--ssl-keyfile", args.ssl_keyfile)):
        if path is not None and not os.access(path, os.R_OK):
            raise KvtuneError(f"{flag} {path}: not a readable file")
    if args.max_request_body_bytes < 1:
        raise KvtuneError(f"--max-request-body-bytes must be positive, got {args.max_request_body_bytes}")
    if args.admin_port is not None:
        if not args.admin_token_file:
            raise KvtuneError("--admin-port needs --admin-token-file (without a token there is no admin API)")
        if not 0 < args.admin_port < 65536 or args.admin_port == args.port:
            raise KvtuneError(
                f"--admin-port must be a free TCP port other than --port, got {args.admin_port}"
            )
