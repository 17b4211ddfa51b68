"""Test helpers for the engine loop: build an LLMEngine on the tiny checkpoint, drive it to idle while
collecting every streamed output, and check that the pool is back to all blocks free."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtune.core.allocators import ContiguousAllocator, PagedAllocator
from kvtune.engine.loop.llm_engine import LLMEngine, RequestOutput
from kvtune.engine.model.engine_config import EngineConfig
from kvtune.engine.model.sampling import SamplingParams

BLOCK_SIZE = 16


def make_engine(model_dir: Path, **overrides: Any) -> LLMEngine:
    """The tiny model in float32 on the CPU kernel, a 4096-token pool of 16-token blocks unless overridden."""
    settings: dict[str, Any] = {"kv_cache_tokens": 4096, "block_size": BLOCK_SIZE, "dtype": "float32"}
    settings.update(overrides)
    return LLMEngine(EngineConfig(model=str(model_dir), **settings))


def greedy(max_tokens: int, **extra: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **extra)


def random_prompt(rng: random.Random, length: int) -> list[int]:
    """Byte tokens (ids 0..255 of the tiny tokenizer), so no special token sneaks into a prompt."""
    return [rng.randrange(256) for _ in range(length)]


@dataclass
class Choice:
    """Everything one choice of one request streamed."""

    token_ids: list[int] = field(default_factory=list)
    deltas: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    num_finished: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0

    @property
    def text(self) -> str:
        return "".join(self.deltas)


class Collector:
    """Accumulates RequestOutputs per (client request id, choice index)."""

    def __init__(self) -> None:
        self.choices: dict[tuple[str, int], Choice] = {}

    def add(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            choice = self.choices.setdefault((out.request_id, out.index), Choice())
            assert choice.num_finished == 0, f"{out.request_id}#{out.index} streamed after it finished"
            choice.token_ids += out.new_token_ids
            choice.deltas.append(out.new_text)
            choice.num_cached_tokens = out.num_cached_tokens
            choice.num_output_tokens = out.num_output_tokens
            if out.finished:
                choice.finish_reason = out.finish_reason
                choice.num_finished += 1

    def tokens(self, request_id: str, index: int = 0) -> list[int]:
        return self.choices[(request_id, index)].token_ids

    def __getitem__(self, request_id: str) -> Choice:
        return self.choices[(request_id, 0)]


def run_until_idle(
    engine: LLMEngine,
    collector: Collector | None = None,
    max_steps: int = 10_000,
    on_step: Callable[[int], None] | None = None,
) -> Collector:
    """Step the engine until it has no unfinished request; fail rather than loop forever."""
    collector = collector or Collector()
    for step in range(max_steps):
        if not engine.has_unfinished_requests():
            return collector
        collector.add(engine.step())
        if on_step is not None:
            on_step(step)
    raise AssertionError(f"the engine still has work after {max_steps} steps")


def generate(
    engine: LLMEngine, prompts: dict[str, list[int]], params: Callable[[str], SamplingParams]
) -> Collector:
    """Submit every prompt at once and run to idle."""
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, params(request_id))
    return run_until_idle(engine)


def assert_idle_and_all_free(engine: LLMEngine) -> None:
    """Nothing queued or running, no engine-side state left behind, every block of the pool free."""
    assert not engine.has_unfinished_requests()
    assert engine.num_running == 0 and engine.num_waiting == 0
    assert engine.scheduler.requests == {}
    assert engine.output.tracks == {}, f"engine still tracks {sorted(engine.output.tracks)}"
    alloc = engine.allocator
    assert alloc.slots_held == 0 and alloc.free_slots == alloc.num_slots
    assert alloc.capacity == {} and alloc.internal_slots == 0
    if isinstance(alloc, PagedAllocator):
        alloc.pool.check_invariants()
        assert alloc.pool.num_free_blocks == alloc.num_blocks and alloc.blocks == {}
    elif isinstance(alloc, ContiguousAllocator):
        assert alloc.free_runs == [(0, alloc.num_blocks)] and alloc.runs == {}
