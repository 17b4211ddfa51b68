"""The `kubernetes` Service a pod reaches the API server through, for a container in this machine's network:
a TCP relay from 127.0.0.1:443 (kubernetes.default.svc's port, and an address the API server's certificate
names) to the local control plane's port. kopf's in-cluster login dials https://kubernetes.default.svc, the
Kubernetes client KUBERNETES_SERVICE_HOST:KUBERNETES_SERVICE_PORT; with the container's /etc/hosts naming
127.0.0.1 kubernetes.default.svc, both arrive here, as in a pod."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress

import pytest

SERVICE_PORT = 443


def pump(source: socket.socket, sink: socket.socket) -> None:
    """Bytes from one side to the other until either closes; then both close."""
    with suppress(OSError):
        while chunk := source.recv(65536):
            sink.sendall(chunk)
    for side in (source, sink):
        with suppress(OSError):
            side.shutdown(socket.SHUT_RDWR)


@contextmanager
def service_relay(target_port: int, host: str = "127.0.0.1") -> Iterator[int]:
    """Relay host:443 to host:target_port for the block; yields the port it listens on."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, SERVICE_PORT))
    except OSError as err:
        listener.close()
        pytest.fail(f"cannot listen on {host}:{SERVICE_PORT} as the kubernetes Service ({err}): the runtime "
                    "test needs that port free, and root", pytrace=False)  # fmt: skip
    listener.listen(64)
    connections: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:  # the listener was shut down
                return
            try:
                upstream = socket.create_connection((host, target_port), timeout=10)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            connections.extend((client, upstream))
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=pump, args=(source, sink), daemon=True).start()

    acceptor = threading.Thread(target=accept, name="kubernetes-service-relay", daemon=True)
    acceptor.start()
    try:
        yield SERVICE_PORT
    finally:
        with suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)  # wakes accept() (close alone does not, on Linux)
        listener.close()
        for connection in connections:
            with suppress(OSError):
                connection.close()
        acceptor.join(10)
