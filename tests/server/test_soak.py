"""Nothing is lost under pressure: a mix of valid, invalid, streamed and abandoned requests on a pool small
enough to preempt ends with every accepted request completed or reported aborted, and every block free.

Runs two minutes by default, the issue's "few minutes" (KVTUNE_SOAK_SECONDS changes it), and on until the
mix has shown what the checks need (some requests completed, abandoned and rejected, a preemption), so a
slow machine is not judged on less; a ten-times-longer cap only catches a hang.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from kvtune.bench.soak import INVALID, SHARED
from kvtune.engine.loop.llm_engine import EngineCounters
from tests.server.live_server import LiveServer

SOAK_SECONDS = float(os.environ.get("KVTUNE_SOAK_SECONDS", "120"))
HANG_S = 10 * SOAK_SECONDS + 600
WORKERS = 12


@dataclass
class Tally:
    completed: int = 0
    abandoned: int = 0
    rejected: int = 0
    unexpected: list[str] | None = None

    def fail(self, what: str) -> None:
        self.unexpected = [*(self.unexpected or []), what]


def random_body(rng: random.Random) -> dict[str, object]:
    own = [rng.randrange(32, 127) for _ in range(rng.randint(20, 120))]
    prompt = (SHARED + own) if rng.random() < 0.4 else own
    return {
        "prompt": prompt,
        "max_tokens": rng.randint(50, 250),
        "ignore_eos": True,
        "temperature": 0.7,
        "seed": 1,
    }


async def plain(http: httpx.AsyncClient, rng: random.Random, tally: Tally) -> None:
    body = random_body(rng)
    response = await http.post("/v1/completions", json=body)
    out = response.json()
    if response.status_code != 200 or out["usage"]["completion_tokens"] != body["max_tokens"]:
        tally.fail(f"plain: {response.status_code} {response.text[:200]}")
    tally.completed += 1


async def streamed(http: httpx.AsyncClient, rng: random.Random, tally: Tally, abandon: bool) -> None:
    body = {**random_body(rng), "stream": True, "stream_options": {"include_usage": True}}
    stop_after = rng.randint(1, 30) if abandon else None
    if abandon:  # hundreds of tokens still to come when the client leaves, so the server sees an abort
        body["max_tokens"] = 400
    tokens, usage, done = 0, None, False
    async with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            tally.fail(f"stream: {response.status_code}")
            return
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunk = json.loads(line[6:])
            tokens += bool(chunk["choices"])
            usage = chunk.get("usage") or usage
            if stop_after is not None and tokens >= stop_after:
                break
    if abandon:
        tally.abandoned += 1
    elif not done or tokens != body["max_tokens"] or usage is None or usage["completion_tokens"] != tokens:
        tally.fail(f"stream ended early: {tokens} tokens, done={done}")
    else:
        tally.completed += 1


async def plain_abandoned(url: str, rng: random.Random, tally: Tally) -> None:
    body = {**random_body(rng), "max_tokens": 400}
    # Only the wait for the response is short: a connect that times out (the client's own event loop
    # starved on 2 busy cores) would abandon a request the server never saw, which is not this case.
    patience = httpx.Timeout(10.0, read=0.2)
    async with httpx.AsyncClient(base_url=url, timeout=patience) as impatient:
        try:
            await impatient.post("/v1/completions", json=body)
        except httpx.ReadTimeout:
            tally.abandoned += 1
            return
    tally.completed += 1  # finished within the timeout after all: not abandoned


async def invalid(http: httpx.AsyncClient, rng: random.Random, tally: Tally) -> None:
    response = await http.post("/v1/completions", json=rng.choice(INVALID))
    if not 400 <= response.status_code < 500 or "error" not in response.json():
        tally.fail(f"invalid got {response.status_code}")
    tally.rejected += 1


async def worker(url: str, seed: int, going: Callable[[], bool], tally: Tally) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        while going():
            kind = rng.random()
            if kind < 0.3:
                await plain(http, rng, tally)
            elif kind < 0.55:
                await streamed(http, rng, tally, abandon=False)
            elif kind < 0.7:
                await streamed(http, rng, tally, abandon=True)
            elif kind < 0.8:
                await plain_abandoned(url, rng, tally)
            else:
                await invalid(http, rng, tally)


def test_soak_loses_nothing_and_frees_every_block(server: LiveServer) -> None:
    server.wait_idle()
    before = server.counters()
    tally = Tally()
    began = time.monotonic()

    def going() -> bool:
        elapsed = time.monotonic() - began
        shown = (
            tally.completed >= 10
            and tally.abandoned >= 3
            and tally.rejected >= 2
            and server.counters().num_preemptions > before.num_preemptions
        )
        return elapsed < HANG_S and (elapsed < SOAK_SECONDS or not shown)

    async def soak() -> None:
        await asyncio.gather(*(worker(server.url, seed, going, tally) for seed in range(WORKERS)))

    asyncio.run(soak())
    server.wait_idle(timeout=60)
    after = server.counters()
    assert tally.unexpected is None, tally.unexpected[:5]
    assert tally.completed >= 10 and tally.abandoned >= 3 and tally.rejected >= 2

    def finished(counters: EngineCounters, *reasons: str) -> int:
        return sum(counters.finished.get(r, 0) for r in reasons)

    assert finished(after, "length", "stop") - finished(before, "length", "stop") == tally.completed
    assert finished(after, "abort") - finished(before, "abort") == tally.abandoned
    assert after.num_preemptions > before.num_preemptions, "the pool was meant to be small enough to preempt"
    assert server.blocks_held() == 0
    assert server.on_engine(lambda e: e.allocator.free_slots == e.allocator.num_slots)
    assert server.built.async_engine.latest.num_waiting == 0
