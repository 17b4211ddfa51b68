"""What a finished demo may leave behind, read from the operating system: a live process, an open port."""

from __future__ import annotations

import socket
from pathlib import Path


def alive(pid: int) -> bool:
    """Whether `pid` is a running process (a zombie, waiting to be reaped, is not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


def port_open(port: int) -> bool:
    """Whether something accepts connections on loopback `port`."""
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0
