"""A real `kvtune proxy` (its uvicorn server, its upstream client, its tokenizer) running in a thread on a
free loopback port, and tiny raw upstreams that misbehave on purpose (silent, or closing mid-stream)."""

from __future__ import annotations

import argparse
import asyncio
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvtune.contract.admin import CapSetting
from kvtune.proxy import command
from kvtune.proxy.app import ProxyCore
from tests.server.live_server import StoppedOnExit, run_on_loopback

ADMIN_TOKEN = "proxy-admin-token"
TENANT_HEADER = "X-Tenant"


@dataclass
class LiveProxy(StoppedOnExit):
    url: str
    built: command.ProxyServer
    thread: threading.Thread

    @property
    def core(self) -> ProxyCore:
        return self.built.core

    def stop(self) -> None:
        self.built.server.should_exit = True
        if self.built.admin_server is not None:
            self.built.admin_server.should_exit = True
        self.thread.join(30)


def start_proxy(upstream: str, model_dir: Path, *flags: str) -> LiveProxy:
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    args = parser.parse_args(["--upstream", upstream, "--model-dir", str(model_dir), *flags])
    built = command.build_proxy(args)
    # --admin-port: the admin server binds the port the flag names
    admins = [built.admin_server] if built.admin_server is not None else []
    url, thread = run_on_loopback("proxy", built.server, *admins)
    return LiveProxy(url, built, thread)


def start_tenant_proxy(upstream: str, model_dir: Path, token_dir: Path) -> LiveProxy:
    """The proxy as the proxy and SGLang suites deploy it: 16-token blocks, an admin token (in a 0600 file
    under `token_dir`), tenants keyed by TENANT_HEADER."""
    token_file = token_dir / "token"
    token_file.write_text(ADMIN_TOKEN + "\n")
    token_file.chmod(0o600)
    return start_proxy(
        upstream, model_dir, "--block-size", "16", "--admin-token-file", str(token_file),
        "--prefix-key-header", TENANT_HEADER,
    )  # fmt: skip


@contextmanager
def capless_client(proxy: LiveProxy, timeout: float) -> Iterator[httpx.Client]:
    """A client of the proxy; the cap is back to none when it closes, so no test meets another's cap."""
    with httpx.Client(base_url=proxy.url, timeout=timeout) as http:
        yield http
    proxy.core.set_cap_setting(CapSetting())


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class RawUpstream:
    """An asyncio TCP server in a thread whose every connection runs `handler`: an upstream that answers
    exactly the bytes a test wants, or none at all."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.loop = asyncio.new_event_loop()
        self.connections = 0
        ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self.thread.start()
        ready.wait(10)
        self.url = f"http://127.0.0.1:{self.port}"

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)

        async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            await self.handler(reader, writer)

        self.server = self.loop.run_until_complete(asyncio.start_server(on_connect, "127.0.0.1", 0))
        self.port = self.server.sockets[0].getsockname()[1]
        ready.set()
        self.loop.run_forever()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


async def read_request_head(reader: asyncio.StreamReader) -> bytes:
    return await reader.readuntil(b"\r\n\r\n")


async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Read the request, then say nothing until the client gives up."""
    await read_request_head(reader)
    await reader.read()  # returns when the proxy closes the connection
    writer.close()


ONE_CHUNK = b'data: {"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":"hi"}]}\n\n'


async def one_chunk_then_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Start a chunked event stream, send one event, and drop the connection without ending the body."""
    await read_request_head(reader)
    writer.write(
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        + f"{len(ONE_CHUNK):x}\r\n".encode()
        + ONE_CHUNK
        + b"\r\n"
    )
    await writer.drain()
    await asyncio.sleep(0.05)
    writer.close()
