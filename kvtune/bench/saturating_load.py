"""A small saturating load for any OpenAI-compatible server: N requests at once, token-id prompts.

It is the peer benchmark's own client, kept apart from `kvtune bench serve` so the vLLM figures can be
taken without the general load generator; it measures generated tokens per second over the whole batch
and the server's preemption count delta from its Prometheus `/metrics`.
"""

from __future__ import annotations

import asyncio
import random
import re
import time
from dataclasses import asdict, dataclass

import httpx

from kvtune.errors import KvtuneError

PREEMPTIONS_METRIC = "vllm:num_preemptions_total"
_SAMPLE_LINE = re.compile(r"^(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)(?:\{[^}]*\})?\s+(?P<value>\S+)")


@dataclass(frozen=True)
class LoadSpec:
    """The issue's saturating workload by default: 96 requests at once, 300–700 in, 500–1500 out."""

    num_requests: int = 96
    prompt_tokens: tuple[int, int] = (300, 700)
    output_tokens: tuple[int, int] = (500, 1500)
    token_id_range: tuple[int, int] = (0, 255)  # the tiny tokenizer's byte tokens
    seed: int = 0
    request_timeout_s: float = 3600.0


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

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def metric_samples(text: str) -> dict[str, float]:
    """Prometheus text → {metric name: sum over its label sets} (comment lines skipped)."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE_LINE.match(line)
        if match is None:
            continue
        try:
            value = float(match.group("value"))
        except ValueError:
            continue
        totals[match.group("name")] = totals.get(match.group("name"), 0.0) + value
    return totals


def request_bodies(spec: LoadSpec, model: str) -> list[dict[str, object]]:
    """Seeded random prompts (lists of token ids) and output lengths; the same every run for one seed."""
    rng = random.Random(spec.seed)
    low_id, high_id = spec.token_id_range
    bodies: list[dict[str, object]] = []
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


async def _scrape(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    response = await client.get(f"{url}/metrics")
    response.raise_for_status()
    return metric_samples(response.text)


async def _one(client: httpx.AsyncClient, url: str, body: dict[str, object]) -> tuple[int, int]:
    response = await client.post(f"{url}/v1/completions", json=body)
    if response.status_code != 200:
        raise KvtuneError(f"HTTP {response.status_code}: {response.text[:300]}")
    usage = response.json()["usage"]
    return int(usage["prompt_tokens"]), int(usage["completion_tokens"])


async def run_load(url: str, model: str, spec: LoadSpec) -> LoadResult:
    """Send every request at once, wait for all; tokens/s = completion tokens ÷ wall time of the batch."""
    bodies = request_bodies(spec, model)
    limits = httpx.Limits(max_connections=spec.num_requests + 4, max_keepalive_connections=spec.num_requests)
    async with httpx.AsyncClient(timeout=spec.request_timeout_s, limits=limits) as client:
        before = await _scrape(client, url)
        start = time.perf_counter()
        outcomes = await asyncio.gather(*(_one(client, url, body) for body in bodies), return_exceptions=True)
        duration = time.perf_counter() - start
        after = await _scrape(client, url)
    done = [outcome for outcome in outcomes if isinstance(outcome, tuple)]
    errors = [outcome for outcome in outcomes if isinstance(outcome, BaseException)]
    generated = sum(completion for _, completion in done)
    preemptions = None
    if PREEMPTIONS_METRIC in after:
        preemptions = after[PREEMPTIONS_METRIC] - before.get(PREEMPTIONS_METRIC, 0.0)
    return LoadResult(
        num_requests=spec.num_requests,
        completed=len(done),
        failed=len(errors),
        prompt_tokens=sum(prompt for prompt, _ in done),
        generated_tokens=generated,
        duration_s=round(duration, 3),
        generated_tokens_per_s=round(generated / duration, 2) if duration > 0 else 0.0,
        preemptions=preemptions,
        first_error=f"{type(errors[0]).__name__}: {errors[0]}" if errors else None,
    )
