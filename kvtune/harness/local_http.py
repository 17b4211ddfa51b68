"""Loopback helpers for the benchmarks and tests that start servers as child processes."""

from __future__ import annotations

import socket
import ssl
import urllib.request


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def health_ok(url: str) -> bool:
    """True when `url`/health answers 200 (kvtune serve and vLLM both serve it); False on any failure. An
    https URL is asked without checking its certificate: a test's or a pod's own, which nothing signs."""
    context = None
    if url.startswith("https:"):
        context = ssl.create_default_context()
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2.0, context=context) as response:
            status: int = response.status
            return status == 200
    except (OSError, ValueError):
        return False
