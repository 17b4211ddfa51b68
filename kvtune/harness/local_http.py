"""Loopback helpers for the benchmarks and tests that start servers as child processes."""

from __future__ import annotations

import socket
import urllib.request


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def health_ok(url: str) -> bool:
    """True when `url`/health answers 200 (kvtune serve and vLLM both serve it); False on any failure."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2.0) as response:
            status: int = response.status
            return status == 200
    except (OSError, ValueError):
        return False
