"""No request can hurt another: eight greedy streams run while a corpus of hostile and faulting requests
is fired at the same server, and every stream ends with exactly the text it gets on a quiet server.

The corpus holds the fuzz findings (top_p that underflows float32, extreme temperatures, a top_k larger
than any vocabulary, NaN and Infinity in the JSON) and requests that make the engine raise inside its
step for that request only: the live engine's sampler raises for rows sampled with a marked seed, and its
model raises for any batch holding a marked chunk. Both hooks sit under the real `step()`, which must find
the culprit and fail it alone: a 500 (or a 400 when the fault is the input's), never a 503.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from kvtune.engine.loop.llm_engine import LLMEngine
from kvtune.engine.model.sampling import SamplingParams
from tests.server.live_server import LiveServer, Samples, scrape, start_server, total

HEALTHY = [
    {"prompt": f"Stream {i}: tell me about the number {i * 37} and why it matters.", "max_tokens": 46 + 2 * i}
    for i in range(8)
]
INTERNAL_SEED = 4242  # the sampler hook raises RuntimeError for these rows: an internal fault (500)
INPUT_SEED = 4343  # the sampler hook raises ValueError: the request's input is at fault (400)
FORWARD_MARKER = [7, 258, 7, 258, 7, 258]  # the model hook raises for a batch with a chunk holding this


@dataclass
class BadRequest:
    name: str
    body: dict[str, Any] | str  # a str is sent verbatim (JSON with NaN / Infinity)
    status: int
    stream: bool = False


CORPUS = [
    BadRequest("top_p=1e-46", {"prompt": "x", "max_tokens": 4, "top_p": 1e-46}, 200),
    BadRequest("top_p=5e-324", {"prompt": "x", "max_tokens": 4, "top_p": 5e-324, "seed": 3}, 200),
    BadRequest("temperature=1e-300", {"prompt": "x", "max_tokens": 4, "temperature": 1e-300}, 200),
    BadRequest("temperature=1e308", {"prompt": "x", "max_tokens": 4, "temperature": 1e308}, 400),
    BadRequest("top_k=1e30", {"prompt": "x", "max_tokens": 4, "top_k": 10**30, "temperature": 2.0}, 200),
    BadRequest("top_k=-5", {"prompt": "x", "max_tokens": 4, "top_k": -5}, 400),
    BadRequest("temperature=NaN", '{"prompt": "x", "max_tokens": 4, "temperature": NaN}', 400),
    BadRequest("top_p=Infinity", '{"prompt": "x", "max_tokens": 4, "top_p": Infinity}', 400),
    BadRequest("sampler fault", {"prompt": "sampler", "max_tokens": 30, "seed": INTERNAL_SEED}, 500),
    BadRequest("sampler fault, n=3", {"prompt": "n3", "max_tokens": 30, "seed": INTERNAL_SEED, "n": 3}, 500),
    BadRequest(
        "sampler fault, streamed",
        {"prompt": "stream", "max_tokens": 30, "seed": INTERNAL_SEED, "stream": True},
        500,
        stream=True,
    ),
    BadRequest("sampler input fault", {"prompt": "input", "max_tokens": 30, "seed": INPUT_SEED}, 400),
    BadRequest("forward fault", {"prompt": [65, 66, *FORWARD_MARKER, 67], "max_tokens": 30}, 500),
]


@pytest.fixture(scope="module")
def roomy_server(tiny_dir: Path) -> Iterator[LiveServer]:
    """Room for the eight streams and the whole corpus at once, so every fault shares a batch with them."""
    live = start_server(tiny_dir, "--kv-cache-tokens", "8192", "--max-num-seqs", "32")
    yield live
    live.stop()


@dataclass
class Faults:
    """What the hooks saw when they raised: how many requests the engine was running / batching."""

    sampler_running: list[int] = field(default_factory=list)
    forward_batch: list[int] = field(default_factory=list)
    real_model: Any = None


def install_faults(engine: LLMEngine, faults: Faults) -> None:
    """On the engine thread: make the live engine's sampler and model raise for the marked requests."""
    sample_row = engine.runner.sampler.sample_row
    model = faults.real_model = engine.runner.model

    def faulty_sample_row(
        logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
    ) -> int:
        if params.seed in (INTERNAL_SEED, INPUT_SEED):
            faults.sampler_running.append(engine.num_running)
            if params.seed == INPUT_SEED:
                raise ValueError("injected: this request's input cannot be sampled")
            raise RuntimeError("injected sampler fault")
        return sample_row(logits, params, generator)

    def faulty_model(
        input_ids: torch.Tensor, positions: torch.Tensor, metadata: Any, cache: Any
    ) -> torch.Tensor:
        starts = metadata.query_start_loc.tolist()
        width = len(FORWARD_MARKER)
        for s in range(metadata.num_seqs):
            ids = input_ids[starts[s] : starts[s + 1]].tolist()
            if any(ids[i : i + width] == FORWARD_MARKER for i in range(len(ids))):
                faults.forward_batch.append(metadata.num_seqs)
                raise RuntimeError("injected forward fault")
        out: torch.Tensor = model(input_ids, positions, metadata, cache)
        return out

    setattr(engine.runner.sampler, "sample_row", faulty_sample_row)  # noqa: B010 (shadowing a method on purpose)
    setattr(engine.runner, "model", faulty_model)  # noqa: B010


def remove_faults(engine: LLMEngine, faults: Faults) -> None:
    del engine.runner.sampler.sample_row  # the instance attribute: the class's method shows through again
    setattr(engine.runner, "model", faults.real_model)  # noqa: B010


async def healthy_stream(http: httpx.AsyncClient, body: dict[str, Any], started: asyncio.Event) -> str:
    text, chunks, finish = "", 0, None
    request = {**body, "temperature": 0, "ignore_eos": True, "stream": True}
    async with http.stream("POST", "/v1/completions", json=request) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            text += chunk["choices"][0]["text"]
            finish = chunk["choices"][0]["finish_reason"] or finish
            chunks += 1
            if chunks == 3:
                started.set()
    assert finish == "length"
    return text


async def send_bad(http: httpx.AsyncClient, bad: BadRequest) -> tuple[int, dict[str, Any] | None]:
    """The status a client sees, and the error body (for a stream: the error event) if there is one."""
    kwargs: dict[str, Any] = (
        {"content": bad.body, "headers": {"content-type": "application/json"}}
        if isinstance(bad.body, str)
        else {"json": bad.body}
    )
    if not bad.stream:
        response = await http.post("/v1/completions", **kwargs)
        error = response.json().get("error") if response.status_code != 200 else None
        return response.status_code, error
    async with http.stream("POST", "/v1/completions", **kwargs) as response:
        assert response.status_code == 200  # the status line went out before the fault
        events = [json.loads(line[6:]) async for line in response.aiter_lines() if line.startswith("data: {")]
    errors = [e["error"] for e in events if "error" in e]
    assert len(errors) == 1, events
    status = {"internal_server_error": 500, "invalid_request_error": 400}[errors[0]["type"]]
    return status, errors[0]


async def run_healthy(url: str, corpus: list[BadRequest]) -> tuple[list[str], list[tuple[int, Any]]]:
    """The eight streams; once each has streamed a few chunks, the corpus (twice over) fires among them."""
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        started = [asyncio.Event() for _ in HEALTHY]
        streams = [
            asyncio.create_task(healthy_stream(http, body, ev))
            for body, ev in zip(HEALTHY, started, strict=True)
        ]
        await asyncio.wait_for(asyncio.gather(*(ev.wait() for ev in started)), timeout=60)
        bad = await asyncio.gather(*(send_bad(http, b) for b in corpus + corpus))
        texts = await asyncio.gather(*streams)
    return list(texts), list(bad)


def counts(samples: Samples, name: str, label: str) -> dict[str, float]:
    return {labels[label]: value for labels, value in samples.get(name, [])}


def test_healthy_streams_are_untouched_by_hostile_and_faulting_requests(roomy_server: LiveServer) -> None:
    quiet, _ = asyncio.run(run_healthy(roomy_server.url, []))
    with httpx.Client(base_url=roomy_server.url) as http:
        before = scrape(http)
    faults = Faults()
    roomy_server.on_engine(lambda e: install_faults(e, faults))
    try:
        loud, bad = asyncio.run(run_healthy(roomy_server.url, CORPUS))
    finally:
        roomy_server.on_engine(lambda e: remove_faults(e, faults))
    assert loud == quiet
    for request, (status, error) in zip(CORPUS + CORPUS, bad, strict=True):
        assert status == request.status, (request.name, status, error)
        if status == 500:
            assert error is not None and error["type"] == "internal_server_error", error
    # Each fault hit a step that was running other requests too, so isolation was really exercised.
    # (a forward fault raises first in the shared batch, then again in its own solo retry)
    assert max(faults.forward_batch) > 1 and faults.forward_batch.count(1) == 2
    assert faults.sampler_running and min(faults.sampler_running) > 1

    roomy_server.wait_idle()
    with httpx.Client(base_url=roomy_server.url) as http:
        after = scrape(http)
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert total(after, gauge) == 0, gauge
    assert roomy_server.blocks_held() == 0
    failures_before = counts(before, "kvtune:request_failures_total", "reason")
    failures = counts(after, "kvtune:request_failures_total", "reason")
    delta = {k: failures[k] - failures_before.get(k, 0) for k in failures}
    assert delta == {"forward": 2, "sampling": 8, "output": 0, "step": 0}
    finished_before = counts(before, "vllm:request_success_total", "finished_reason")
    finished = counts(after, "vllm:request_success_total", "finished_reason")
    assert finished["abort"] == finished_before["abort"]  # failures are not client aborts
    assert finished["error"] - finished_before["error"] == 2 * (1 + 3 + 1 + 1 + 1)
