"""A bare TCP relay, the floor of any second hop: bytes copied both ways, no HTTP parsing at all.

`kvtune bench proxy` times it beside the proxy, so what the proxy adds to time to first token can be told
apart from what any extra hop costs on the machine at hand (on a busy 2-core box that alone is over 1 ms).
Run as `python -m kvtune.bench.tcp_relay LISTEN_PORT UPSTREAM_HOST:PORT`; uvloop when present, as the proxy.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


def _no_delay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


async def relay(listen_port: int, upstream_host: str, upstream_port: int) -> None:
    async def handle(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(upstream_host, upstream_port)
        except OSError:
            client_writer.close()
            return
        _no_delay(client_writer)
        _no_delay(up_writer)
        await asyncio.gather(_pipe(client_reader, up_writer), _pipe(up_reader, client_writer))

    server = await asyncio.start_server(handle, "127.0.0.1", listen_port)
    async with server:
        await server.serve_forever()


def main(argv: list[str]) -> int:
    listen, upstream = int(argv[0]), argv[1]
    host, _, port = upstream.rpartition(":")
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(relay(listen, host, int(port)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
