"""The one load generator of the benchmarks (and the demo): completions sent to any OpenAI-compatible
server, as vLLM and kvtune both accept them (`/v1/completions`, prompts as token-id lists, `ignore_eos`).

Two ways to send one request, and three ways to drive many:
- `post_completion`: non-streamed; token counts from the response's `usage`. On a small machine the client
  shares the cores with the server under test, and one JSON response per request costs it almost nothing.
- `stream_completion`: streamed, timing the first token (TTFT) and the gaps between tokens (ITL); it may
  close the stream after a given number of tokens, which servers treat as an abort.
- `run_batch`: open loop, every request at once, non-streamed (the peer comparison, doctor-vllm);
- `run_open_loop`: Poisson arrivals, at most `concurrency` in flight, streamed (`kvtune bench serve`);
- `BackgroundLoad`: closed loop, `clients` workers each sending one request after another until stopped,
  non-streamed, every request counted so a lost one shows (`kvtune bench tuner`, the closed-loop tests).
Each open-loop run scrapes `/metrics` before and after, for the server's preemption delta.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
import numpy as np

from kvtune.contract.metrics import DETECTOR_SECONDS
from kvtune.harness.scrape import counter_delta, preemption_delta, scrape_totals

Body = dict[str, Any]
_ERROR_CHARS = 200


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    error: str | None = None


def _http_error(response: httpx.Response, text: str) -> RequestResult:
    return RequestResult(ok=False, error=f"HTTP {response.status_code}: {text[:_ERROR_CHARS]}")


def _exception(err: Exception) -> RequestResult:
    return RequestResult(ok=False, error=f"{type(err).__name__}: {err}")


async def post_completion(client: httpx.AsyncClient, url: str, body: Body) -> RequestResult:
    """One non-streamed completion; prompt and output tokens from the response's `usage`."""
    try:
        response = await client.post(f"{url}/v1/completions", json=body)
        if response.status_code != 200:
            return _http_error(response, response.text)
        usage = response.json()["usage"]
        return RequestResult(True, int(usage["prompt_tokens"]), int(usage["completion_tokens"]))
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as err:
        return _exception(err)


async def stream_completion(
    client: httpx.AsyncClient, url: str, body: Body, read_tokens: int | None = None
) -> RequestResult:
    """One streamed completion; a token is a stream chunk that carries a choice. With `read_tokens`, the
    stream is closed after that many tokens (the server sees a client abort and frees the request)."""
    truncate = read_tokens is not None
    result = RequestResult(ok=False, prompt_tokens=len(body.get("prompt", [])))
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                return _http_error(response, (await response.aread()).decode(errors="replace"))
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"].get("message", chunk["error"]))
                    return result
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"].get("prompt_tokens", result.prompt_tokens)
                    if not truncate:
                        result.output_tokens = chunk["usage"].get("completion_tokens", result.output_tokens)
                if not chunk.get("choices"):
                    continue
                now = time.perf_counter()
                if result.ttft is None:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
                result.output_tokens += 1
                if read_tokens is not None and result.output_tokens >= read_tokens:
                    break  # leaving the block closes the connection: the server aborts the request
    except (httpx.HTTPError, json.JSONDecodeError) as err:
        return _exception(err)
    result.ok = True
    return result


# --- open loop, every request at once ---------------------------------------------------------------------
@dataclass(frozen=True)
class BatchSpec:
    """The saturating workload by default: 96 requests at once, 300–700 in, 500–1500 out."""

    num_requests: int = 96
    prompt_tokens: tuple[int, int] = (300, 700)
    output_tokens: tuple[int, int] = (500, 1500)
    token_id_range: tuple[int, int] = (0, 255)  # the tiny tokenizer's byte tokens
    seed: int = 0
    request_timeout_s: float = 3600.0


def batch_bodies(spec: BatchSpec, model: str) -> list[Body]:
    """Seeded random prompts (lists of token ids) and output lengths; the same every run for one seed."""
    rng = random.Random(spec.seed)
    low_id, high_id = spec.token_id_range
    bodies: list[Body] = []
    for _ in range(spec.num_requests):
        prompt_len = rng.randint(*spec.prompt_tokens)
        bodies.append(
            {
                "model": model,
                "prompt": [rng.randint(low_id, high_id) for _ in range(prompt_len)],
                "max_tokens": rng.randint(*spec.output_tokens),
                "ignore_eos": True,
                "temperature": 0.0,
            }
        )
    return bodies


@dataclass(frozen=True)
class LoadResult:
    num_requests: int
    completed: int
    failed: int
    prompt_tokens: int
    generated_tokens: int
    duration_s: float
    generated_tokens_per_s: float
    preemptions: float | None
    first_error: str | None
    # time kvtune's prefix-defeat detector spent during the batch (None: a server without one)
    detector_seconds: float | None = None

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


async def run_batch(url: str, model: str, spec: BatchSpec) -> LoadResult:
    """Send the spec's requests all at once, wait for all; tokens/s = completion tokens ÷ wall time of the
    batch."""
    bodies = batch_bodies(spec, model)
    limits = httpx.Limits(max_connections=spec.num_requests + 4, max_keepalive_connections=spec.num_requests)
    async with httpx.AsyncClient(timeout=spec.request_timeout_s, limits=limits) as client:
        before = await scrape_totals(client, url)
        start = time.perf_counter()
        results = await asyncio.gather(*(post_completion(client, url, body) for body in bodies))
        duration = time.perf_counter() - start
        after = await scrape_totals(client, url)
    done = [r for r in results if r.ok]
    errors = [r.error for r in results if not r.ok]
    generated = sum(r.output_tokens for r in done)
    return LoadResult(
        num_requests=spec.num_requests,
        completed=len(done),
        failed=len(errors),
        prompt_tokens=sum(r.prompt_tokens for r in done),
        generated_tokens=generated,
        duration_s=round(duration, 3),
        generated_tokens_per_s=round(generated / duration, 2) if duration > 0 else 0.0,
        preemptions=preemption_delta(before, after),
        first_error=errors[0] if errors else None,
        detector_seconds=counter_delta(before, after, DETECTOR_SECONDS),
    )


# --- open loop, Poisson arrivals, streamed ----------------------------------------------------------------
@dataclass(frozen=True)
class StreamedRequest:
    body: Body
    read_tokens: int | None = None  # close the stream after this many tokens; None: read to the end


async def run_open_loop(
    url: str,
    requests: list[StreamedRequest],
    *,
    request_rate: float,
    concurrency: int | None,
    seed: int,
    timeout_s: float,
) -> tuple[list[RequestResult], float, float | None]:
    """Send every request streamed, at `request_rate` Poisson arrivals per second (inf: all at once), at
    most `concurrency` at once; returns the results, the duration and the preemption delta."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(timeout_s, connect=30.0)
    gate = asyncio.Semaphore(concurrency) if concurrency else None
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / request_rate, len(requests)) if math.isfinite(request_rate) else None
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        before = await scrape_totals(client, url)

        async def one(request: StreamedRequest, delay: float) -> RequestResult:
            await asyncio.sleep(delay)
            if gate is None:
                return await stream_completion(client, url, request.body, request.read_tokens)
            async with gate:
                return await stream_completion(client, url, request.body, request.read_tokens)

        delays = np.cumsum(gaps).tolist() if gaps is not None else [0.0] * len(requests)
        start = time.perf_counter()
        results = await asyncio.gather(*(one(r, d) for r, d in zip(requests, delays, strict=True)))
        duration = time.perf_counter() - start
        after = await scrape_totals(client, url)
    return list(results), duration, preemption_delta(before, after)


# --- closed loop, until stopped ---------------------------------------------------------------------------
# A client whose request failed (an engine restarting) backs off as real clients do, 0.2 s doubling to 2 s, so
# a restart costs each client a handful of refused attempts, not one every 0.2 s.
FAILURE_PAUSE_S = 0.2
FAILURE_PAUSE_MAX_S = 2.0


@dataclass(frozen=True)
class LoadShape:
    clients: int = 16
    prompt_len: tuple[int, int] = (40, 80)
    output_len: tuple[int, int] = (80, 160)
    model: str = "tiny"
    seed: int = 0
    # declared max_tokens above the real answer: each request asks for this many, is streamed, and the client
    # closes the stream after its drawn output length (as `kvtune bench serve --max-tokens`); None: ask for
    # exactly the drawn length, non-streamed
    declared_max_tokens: int | None = None
    # token ids put ahead of each prompt's random part, called per request (the demo's shared system prompt,
    # whose layout it changes while the load runs); None: all random
    prompt_head: Callable[[], list[int]] | None = None


@dataclass(frozen=True)
class Failure:
    """A request not answered in full: when the client gave up on it (epoch seconds) and what it saw."""

    at: float
    error: str

    def __str__(self) -> str:
        return self.error


def failure_cause(error: str) -> str:
    """A failure's cause in a few words, from the text the client recorded: failures grouped by cause say
    why (a restarting engine refuses connections; an overloaded one answers 429) where a count would not."""
    if error.startswith("HTTP "):
        return error.split(":", 1)[0]
    if error.startswith("ConnectError"):
        return "connection refused (engine down or restarting)"
    if error.startswith(("RemoteProtocolError", "ReadError")):
        return "connection closed mid-answer"
    if error.endswith("tokens generated"):
        return "answer shorter than asked"
    if "Timeout" in error.split(":", 1)[0]:
        return "timed out"
    return error.split(":", 1)[0]


@dataclass
class LoadTally:
    sent: int = 0
    completed: int = 0
    generated_tokens: int = 0
    failures: list[Failure] = field(default_factory=list)
    # (finished at, seconds) of each completed request, client-side, for latency percentiles over a span
    latencies: list[tuple[float, float]] = field(default_factory=list)


async def _client(
    http: httpx.AsyncClient,
    url: str,
    shape: LoadShape,
    rng: random.Random,
    stop: threading.Event,
    tally: LoadTally,
) -> None:
    failed_in_a_row = 0
    while not stop.is_set():
        head = shape.prompt_head() if shape.prompt_head is not None else []
        prompt = head + [rng.randrange(32, 127) for _ in range(rng.randint(*shape.prompt_len))]
        max_tokens = rng.randint(*shape.output_len)
        body = {"model": shape.model, "prompt": prompt, "max_tokens": shape.declared_max_tokens or max_tokens,
                "ignore_eos": True, "temperature": 0.0}  # fmt: skip
        tally.sent += 1
        started = time.perf_counter()
        if shape.declared_max_tokens is None:
            result = await post_completion(http, url, body)
        else:
            result = await stream_completion(http, url, {**body, "stream": True}, read_tokens=max_tokens)
        failed_in_a_row = 0 if result.ok else failed_in_a_row + 1
        if not result.ok:
            tally.failures.append(Failure(time.time(), str(result.error)))
            await asyncio.sleep(min(FAILURE_PAUSE_S * 2 ** (failed_in_a_row - 1), FAILURE_PAUSE_MAX_S))
        elif result.output_tokens != max_tokens:
            tally.failures.append(
                Failure(time.time(), f"{result.output_tokens} of {max_tokens} tokens generated")
            )
        else:
            tally.completed += 1
            tally.generated_tokens += max_tokens
            tally.latencies.append((time.time(), time.perf_counter() - started))


async def _drive(url: str, shape: LoadShape, stop: threading.Event, tally: LoadTally) -> None:
    limits = httpx.Limits(max_connections=shape.clients + 4)
    async with httpx.AsyncClient(timeout=300, limits=limits) as http:
        rngs = [random.Random(shape.seed * 1000 + i) for i in range(shape.clients)]
        await asyncio.gather(*(_client(http, url, shape, rng, stop, tally) for rng in rngs))


class BackgroundLoad:
    """The closed loop in a thread of its own: `start()`, later `stop()` (waits for in-flight requests)."""

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
            self.tally.failures.append(Failure(time.time(), "requests still in flight after the timeout"))
        return self.tally
