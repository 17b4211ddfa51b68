"""A closed-loop load for the tuner's checks: `clients` workers, each sending one completion after another
(random token-id prompts, generation through EOS) until a deadline, then finishing what is in flight.

Used by `kvtune bench tuner` and the closed-loop test; every request is counted, so a lost one shows.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from dataclasses import dataclass, field

import httpx


@dataclass(frozen=True)
class LoadShape:
    clients: int = 16
    prompt_len: tuple[int, int] = (40, 80)
    output_len: tuple[int, int] = (80, 160)
    model: str = "tiny"
    seed: int = 0


@dataclass
class LoadTally:
    sent: int = 0
    completed: int = 0
    generated_tokens: int = 0
    failures: list[str] = field(default_factory=list)


async def _client(
    http: httpx.AsyncClient, shape: LoadShape, rng: random.Random, stop: threading.Event, tally: LoadTally
) -> None:
    while not stop.is_set():
        prompt = [rng.randrange(32, 127) for _ in range(rng.randint(*shape.prompt_len))]
        max_tokens = rng.randint(*shape.output_len)
        body = {"model": shape.model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                "temperature": 0.0}  # fmt: skip
        tally.sent += 1
        try:
            response = await http.post("/v1/completions", json=body)
            usage = response.json().get("usage", {}) if response.status_code == 200 else {}
        except (httpx.HTTPError, ValueError) as err:
            tally.failures.append(f"{type(err).__name__}: {err}")
            continue
        if response.status_code != 200 or usage.get("completion_tokens") != max_tokens:
            tally.failures.append(f"HTTP {response.status_code}: {response.text[:200]}")
            continue
        tally.completed += 1
        tally.generated_tokens += max_tokens


async def _drive(url: str, shape: LoadShape, stop: threading.Event, tally: LoadTally) -> None:
    limits = httpx.Limits(max_connections=shape.clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as http:
        rngs = [random.Random(shape.seed * 1000 + i) for i in range(shape.clients)]
        await asyncio.gather(*(_client(http, shape, rng, stop, tally) for rng in rngs))


class BackgroundLoad:
    """The load in a thread of its own: `start()`, later `stop()` (waits for in-flight requests)."""

    def __init__(self, url: str, shape: LoadShape) -> None:
        self.tally = LoadTally()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=lambda: asyncio.run(_drive(url, shape, self._stop, self.tally)), daemon=True
        )

    def start(self) -> BackgroundLoad:
        self._thread.start()
        return self

    def stop(self, timeout: float = 120.0) -> LoadTally:
        self._stop.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            self.tally.failures.append("requests still in flight after the timeout")
        return self.tally


def wait_for(url: str, timeout: float = 60.0) -> None:
    """Wait until `url` answers 200 (an engine booting)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer within {timeout:.0f} s")
