"""`kvtune bench soak [--minutes 30] [--every 30]`: does the engine's memory level off under a long mixed
load, and what is it made of?

`kvtune serve --tiny` runs as a child process with tracemalloc on (`KVTUNE_TRACEMALLOC`), on a pool small
enough to preempt. Clients send a mix of plain and streamed completions and chats, hang up on streams and
on plain requests half-way, and send invalid bodies. Every `--every` seconds the engine's resident memory
(from /proc, outside it), its Python heap as tracemalloc traces it, glibc malloc's bytes in use and kept
free, its threads and its file descriptors are sampled (`/kvtune/memory`). At the end the load stops,
every client connection closes, and the engine must hold no KV block and no more descriptors than before
the load; no answer may be a 5xx.

The verdict: resident memory levels off when it grew less than 1% over the last 10 minutes (or the last
third of a shorter soak). The heap's allocation sites that grew most between the first sample after the
warm-up and the last say where any growth went. The figures go to BENCHMARKS.md with the machine line.
The same driver runs in the suite by rounds of requests (tests/server/test_memory_plateau.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvtune.harness.local_http import free_port
from kvtune.harness.server import ServerProcess, cli_argv

SECTION = "soak"
ENGINE_FLAGS = ("--kv-cache-tokens", "1024", "--max-num-seqs", "8", "--max-waiting-requests", "256",
                "--threads", "1", "--log-stats-interval", "0")  # fmt: skip
SHARED = [ord(c) for c in "You are a terse assistant. Answer in one line. " * 2]
INVALID: list[dict[str, Any]] = [
    {"prompt": "x", "max_tokens": -5},
    {"prompt": "x", "max_tokens": 10**9},
    {"model": "other", "prompt": "x"},
    {"prompt": ""},
    {"prompt": [10**7]},
    {"prompt": "x", "temperature": "warm"},
]
LEVEL_WINDOW_S = 600.0  # the verdict's span: the last 10 minutes
LEVEL_GROWTH = 0.01  # less than 1% growth over it is level


@dataclass
class Tally:
    """Every answer by kind; a 5xx or an unexpected failure is a finding, never expected."""

    completed: int = 0
    hung_up: int = 0
    refused: int = 0  # 4xx for the invalid bodies, 429 when the queue is full
    server_errors: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)

    @property
    def requests(self) -> int:
        return self.completed + self.hung_up + self.refused + len(self.server_errors) + len(self.unexpected)

    def answered(self, status: int, what: str) -> bool:
        """Count a non-200 answer; whether it was one at all."""
        if status >= 500:
            self.server_errors.append(f"{what}: HTTP {status}")
        elif status != 200:
            self.refused += 1
        return status != 200


def body(rng: random.Random) -> dict[str, Any]:
    own = [rng.randrange(32, 127) for _ in range(rng.randint(20, 160))]
    return {"model": "tiny", "prompt": (SHARED + own) if rng.random() < 0.4 else own,
            "max_tokens": rng.randint(16, 200), "ignore_eos": True, "temperature": 0.7}  # fmt: skip


async def one_request(http: httpx.AsyncClient, url: str, rng: random.Random, tally: Tally) -> None:
    """One request of the mix: 25% plain, 10% chat, 25% streamed to the end, 15% streamed and hung up on,
    10% plain and hung up on, 15% invalid."""
    kind = rng.random()
    try:
        if kind < 0.25:
            response = await http.post("/v1/completions", json=body(rng))
            if not tally.answered(response.status_code, "plain"):
                tally.completed += 1
        elif kind < 0.35:
            chat = {"model": "tiny", "messages": [{"role": "user", "content": "Say something " * rng.randint(1, 20)}],
                    "max_tokens": rng.randint(8, 64)}  # fmt: skip
            response = await http.post("/v1/chat/completions", json=chat)
            if not tally.answered(response.status_code, "chat"):
                tally.completed += 1
        elif kind < 0.75:
            hang_up_after = rng.randint(1, 20) if kind >= 0.6 else None
            await streamed(http, rng, tally, hang_up_after)
        elif kind < 0.85:
            impatient = httpx.Timeout(30.0, read=rng.uniform(0.05, 0.5))
            async with httpx.AsyncClient(base_url=url, timeout=impatient) as hasty:
                try:
                    response = await hasty.post("/v1/completions", json={**body(rng), "max_tokens": 300})
                except httpx.ReadTimeout:
                    tally.hung_up += 1
                    return
            if not tally.answered(response.status_code, "hasty"):
                tally.completed += 1
        else:
            response = await http.post("/v1/completions", json={"model": "tiny", **rng.choice(INVALID)})
            if response.status_code >= 500 or response.status_code < 400:
                tally.answered(response.status_code, "invalid")
                if response.status_code < 400:
                    tally.unexpected.append(f"invalid body answered {response.status_code}")
            else:
                tally.refused += 1
    except httpx.HTTPError as err:
        tally.unexpected.append(f"{type(err).__name__}: {err}")


async def streamed(
    http: httpx.AsyncClient, rng: random.Random, tally: Tally, hang_up_after: int | None
) -> None:
    request = {**body(rng), "stream": True}
    tokens = 0
    async with http.stream("POST", "/v1/completions", json=request) as response:
        if tally.answered(response.status_code, "stream"):
            await response.aread()
            return
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                break
            if line.startswith("data: "):
                tokens += bool(json.loads(line[6:])["choices"])
                if hang_up_after is not None and tokens >= hang_up_after:
                    tally.hung_up += 1
                    return
    if tokens != request["max_tokens"]:
        tally.unexpected.append(f"stream ended after {tokens} of {request['max_tokens']} tokens")
    else:
        tally.completed += 1


async def drive(url: str, clients: int, seed: int, tally: Tally, keep_going: Callable[[int], bool]) -> None:
    """`clients` workers sending the mix one request after another while `keep_going(requests so far)`."""

    async def worker(index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        async with httpx.AsyncClient(base_url=url, timeout=300) as http:
            while keep_going(tally.requests):
                await one_request(http, url, rng, tally)

    await asyncio.gather(*(worker(i) for i in range(clients)))


def load_rounds(url: str, clients: int, seed: int, tally: Tally, requests: int) -> None:
    """Exactly `requests` more requests (give or take the ones in flight when the count is reached)."""
    target = tally.requests + requests
    asyncio.run(drive(url, clients, seed, tally, lambda done: done < target))


@dataclass(frozen=True)
class Reading:
    at: float  # seconds since the load started
    requests: int
    rss: int
    heap: int | None  # tracemalloc's traced bytes
    malloc_in_use: int | None
    malloc_free: int | None
    threads: int | None
    fds: int | None
    sites: tuple[tuple[str, int], ...] = ()


def rss_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def fds_of(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def read_engine(url: str, pid: int, at: float, requests: int) -> Reading:
    report = httpx.get(f"{url}/kvtune/memory", timeout=120).json()
    traced = report.get("tracemalloc") or {}
    malloc = report.get("malloc") or {}
    sites = tuple((site["where"], site["bytes"]) for site in traced.get("top_sites", []))
    return Reading(at, requests, rss_of(pid), traced.get("current_bytes"), malloc.get("in_use"), malloc.get("free"),
                   report.get("os_threads"), fds_of(pid), sites)  # fmt: skip


def engine_state(url: str) -> dict[str, float]:
    """KV usage and requests running and waiting, from /metrics."""
    found: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        for name in ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting"):
            if line.startswith(name + "{") or line.startswith(name + " "):
                found[name] = found.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return found


def wait_idle(url: str, timeout_s: float = 120.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        state = engine_state(url)
        if state.get("vllm:num_requests_running", 1) == 0 and state.get("vllm:num_requests_waiting", 1) == 0:
            return state
        if time.monotonic() > deadline:
            raise RuntimeError(f"the engine did not go idle: {state}")
        time.sleep(0.2)


def start(
    log: Path,
    tracemalloc_frames: int,
    extra_env: dict[str, str] | None = None,
    extra_flags: tuple[str, ...] = (),
) -> ServerProcess:
    port = free_port()
    env = {**os.environ, "KVTUNE_TRACEMALLOC": str(tracemalloc_frames), **(extra_env or {})}
    argv = cli_argv(
        "serve", "--tiny", "--served-model-name", "tiny", "--port", str(port), *ENGINE_FLAGS, *extra_flags
    )
    return ServerProcess(argv, port, log, name="the engine", append=True, env=env).ready(300)


@dataclass
class Verdict:
    level: bool
    growth: float  # relative RSS growth over the verdict's span
    span_s: float
    plateau_mb: float


def verdict(readings: list[Reading], span_s: float = LEVEL_WINDOW_S) -> Verdict:
    """Whether resident memory levelled off: growth over the last `span_s` seconds (the last third of the
    readings when the soak is shorter than three spans) under LEVEL_GROWTH."""
    last = readings[-1]
    if last.at >= 3 * span_s:
        start = next(r for r in readings if r.at >= last.at - span_s)
    else:
        start = readings[len(readings) * 2 // 3]
    growth = (last.rss - start.rss) / start.rss
    return Verdict(growth < LEVEL_GROWTH, growth, last.at - start.at, last.rss / 2**20)


def grown_sites(first: Reading, last: Reading, count: int = 6) -> list[tuple[str, int, int]]:
    """(site, bytes at the first reading, bytes at the last) of the sites that grew most."""
    before = dict(first.sites)
    grown = sorted(((where, before.get(where, 0), size) for where, size in last.sites),
                   key=lambda item: item[1] - item[2])  # fmt: skip
    return [item for item in grown if item[2] > item[1]][:count]


def mb(value: int | None) -> str:
    return "n/a" if value is None else f"{value / 2**20:,.1f}"


def short(where: str) -> str:
    """A site's file:line with its path cut to the package."""
    for marker in ("site-packages/", "kvtune/", "lib/python3"):
        if marker in where:
            return where[where.index(marker) :]
    return where


def format_table(readings: list[Reading]) -> str:
    lines = ["| t (min) | requests | RSS MB | Python heap MB (traced) | malloc in use MB | malloc free MB | threads | fds |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    lines += [
        f"| {r.at / 60:.1f} | {r.requests:,} | {mb(r.rss)} | {mb(r.heap)} | {mb(r.malloc_in_use)} | "
        f"{mb(r.malloc_free)} | {r.threads} | {r.fds} |"
        for r in readings
    ]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--minutes", type=float, default=30.0, help="how long the load runs (default 30)")
    parser.add_argument("--every", type=float, default=30.0, help="seconds between memory readings")
    parser.add_argument("--clients", type=int, default=12, help="concurrent clients (default 12)")
    parser.add_argument("--warmup-minutes", type=float, default=2.0, help="not counted in the site growth")
    parser.add_argument("--tracemalloc", type=int, default=1, help="frames per traced allocation (default 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-dir", type=Path, default=Path(".bench-logs"))
    parser.add_argument("--json", type=Path, help="also write every reading as JSON here")
    parser.add_argument("--output", type=Path, default=Path("BENCHMARKS.md"))
    parser.add_argument("--no-record", action="store_true", help="print only; leave BENCHMARKS.md alone")


def run(args: argparse.Namespace) -> int:
    from kvtune.bench.benchmarks_md import git_revision, machine_description, record_section
    from kvtune.errors import KvtuneError

    if args.minutes <= 0 or args.every <= 0 or args.clients < 1:
        raise KvtuneError("--minutes and --every must be positive, --clients at least 1")
    args.log_dir.mkdir(parents=True, exist_ok=True)
    engine = start(args.log_dir / "soak-engine.log", args.tracemalloc)
    pid = engine.process.pid
    tally = Tally()
    try:
        wait_idle(engine.url)
        fds_before = fds_of(pid)
        readings = [read_engine(engine.url, pid, 0.0, 0)]
        print(
            f"engine {engine.url} pid {pid}: RSS {mb(readings[0].rss)} MB, {fds_before} fds before the load"
        )
        began = time.monotonic()
        stop_at = began + args.minutes * 60
        load = threading.Thread(target=lambda: asyncio.run(drive(engine.url, args.clients, args.seed, tally,
                                                                 lambda _: time.monotonic() < stop_at)))  # fmt: skip
        load.start()
        while (due := began + len(readings) * args.every) < stop_at:
            load.join(max(0.0, due - time.monotonic()))
            if not load.is_alive():
                break
            reading = read_engine(engine.url, pid, time.monotonic() - began, tally.requests)
            readings.append(reading)
            print(f"{reading.at / 60:5.1f} min  {reading.requests:6,} requests  RSS {mb(reading.rss)} MB  "
                  f"heap {mb(reading.heap)} MB  malloc {mb(reading.malloc_in_use)} in use / "
                  f"{mb(reading.malloc_free)} free  threads {reading.threads}  fds {reading.fds}", flush=True)  # fmt: skip
        load.join()
        state = wait_idle(engine.url)
        time.sleep(0.5)  # the last client connections' closes reach the engine
        fds_after = fds_of(pid)
        final = read_engine(engine.url, pid, time.monotonic() - began, tally.requests)
    finally:
        engine.stop()
    found = verdict(readings)
    warm = next((r for r in readings if r.at >= args.warmup_minutes * 60), readings[0])
    grown = grown_sites(warm, readings[-1])
    kv_after = state.get("vllm:kv_cache_usage_perc", -1.0)
    print(format_table(readings))
    print(f"verdict: RSS {'levels off' if found.level else 'still grows'}: {found.growth:+.2%} over the last "
          f"{found.span_s / 60:.1f} min, at {found.plateau_mb:,.0f} MB; {tally.requests:,} requests, "
          f"{tally.completed:,} completed, {tally.hung_up:,} hung up, {tally.refused:,} refused, "
          f"{len(tally.server_errors)} 5xx, {len(tally.unexpected)} unexpected; KV usage after {kv_after:.0%}; "
          f"fds {fds_before} before, {fds_after} after")  # fmt: skip
    for where, before, after in grown:
        print(f"  {short(where)}: {mb(before)} -> {mb(after)} MB")
    if args.json:
        args.json.write_text(json.dumps([r.__dict__ for r in [*readings, final]], default=list, indent=1))
    ok = (
        found.level
        and not tally.server_errors
        and not tally.unexpected
        and kv_after == 0
        and fds_after <= fds_before
    )
    if not args.no_record:
        record_section(SECTION, format_section(args, readings, found, grown, tally, (fds_before, fds_after),
                                               kv_after, machine_description(), git_revision()), args.output)  # fmt: skip
    return 0 if ok else 1


def format_section(
    args: argparse.Namespace, readings: list[Reading], found: Verdict, grown: list[tuple[str, int, int]],
    tally: Tally, fds: tuple[int, int], kv_after: float, machine: str, revision: str,
) -> str:  # fmt: skip
    sites = "\n".join(f"- `{short(where)}`: {mb(before)} -> {mb(after)} MB" for where, before, after in grown)
    return f"""## Soak: memory under a long mixed load

`kvtune bench soak --minutes {args.minutes:g} --every {args.every:g} --clients {args.clients}` at {revision},
on {machine}. `kvtune serve --tiny` ({" ".join(ENGINE_FLAGS)}), tracemalloc on ({args.tracemalloc} frame);
{args.clients} clients: plain and chat completions, streams read to the end, streams and plain requests hung
up on half-way, invalid bodies.

{format_table(readings)}

Verdict: resident memory {"levels off" if found.level else "still grows"}: {found.growth:+.2%} over the last
{found.span_s / 60:.1f} minutes, at {found.plateau_mb:,.0f} MB. {tally.requests:,} requests: {tally.completed:,}
completed, {tally.hung_up:,} hung up on, {tally.refused:,} refused (4xx, 429), {len(tally.server_errors)} 5xx,
{len(tally.unexpected)} unexpected. After the load: KV usage {kv_after:.0%}, {fds[1]} file descriptors
({fds[0]} before it).

Python heap sites that grew most after the {args.warmup_minutes:g}-minute warm-up:
{sites or "- none"}
"""
