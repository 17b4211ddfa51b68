"""What both HTTP fronts (the engine and the proxy) need to stand up a server, without torch: the admin
bearer token read from its file, and several uvicorn servers run together (the API and the admin port).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import uvicorn

from kvtune.errors import KvtuneError

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


async def serve_together(*servers: uvicorn.Server) -> None:
    """Run the servers on one event loop; when one stops (a signal, a bind failure) the others stop too."""
    tasks = [asyncio.create_task(server.serve()) for server in servers]
    await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for server in servers:
        server.should_exit = True
    await asyncio.gather(*tasks)
