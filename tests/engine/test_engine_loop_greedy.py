"""Correct under pressure: greedy tokens through LLMEngine equal transformers' `generate`, and do not change
when a request is preempted and recomputed, served from the prefix cache, placed by another allocator, or
prefilled in chunks."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from engine_loop_driver import (
    BLOCK_SIZE,
    Collector,
    assert_idle_and_all_free,
    generate,
    greedy,
    make_engine,
    random_prompt,
    run_until_idle,
)
from engine_runner import hf_greedy
from greedy_workload import NEW_TOKENS, SMALL_POOL_TOKENS, WORKLOAD, workload_params

from kvtune.core.scheduler import SchedulerStep

HF_PROMPTS = ["Hello", "The capital of France is", "1 2 3 4 5", "Once upon a time, in a land far away,"]
HF_NEW_TOKENS = 24


@pytest.fixture(scope="module")
def baseline(tiny_dir: Path) -> dict[str, list[int]]:
    """Greedy tokens of the workload on a roomy pool: no preemption, whole prompts in one step."""
    engine = make_engine(tiny_dir)
    done = generate(engine, WORKLOAD, workload_params)
    assert engine.counters.num_preemptions == 0
    assert_idle_and_all_free(engine)
    return {rid: done.tokens(rid) for rid in WORKLOAD}


def _assert_same_tokens(done: Collector, baseline: dict[str, list[int]]) -> None:
    for rid, expected in baseline.items():
        assert len(expected) == NEW_TOKENS
        assert done[rid].finish_reason == "length"
        assert done.tokens(rid) == expected, f"{rid} diverged"


def test_greedy_through_the_engine_equals_transformers_generate(tiny_dir: Path, hf_tiny: Any) -> None:
    engine = make_engine(tiny_dir)
    prompts = {f"p{i}": engine.tokenizer.encode(text) for i, text in enumerate(HF_PROMPTS)}
    done = generate(engine, prompts, lambda _: greedy(HF_NEW_TOKENS))
    for rid, prompt in prompts.items():
        assert done.tokens(rid) == hf_greedy(hf_tiny, prompt, HF_NEW_TOKENS), rid
    assert_idle_and_all_free(engine)


def test_preempted_and_recomputed_requests_generate_the_same_tokens(
    tiny_dir: Path, baseline: dict[str, list[int]]
) -> None:
    engine = make_engine(tiny_dir, kv_cache_tokens=SMALL_POOL_TOKENS)
    done = generate(engine, WORKLOAD, workload_params)
    assert engine.counters.num_preemptions > 0
    _assert_same_tokens(done, baseline)
    # Cached tokens are the prompt's hit at first admission (as vLLM reports them), not the recompute's
    # hit on the request's own blocks; these random prompts share nothing.
    assert {rid: done[rid].num_cached_tokens for rid in WORKLOAD} == dict.fromkeys(WORKLOAD, 0)
    assert engine.counters.prefix_cache_hits == 0
    assert_idle_and_all_free(engine)


def test_preemption_without_prefix_caching_recomputes_the_same_tokens(
    tiny_dir: Path, baseline: dict[str, list[int]]
) -> None:
    engine = make_engine(tiny_dir, kv_cache_tokens=SMALL_POOL_TOKENS, enable_prefix_caching=False)
    done = generate(engine, WORKLOAD, workload_params)
    assert engine.counters.num_preemptions > 0
    _assert_same_tokens(done, baseline)
    assert_idle_and_all_free(engine)


@pytest.mark.parametrize("allocator", ["paged", "contiguous", "oracle"])
def test_every_allocator_generates_the_same_tokens(
    tiny_dir: Path, baseline: dict[str, list[int]], allocator: str
) -> None:
    # 64 blocks: the contiguous policies (power-of-two reservations of 16 blocks) hold four at a time.
    engine = make_engine(tiny_dir, kv_cache_tokens=64 * BLOCK_SIZE, allocator=allocator)
    done = generate(engine, WORKLOAD, workload_params)
    _assert_same_tokens(done, baseline)
    assert_idle_and_all_free(engine)


def test_chunked_prefill_generates_the_same_tokens(
    tiny_dir: Path, baseline: dict[str, list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    budget = 24  # not a multiple of the block size: chunks end mid-block
    engine = make_engine(tiny_dir, max_num_batched_tokens=budget)
    steps: list[SchedulerStep] = []
    schedule = engine.scheduler.schedule

    def recording_schedule() -> SchedulerStep:
        steps.append(schedule())
        return steps[-1]

    monkeypatch.setattr(engine.scheduler, "schedule", recording_schedule)
    done = generate(engine, WORKLOAD, workload_params)
    assert max(step.total_tokens for step in steps) <= budget
    partial = [n for step in steps for n in step.num_tokens if 1 < n < budget]
    assert partial, "no prompt was split across steps"
    _assert_same_tokens(done, baseline)
    assert_idle_and_all_free(engine)


def test_chunked_prefill_on_a_preempting_pool_generates_the_same_tokens(
    tiny_dir: Path, baseline: dict[str, list[int]]
) -> None:
    engine = make_engine(tiny_dir, kv_cache_tokens=SMALL_POOL_TOKENS, max_num_batched_tokens=40)
    done = generate(engine, WORKLOAD, workload_params)
    assert engine.counters.num_preemptions > 0
    _assert_same_tokens(done, baseline)
    assert_idle_and_all_free(engine)


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-caching", "no-prefix-caching"])
def test_a_prefix_served_from_the_cache_generates_the_same_tokens(
    tiny_dir: Path, prefix_caching: bool
) -> None:
    rng = random.Random(11)
    shared = random_prompt(rng, 120)
    first, second = shared + random_prompt(rng, 20), shared + random_prompt(rng, 13)
    engine = make_engine(tiny_dir, enable_prefix_caching=prefix_caching)
    done = Collector()
    for rid, prompt in [("first", first), ("second", second), ("again", first)]:
        engine.add_request(rid, prompt, greedy(NEW_TOKENS, ignore_eos=True))
        run_until_idle(engine, done)  # one at a time: each finds the blocks of the ones before
    if prefix_caching:
        assert done["first"].num_cached_tokens == 0
        assert done["second"].num_cached_tokens == (120 // BLOCK_SIZE) * BLOCK_SIZE
        # A full hit still computes the prompt's last token, which lives in its last block.
        assert done["again"].num_cached_tokens == ((len(first) - 1) // BLOCK_SIZE) * BLOCK_SIZE
        assert engine.counters.prefix_cache_hits == sum(
            done[r].num_cached_tokens for r in ("second", "again")
        )
    else:
        assert all(done[rid].num_cached_tokens == 0 for rid in ("first", "second", "again"))
        assert engine.counters.prefix_cache_hits == 0
    alone = generate(make_engine(tiny_dir, enable_prefix_caching=False), {"second": second}, workload_params)
    assert done.tokens("second") == alone.tokens("second")
    assert done.tokens("again") == done.tokens("first")
    assert_idle_and_all_free(engine)
