"""One process that stands in for many engines' /metrics (`kvtune bench fleet`'s pods): every endpoint, an
(address, port) pair, replays one recording (fleet_replay.py) from a phase of its own, so the pods of a
fleet are not in step. A raw asyncio HTTP/1.1 server: GET /metrics answers the scrape that stands now, with
keep-alive; GET /version answers `{"version": V}` where the plan gives the recorded engine's version V (as
vLLM does; the operator reads it to pick vLLM's admission flag); anything else is 404. It prints
`serving N endpoints` once every socket is bound.

    python -m kvtune.bench.fleet_replay_server PLAN.json

PLAN.json: {"recordings": {"NAME": "PATH.prom" or {"path": "PATH.prom", "version": "0.32.0"}, ...},
            "endpoints": [{"address": "10.244.255.2", "port": 20000, "recording": "NAME"}, ...]}
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import signal
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

from kvtune.bench.fleet_replay import Replay, replay_of

CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"
HEADER_LIMIT = 16_384  # a request head longer than this is no scraper's
RENDERED_KEPT = 4096  # (recording, loop, scrape) bodies kept: pods at one position share one


@dataclass(frozen=True)
class Endpoint:
    address: str
    port: int
    recording: str

    @property
    def phase(self) -> float:
        """Where in its loop this endpoint starts, as a fraction of it: fixed by its address and port."""
        return zlib.crc32(f"{self.address}:{self.port}".encode()) / 2**32


@dataclass(frozen=True)
class Plan:
    replays: dict[str, Replay]
    endpoints: tuple[Endpoint, ...]
    versions: dict[str, bytes]  # recording -> the body of its engine's GET /version (absent: 404)


def load_plan(path: Path) -> Plan:
    plan = json.loads(path.read_text())
    given = {
        name: entry if isinstance(entry, dict) else {"path": entry}
        for name, entry in plan["recordings"].items()
    }
    replays = {name: replay_of(name, Path(entry["path"]).read_text()) for name, entry in given.items()}
    versions = {name: json.dumps({"version": entry["version"]}).encode()
                for name, entry in given.items() if entry.get("version")}  # fmt: skip
    endpoints = tuple(
        Endpoint(str(e["address"]), int(e["port"]), str(e["recording"])) for e in plan["endpoints"]
    )
    unknown = sorted({e.recording for e in endpoints} - set(replays))
    if unknown:
        raise ValueError(f"endpoints name recordings the plan lacks: {', '.join(unknown)}")
    return Plan(replays, endpoints, versions)


class ReplayServer:
    """Serves a plan's endpoints from one event loop; `started` is the monotonic time loop 0 began."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.started = time.monotonic()
        self.servers: list[asyncio.Server] = []
        self.render = functools.lru_cache(maxsize=RENDERED_KEPT)(self._render)

    def _render(self, recording: str, loop: int, index: int) -> bytes:
        return self.plan.replays[recording].render(loop, index)

    def body(self, endpoint: Endpoint) -> bytes:
        replay = self.plan.replays[endpoint.recording]
        loop, index = replay.position(time.monotonic() - self.started + endpoint.phase * replay.period)
        return self.render(endpoint.recording, loop, index)

    async def start(self) -> None:
        for endpoint in self.plan.endpoints:
            handler = functools.partial(self.answer, endpoint)
            self.servers.append(
                await asyncio.start_server(handler, endpoint.address, endpoint.port, backlog=512)
            )

    async def close(self) -> None:
        for server in self.servers:
            server.close()
        for server in self.servers:
            await server.wait_closed()

    async def answer(
        self, endpoint: Endpoint, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """Requests on one connection until the client closes it or asks to."""
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
                    return
                if len(head) > HEADER_LIMIT:
                    return
                request, *headers = head.decode("latin-1").split("\r\n")
                words = request.split()
                closing = any(h.lower().replace(" ", "") == "connection:close" for h in headers)
                path = words[1].split("?", 1)[0] if len(words) == 3 and words[0] in ("GET", "HEAD") else None
                version = self.plan.versions.get(endpoint.recording)
                if path == "/metrics":
                    body = self.body(endpoint)
                    status, kind = b"200 OK", CONTENT_TYPE
                elif path == "/version" and version is not None:
                    body, status, kind = version, b"200 OK", b"application/json"
                else:
                    body, status, kind = b"not found\n", b"404 Not Found", b"text/plain"
                writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Type: " + kind + b"\r\nContent-Length: "
                             + str(len(body)).encode() + b"\r\n" + (b"Connection: close\r\n" if closing else b"")
                             + b"\r\n" + (b"" if words and words[0] == "HEAD" else body))  # fmt: skip
                await writer.drain()
                if closing:
                    return
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()


async def serve(plan: Plan) -> None:
    server = ReplayServer(plan)
    await server.start()
    print(f"serving {len(plan.endpoints)} endpoints", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    await server.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("plan", type=Path)
    args = parser.parse_args(argv)
    try:
        plan = load_plan(args.plan)
    except (OSError, ValueError, KeyError) as err:
        sys.stderr.write(f"fleet replay server: {err}\n")
        return 2
    asyncio.run(serve(plan))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
